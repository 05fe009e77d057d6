"""What a capture and a restore will need of this host, computed before anything boots.

A capture needs disk for the image (the weights file, on a GPU, plus the tree's memory), host
memory for the booted tree (on vLLM's CPU backend the weights live there too) and, on a GPU, room
for the model's weights within ``gpu_memory_utilization`` of the GPU; a restore needs host memory
for the tree's memory as it was dumped (the manifest's processes). The capture figures are lower
bounds (the tree's own memory is known only once it booted: the capture checks the disk again
then, with the real figure), so a refusal here is certain: it names the resource, what is needed,
what there is, and where. `vsnap validate` shows each as a row; capture and restore refuse the
first shortfall (HostNotReady, exit 3).
"""

from __future__ import annotations

import json
import math
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vsnap.engine.adapters.vllm.rules import tensor_parallel_size
from vsnap.engine.adapters.vllm.serve_args import given
from vsnap.host import cuda as cuda_driver
from vsnap.host.facts import vllm_device
from vsnap.host.trust import open_following_only_roots_links
from vsnap.protocol.errors import HostNotReady, ImageError, ImageUntrusted

if TYPE_CHECKING:  # not at run time: the restore path loads neither the spec's schema nor yaml
    from vsnap.image.manifest import Manifest
    from vsnap.spec.schema import ModelSpec

MEMINFO = Path("/proc/meminfo")
GiB = 1 << 30

# the engine's opt-in switch (engine/adapters/vllm/weights/extension.py BY_REFERENCE_ENV), read here
# from the capture's environment, which the tree inherits
BY_REFERENCE_ENV = "VSNAP_WEIGHTS_BY_REFERENCE"
# The least memory a booted tree holds besides the weights, per engine and where it runs: well
# below what the images measured hold (docs/benchmarks: the built-in engine's tree 0.33 GB; vLLM's
# CPU backend's 1.7 GB with a tiny model; vLLM on a GPU 3.9 GB resident, EngineCore 2.9 and API
# server 1.0, 70B), so that a refusal here is certain; the capture checks the real figure once
# the tree booted (capture.require_space).
TREE_FLOOR = {"cpu": 128 << 20, "vllm-cpu": 1 * GiB, "vllm-cuda": 2 * GiB}
# The largest model.safetensors.index.json or config.json read here (the largest public indexes,
# MoE models of ~100k tensors, are ~10 MB; a config is a few KB): memory and time stay bounded
MAX_MODEL_JSON_BYTES = 64 << 20
MODEL_JSON_HINT = "replace it with the model's own file (download the model again)"


@dataclass(frozen=True)
class Need:
    resource: str  # "disk", "host memory", "GPU memory"
    need: int
    have: int
    where: str
    why: str

    @property
    def ok(self) -> bool:
        return self.need <= self.have

    @property
    def line(self) -> str:
        return (f"{self.need / 1e9:.1f} GB needed ({self.why}), {self.have / 1e9:.1f} GB "
                f"{'free' if self.resource == 'disk' else 'available'} {self.where}")


def mem_available(meminfo: Path = MEMINFO) -> int:
    """MemAvailable: what can be had without swapping (page cache that can be dropped counts)."""
    for line in meminfo.read_text().splitlines():
        key, _, value = line.partition(":")
        if key == "MemAvailable":
            return int(value.split()[0]) * 1024
    raise HostNotReady("resources", f"{meminfo} has no MemAvailable line", hint="a Linux kernel of 3.14 or newer")


def free_disk(path: Path) -> tuple[int, Path]:
    """Free bytes on the filesystem that holds ``path`` (its nearest existing ancestor), and that ancestor."""
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    st = os.statvfs(probe)
    return st.f_bavail * st.f_frsize, probe


def weights_bytes(model_dir: Path | None) -> int:
    """The bytes of the safetensors files vLLM loads: those the index names if there is one, else
    every *.safetensors at the top (a repository's other copies, e.g. consolidated.safetensors
    beside the shards or original/, are not loaded). Only plain file names of the index count (no
    `/`, `..` or NUL); a file is stat'ed through a link (a Hugging Face snapshot's are links into
    blobs/, which the trust model checks), never opened; 0 without a model (the built-in engine's
    is tiny). An index that is not a regular file of at most MAX_MODEL_JSON_BYTES is refused
    (ImageUntrusted)."""
    if model_dir is None:
        return 0
    names: set[str] = set()
    try:
        index = _model_json(model_dir / "model.safetensors.index.json")
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if isinstance(weight_map, dict):
            names = {v for v in weight_map.values() if isinstance(v, str)}
    except (FileNotFoundError, ValueError):  # none, or not JSON (vLLM's loader says so): every top-level file
        pass
    paths = ([model_dir / name for name in names if _plain_name(name)] if names
             else model_dir.glob("*.safetensors"))
    total, seen = 0, set()
    for path in paths:
        try:
            st = path.stat()  # a Hugging Face snapshot's files are links into blobs/ (the trust model checks them)
        except (OSError, ValueError):
            continue
        if stat.S_ISREG(st.st_mode) and (st.st_dev, st.st_ino) not in seen:
            seen.add((st.st_dev, st.st_ino))
            total += st.st_size
    return total


