#!/usr/bin/env python3
"""A fresh node's time to first completion: the image and its model come from a registry.

    python scripts/fresh_node.py IMAGE --registry-root DIR --out DIR [--parts 4,8] [--runs 1]
                                  --i-may-delete-the-model

Starts Debian's docker-registry on loopback (its storage in --registry-root: a tmpfs such as
/dev/shm stands for a registry on another host, whose disk is not this node's), pushes IMAGE with
its model (`vsnap push --model`), then removes the local image (`vsnap rm`) and the model
directory (only with --i-may-delete-the-model: the model is in the registry by then). Each run,
for each --parts: the page cache dropped (when this host lets root), then from one clock:
`vsnap pull REF --model-dir M` (the image back at its path and its model at the path it records),
`vsnap restore IMAGE --detach`, and one completion over HTTP; then `vsnap stop`, and the image
and model removed again for the next run (the last run's are left in place). Writes
fresh-node.json (every run's phases) and fresh-node.md (a table) into --out, and prints the table.

What it counts, as the issue asks: everything a node without the image and the model needs, the
model's bytes included; what it does not: starting the registry, the push.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

DOCKER_REGISTRY = "/usr/bin/docker-registry"


def vsnap(*args: str, env: dict[str, str] | None = None, timeout: float = 900) -> dict[str, Any]:
    """``vsnap ARGS --json``: its document (exits on failure, printing what vsnap said)."""
    result = subprocess.run([sys.executable, "-m", "vsnap", *args, "--json"], capture_output=True, text=True,
                            timeout=timeout, env={**os.environ, **(env or {})})
    if result.returncode != 0:
        sys.exit(f"vsnap {' '.join(args)} exited {result.returncode}:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return json.loads(result.stdout) if result.stdout.strip() else {}


class Registry:
    def __init__(self, binary: str, root: Path) -> None:
        self.binary, self.root = binary, root
        self.process: subprocess.Popen[bytes] | None = None
        self.address = ""

    def __enter__(self) -> "Registry":
        self.root.mkdir(parents=True, exist_ok=True)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        config = self.root / "config.yml"
        config.write_text(f"version: 0.1\nlog:\n  level: warn\n  accesslog:\n    disabled: true\n"
                          f"storage:\n  filesystem:\n    rootdirectory: {self.root / 'storage'}\n"
                          f"http:\n  addr: 127.0.0.1:{port}\n")
        with open(self.root / "registry.log", "ab") as log:
            self.process = subprocess.Popen([self.binary, "serve", str(config)], stdout=log, stderr=log,
                                            stdin=subprocess.DEVNULL, start_new_session=True)
        self.address = f"127.0.0.1:{port}"
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                urllib.request.urlopen(f"http://{self.address}/v2/", timeout=2).close()
                return self
            except OSError:
                if self.process.poll() is not None:
                    break
                time.sleep(0.1)
        self.__exit__()
        sys.exit(f"docker-registry did not start; see {self.root / 'registry.log'}")

    def __exit__(self, *_: object) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def drop_page_cache() -> bool:
    """Write back, then drop the page cache (the registry's storage on a tmpfs stays: it is RAM)."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def first_completion(url: str, model: str, timeout_s: float = 300) -> str:
    body = json.dumps({"model": model, "prompt": "The capital of France is", "max_tokens": 8,
                       "temperature": 0}).encode()
    request = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout_s) as answer:
        return json.loads(answer.read())["choices"][0]["text"]


def remove_local(image: Path, model: Path) -> None:
    if (image / "manifest.json").exists():
        vsnap("rm", str(image))
    if model.exists():
        shutil.rmtree(model)


