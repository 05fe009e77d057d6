"""Issue 26 item 5 on a GPU: a `vsnap activate` SIGKILLed at each point of bringing a detached
standby up must not leave its tree holding the GPU. On the H200 before the activator's heartbeat,
a tree killed after its CUDA restore waited without a timeout, one killed at serve until timeout_s,
each holding 617 MiB to 72 GB; the tree now ends itself once activator.json is silent for
ACTIVATOR_TIMEOUT_S, and this test checks, for each point, that its processes are gone and that no
process of it holds GPU memory (nvidia-smi's compute apps), within ACTIVATOR_TIMEOUT_S + 10 s.

Needs a captured vLLM image: VSNAP_TEST_IMAGE (scripts/gpu-kill-points.sh passes gpu-e2e's tiny
one). VSNAP_KILL_POINTS (comma-separated) replaces the points: with a CPU image and the CPU
engine's points it rehearses this test's own logic on a machine without a GPU.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import engine_processes
from tests.integration.conftest import run_vsnap
from tests.integration.test_standby import json_of, kill_activator, records
from vsnap import read_manifest
from vsnap.protocol import control

pytestmark = [pytest.mark.gpu, pytest.mark.criu]

IMAGE = os.environ.get("VSNAP_TEST_IMAGE", "")
if not IMAGE or not (Path(IMAGE) / "manifest.json").is_file():
    pytest.skip("needs VSNAP_TEST_IMAGE, a captured image (scripts/gpu-kill-points.sh)", allow_module_level=True)

# "cuda restore": killed before the CUDA state is restored (the activator's heartbeat runs already);
# "after cuda restore": the GPU memory is back, recovery not yet asked for; "recover": recovery about
# to be asked; "activation.json": killed as soon as the tree was asked to recover (weights reloading,
# oracle); "serve": the tree recovered and waits for its socket
GPU_POINTS = ["cuda restore", "after cuda restore", "recover", "activation.json", "serve"]
POINTS = [p for p in os.environ.get("VSNAP_KILL_POINTS", "").split(",") if p] or GPU_POINTS
RESULTS = Path(os.environ.get("VSNAP_KILL_POINTS_OUT", "/tmp/vsnap-kill-points.jsonl"))


def gpu_holders() -> dict[int, int]:
    """pid -> MiB of GPU memory of every process that holds some (nvidia-smi's compute apps)."""
    if shutil.which("nvidia-smi") is None:
        return {}
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, timeout=30).stdout
    held = {}
    for line in out.splitlines():
        pid, _, mib = line.partition(",")
        if pid.strip().isdigit():
            held[int(pid)] = int(mib.strip() or 0) if mib.strip().isdigit() else 0
    return held


def tree_of(root: int) -> set[int]:
    """``root`` and its descendants alive now (vLLM's EngineCore renames itself: no command line to
    find it by, only its parent)."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                parents[int(entry)] = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    tree, grew = {root} & set(parents), True
    while grew:
        more = {pid for pid, parent in parents.items() if parent in tree} - tree
        tree |= more
        grew = bool(more)
    return tree


@pytest.mark.parametrize("point", POINTS)
def test_an_activator_killed_at_each_point_frees_the_gpu_within_seconds(point: str) -> None:
    image = Path(IMAGE)
    manifest = read_manifest(image)
    control_dir = Path(manifest.control_dir)
    waiting = json_of(run_vsnap("restore", str(image), "--standby", "--detach", "--json"))
    instance, root = waiting["instance"], int(waiting["pid"])
    try:
        tree = tree_of(root)  # its processes (vLLM's EngineCore too): only these count as the standby's
        assert tree, "the standby's tree is not running"
        killed = kill_activator(instance, point, Path(f"{control_dir}.instances") / instance / control.ACTIVATION)
        killed_at = time.monotonic()
        assert killed.returncode == -signal.SIGKILL, f"the activator was not killed at {point!r}: {killed.stderr}"
        tree |= tree_of(root)
        held_after_kill = {pid: mib for pid, mib in gpu_holders().items() if pid in tree}
        deadline = killed_at + control.ACTIVATOR_TIMEOUT_S + 10

        def left() -> tuple[set[int], dict[int, int]]:
            return tree_of(root), {pid: mib for pid, mib in gpu_holders().items() if pid in tree}

        processes, held = left()
        while (processes or held) and time.monotonic() < deadline:
            time.sleep(0.1)
            processes, held = left()
        freed_s = time.monotonic() - killed_at
        with open(RESULTS, "a") as f:
            f.write(json.dumps({"point": point, "freed_s": round(freed_s, 2), "held_mib_after_kill": held_after_kill,
                                "processes_left": sorted(processes), "gpu_held_left": held,
                                "cuda_processes": manifest.cuda_processes}) + "\n")
        print(f"{point}: tree gone and GPU freed {freed_s:.1f} s after the kill "
              f"(held after the kill: {sum(held_after_kill.values())} MiB)")
        assert not processes and not held, f"{point}: left {sorted(processes)}, GPU held {held}"
        assert engine_processes(control_dir) == []
        assert [r for r in records(image) if r.id == instance] == []
    finally:
        run_vsnap("stop", instance)