def _plain_name(name: str) -> bool:
    return bool(name) and "/" not in name and "\0" not in name and name not in (".", "..")


def _model_json(path: Path) -> Any:
    """A JSON file of the model directory, read as hostile: opened without blocking (a FIFO), a
    regular file of at most MAX_MODEL_JSON_BYTES (not a device that never ends), parsed without
    recursing without bound. FileNotFoundError if absent; ValueError if it is not JSON;
    ImageUntrusted for a file that must not be read (its link followed: a snapshot's are links)."""
    try:
        # validate reads it even where the model's trust row failed: another user's link is not followed
        # (nor statted through); O_PATH: the file found, not opened (opening a device can act on it)
        where = open_following_only_roots_links(path, os.O_PATH)
        try:
            if not stat.S_ISREG(os.fstat(where).st_mode):
                raise ImageUntrusted(path, "a file of the model is not a regular file (a FIFO or a device: reading "
                                           "it could block or never end)", hint=MODEL_JSON_HINT)
            # that very file opened for reading: nothing swapped in since the check
            fd = os.open(f"/proc/self/fd/{where}", os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
        finally:
            os.close(where)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise ImageUntrusted(path, f"a file of the model cannot be opened ({exc.strerror})",
                             hint=MODEL_JSON_HINT) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ImageUntrusted(path, "a file of the model is not a regular file (a FIFO or a device: reading it "
                                       "could block or never end)", hint=MODEL_JSON_HINT)
        if st.st_size > MAX_MODEL_JSON_BYTES:
            raise ImageUntrusted(path, f"a file of the model has {st.st_size} bytes, over the "
                                       f"{MAX_MODEL_JSON_BYTES >> 20} MiB a model's JSON file may have",
                                 hint=MODEL_JSON_HINT)
        chunks, left = [], MAX_MODEL_JSON_BYTES + 1
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
    except OSError as exc:
        raise ImageUntrusted(path, f"a file of the model cannot be read ({exc.strerror})",
                             hint=MODEL_JSON_HINT) from None
    finally:
        os.close(fd)
    if left <= 0:  # grew while read
        raise ImageUntrusted(path, f"a file of the model has more than the {MAX_MODEL_JSON_BYTES >> 20} MiB "
                                   "a model's JSON file may have", hint=MODEL_JSON_HINT)
    try:
        return json.loads(b"".join(chunks))
    except RecursionError:
        raise ValueError(f"{path} is nested too deeply") from None


def loaded_share(spec: ModelSpec, model_dir: Path | None) -> float:
    """The weights' loaded bytes per stored byte: 1/2 for a float32 checkpoint that vLLM loads in 16
    bits (dtype auto, or a 16-bit dtype), 1/2 again for FP8 quantized at load, else 1."""
    config = _config(model_dir)
    stored_32 = checkpoint_dtype(config) in ("float32", "float")
    if quantized_at_load(spec, model_dir):
        return 0.25 if stored_32 else 0.5
    dtype = str(given(spec.serve, "dtype")[1] or "auto").lower()
    if stored_32 and dtype not in ("float32", "float"):
        return 0.5
    return 1.0


def checkpoint_dtype(config: dict[str, Any]) -> str | None:
    """The dtype config.json gives the checkpoint, where transformers writes it: ``dtype`` (4.56 and
    later), ``torch_dtype`` (before), at the top or in a multimodal model's ``text_config``. None
    without one (vLLM then reads the tensors' own dtypes; the share is then counted as 1, an upper
    bound)."""
    for holder in (config, config.get("text_config")):
        if isinstance(holder, dict):
            for key in ("dtype", "torch_dtype"):
                if isinstance(holder.get(key), str):
                    return holder[key]
    return None


def _config(model_dir: Path | None) -> dict[str, Any]:
    """The model's config.json (_model_json: ImageUntrusted for a FIFO, a device or a giant file);
    {} where it is missing or not JSON (vLLM's own reading of it says why)."""
    try:
        config = _model_json(model_dir / "config.json") if model_dir is not None else {}
    except (FileNotFoundError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def quantized_at_load(spec: ModelSpec, model_dir: Path | None) -> bool:
    """FP8 quantization asked of vLLM for a checkpoint that is not quantized already: one byte per
    weight on the GPU instead of two."""
    if model_dir is None or str(given(spec.serve, "quantization")[1] or "").lower() != "fp8":
        return False
    return not _config(model_dir).get("quantization_config")


def capture_needs(spec: ModelSpec, model_dir: Path | None, image_dir: Path, gpus: list[dict[str, Any]] | None = None,
                  meminfo: Path = MEMINFO) -> list[Need]:
    """Lower bounds of what capturing ``spec`` (its model in ``model_dir``) into ``image_dir`` takes
    of this host; ``gpus``: the GPUs the ranks will run on (their facts, as host.cuda.gpu_facts
    gives them)."""
    where = "cuda" if spec.engine == "vllm" and vllm_device() == "cuda" else "cpu"
    floor = TREE_FLOOR["cpu" if spec.engine == "cpu" else f"vllm-{where}"]
    weights = int(weights_bytes(model_dir) * loaded_share(spec, model_dir))  # as loaded: the weights file's size
    free, disk = free_disk(image_dir)
    if where == "cuda" and (spec.snapshot.weights == "model" or os.environ.get(BY_REFERENCE_ENV) == "1"):
        disk_need, memory_need = floor, floor  # no weights file, or one that may hold none of the model's bytes
        why_disk = ("the tree's memory, at least (no weights file: reloaded from the model's files)"
                    if spec.snapshot.weights == "model" else
                    "the tree's memory, at least (weights by reference: the weights file holds what the model's do not)")
        why_memory = "the booted tree, at least"
    elif where == "cuda":  # the weights file, then the tree's memory
        disk_need, memory_need = weights + floor, floor
        why_disk = f"the weights file {weights / 1e9:.1f} GB and the tree's memory, at least {floor / 1e9:.1f} GB"
        why_memory = "the booted tree, at least"
    else:  # the weights are in the tree's memory
        disk_need = memory_need = weights + floor
        why_disk = why_memory = (f"the tree's memory: the weights {weights / 1e9:.1f} GB and at least {floor / 1e9:.1f} GB"
                                 if weights else "the tree's memory, at least")
    needs = [Need("disk", disk_need, free, f"on the disk holding {disk}", why_disk),
             Need("host memory", memory_need, mem_available(meminfo), "on this host", why_memory)]
    if where == "cuda" and gpus:
        tp = max(tensor_parallel_size(dict(spec.serve)), 1)
        per_rank = weights // tp
        share = memory_share(given(spec.serve, "gpu_memory_utilization")[1])
        why = ("the model's weights" + (" per rank" if tp > 1 else "")
               + (", FP8 at load" if quantized_at_load(spec, model_dir) else ""))
        for gpu in gpus[:tp]:
            needs.append(Need("GPU memory", per_rank, int(share * int(gpu["memory_bytes"])),
                              f"within gpu_memory_utilization {share:g} of GPU {gpu['index']} ({gpu['name']})", why))
    return needs


def memory_share(value: Any) -> float:
    """gpu_memory_utilization as a share in (0, 1]; vLLM's default 0.9 for anything else (vLLM
    refuses such a value itself: "nan", "inf" or -1 must not become the figure of a refusal)."""
    try:
        share = float(value or 0.9)
    except (TypeError, ValueError, OverflowError):
        return 0.9
    return share if math.isfinite(share) and 0 < share <= 1 else 0.9


def capture_gpus(spec: ModelSpec) -> list[dict[str, Any]]:
    """The GPUs a capture of ``spec`` will take (the driver lists only those CUDA_VISIBLE_DEVICES
    names, renumbered from 0: capture.recorded_visible); none off the GPU."""
    if spec.engine != "vllm" or vllm_device() != "cuda":
        return []
    return cuda_driver.gpu_facts()[2]  # under this process's CUDA_VISIBLE_DEVICES: those it names, in its order


def restore_needs(manifest: Manifest, meminfo: Path = MEMINFO) -> list[Need]:
    """What restoring the image takes of this host's memory: the tree's memory as it was dumped
    (its anonymous memory; the pages of files it mapped are page cache)."""
    tree = sum(_anonymous_bytes(k, p) for k, p in enumerate(manifest.processes))
    return [Need("host memory", tree, mem_available(meminfo), "on this host",
                 f"the tree's memory at the dump, {len(manifest.processes)} processes")]


def _anonymous_bytes(k: int, process: Any) -> int:
    """A manifest's processes[k].anonymous_bytes: what a capture writes (an integer from 0 to a
    petabyte) or absent; anything else is refused (the manifest is input: a string, a float such
    as Infinity or a negative count must not become a traceback or a need below zero)."""
    value = process.get("anonymous_bytes", 0) if isinstance(process, dict) else None
    if value is None and isinstance(process, dict):
        return 0
    if type(value) is not int or not 0 <= value <= 1 << 50:
        raise ImageError(f"manifest.json: processes[{k}].anonymous_bytes is {str(value)[:40]!r}, "
                         "not a byte count", hint="the image is damaged or not vsnap's: capture it again")
    return value


def require(needs: list[Need], action: str) -> None:
    """Refuse the first shortfall, in one line."""
    for need in needs:
        if not need.ok:
            raise HostNotReady("resources", f"not enough {need.resource} to {action}: {need.line}",
                               required=f"{need.need / 1e9:.1f} GB", found=f"{need.have / 1e9:.1f} GB",
                               hint=HINTS[need.resource])


HINTS = {
    "disk": "free space there, or put the image on another disk (image: in model.yaml, or --image)",
    "host memory": "stop other work on this host (`vsnap ps` lists restored instances), or use a host with more memory",
    "GPU memory": "a GPU with more memory, a smaller model, FP8 (quantization: fp8), or tensor_parallel_size > 1",
}