def run_once(ref: str, image: Path, model: Path, served: str, parts: int, port: int) -> dict[str, Any]:
    dropped = drop_page_cache()
    env = {"VSNAP_PULL_PARTS": str(parts)}
    started = time.monotonic()
    pull = vsnap("pull", ref, "--to", str(image), "--model-dir", str(model), env=env)
    pulled = time.monotonic()
    restore = vsnap("restore", str(image), "--detach", "--port", str(port))
    restored = time.monotonic()
    try:
        text = first_completion(restore["url"], served)
        answered = time.monotonic()
    finally:  # never a restored server left holding the GPU
        vsnap("stop", restore["instance"])
    nbytes = pull["bytes_received"] + pull["model_bytes_received"]
    return {
        "parts": parts, "page_cache_dropped": dropped, "pull_s": round(pulled - started, 3),
        "restore_s": round(restored - pulled, 3), "completion_s": round(answered - restored, 3),
        "first_completion_s": round(answered - started, 3), "bytes_received": nbytes,
        "pull_gb_per_s": round(nbytes / (pulled - started) / 1e9, 3), "image_bytes": pull["image_bytes"],
        "model_bytes": pull["model_bytes"], "model_fetched": pull["model_fetched"], "pull_timings": pull["timings"],
        "restore_timings": restore["timings"], "restore_recovery": restore.get("recovery"), "text": text,
    }


def table(runs: list[dict[str, Any]]) -> str:
    lines = ["| parts | pull s | GB received | pull GB/s | restore s | completion s | first completion s | cache dropped |",
             "|---|---|---|---|---|---|---|---|"]
    for r in runs:
        lines.append(f"| {r['parts']} | {r['pull_s']:.2f} | {r['bytes_received'] / 1e9:.2f} | {r['pull_gb_per_s']:.2f} "
                     f"| {r['restore_s']:.2f} | {r['completion_s']:.2f} | **{r['first_completion_s']:.2f}** "
                     f"| {'yes' if r['page_cache_dropped'] else 'no'} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("image", type=Path)
    parser.add_argument("--registry-root", type=Path, required=True)
    parser.add_argument("--registry-bin", default=DOCKER_REGISTRY)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--parts", default="4")
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--port", type=int, default=8031)
    parser.add_argument("--i-may-delete-the-model", dest="may_delete", action="store_true",
                        help="remove the image's model directory before each run (it comes back from the registry)")
    args = parser.parse_args()
    if not args.may_delete:
        sys.exit("fresh_node.py removes the image's model directory before each run: pass --i-may-delete-the-model")
    image = args.image.absolute()
    manifest = json.loads((image / "manifest.json").read_text())
    model, served = Path(manifest["launch"]["model"]), manifest["launch"]["served_model_name"]
    args.out.mkdir(parents=True, exist_ok=True)
    runs: list[dict[str, Any]] = []
    with Registry(args.registry_bin, args.registry_root) as registry:
        ref = f"{registry.address}/vsnap/{image.name}:fresh"
        started = time.monotonic()
        push = vsnap("push", str(image), ref, "--model")
        push_s = time.monotonic() - started
        ref = push["reference"]
        try:
            for parts in [int(p) for p in args.parts.split(",")]:
                for _ in range(args.runs):
                    remove_local(image, model)
                    runs.append(run_once(ref, image, model, served, parts, args.port))
                    print(json.dumps(runs[-1]), flush=True)
        except BaseException:
            if not (image / "manifest.json").exists() or not model.exists():
                print(f"fresh_node.py: the image or the model is now only in the registry's storage, "
                      f"{args.registry_root / 'storage'} (kept): `vsnap pull {ref} --to {image} --model-dir {model}` "
                      "with the registry started again brings them back", file=sys.stderr)
            raise
    document = {"image": str(image), "model": str(model), "reference": ref, "push_s": round(push_s, 3),
                "push": {k: push[k] for k in ("blobs", "uploaded", "bytes_sent", "image_bytes", "model_files",
                                              "model_bytes", "timings")},
                "host": {"cpus": os.cpu_count(), "uname": os.uname().release}, "runs": runs}
    (args.out / "fresh-node.json").write_text(json.dumps(document, indent=1) + "\n")
    text = table(runs)
    (args.out / "fresh-node.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
