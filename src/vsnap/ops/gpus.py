"""Which GPUs a restore or an activation takes, one per rank, and the CUDA restore's map onto them."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

from vsnap.host import cuda as cuda_driver
from vsnap.host import gpu_early
from vsnap.image.handle import Image
from vsnap.image.manifest import Manifest
from vsnap.protocol.errors import HostNotReady, UnsupportedOption


@dataclass(frozen=True)
class Gpu:
    """One GPU of this host as the driver reports it (host.cuda.gpu_facts: a dict, the form the
    manifest records)."""

    index: int
    name: str
    uuid: str

    @classmethod
    def of(cls, fact: dict[str, Any]) -> Gpu:
        return cls(index=int(fact["index"]), name=str(fact["name"]), uuid=str(fact["uuid"]))


def require_gpu_state(image: Image, gpu: str | None) -> None:
    """``--gpu`` only for an image that holds CUDA state (UnsupportedOption otherwise)."""
    if gpu is not None and not image.manifest.cuda_processes:
        raise UnsupportedOption("--gpu", f"--gpu {shown(gpu)}: {image.path} holds no CUDA state "
                                         f"(engine {image.manifest.engine}); there is no GPU to choose")


def gpu_pairs(captured: list[str], targets: list[Gpu] | None) -> list[tuple[str, str]]:
    """The CUDA restore's GPU map: rank r's captured GPU onto ``targets[r]``; none when every rank
    stays on its GPU (the driver then needs no map)."""
    if not targets or not captured:
        return []
    if len(targets) != len(captured):
        raise HostNotReady("gpu", f"{len(targets)} GPU(s) chosen for an image of {len(captured)} rank(s)")
    pairs = [(old, new.uuid) for old, new in zip(captured, targets)]
    return [] if all(old == new for old, new in pairs) else pairs


def choose_gpus(manifest: Manifest, requested: str | None,
                facts: Future[tuple[str | None, str, list[dict]]] | None = None) -> list[Gpu]:
    """The GPUs to restore onto, one per rank in rank order: the requested indices or UUIDs
    (``0,1``: as many as the image has ranks, each once), else each rank's captured GPU where it is
    here and has room, the other ranks on the first other GPUs of the captured model with enough
    free memory. Refuses another model or too little memory, naming the GPU. ``facts``: the GPUs'
    facts (_cuda.gpu_facts) being read elsewhere; else they are read here."""
    with ThreadPoolExecutor(max_workers=1) as pool:
        freeing = pool.submit(cuda_driver.gpu_free_memory)  # while the CUDA driver starts
        _, _, found = facts.result() if facts is not None else gpu_early.gpu_facts()
        free = freeing.result()
    gpus = [Gpu.of(fact) for fact in found]
    captured = manifest.host.gpus[0] if manifest.host.gpus else {}
    need = manifest.gpu_memory_required or 0  # on each GPU: vLLM takes its share of every rank's
    ranks = manifest.tensor_parallel_size

    def fits(g: Gpu) -> str | None:
        if captured and g.name != captured.get("name"):
            return f"GPU {g.index} is a {g.name}; the image was captured on a {captured.get('name')}"
        available = free.get(g.uuid)
        if available is not None and available < need:
            return (f"GPU {g.index} has {available / 2**30:.1f} GiB free; the image needs "
                    f"{need / 2**30:.1f} GiB (gpu_memory_utilization of the captured GPU)")
        return None

    if requested is not None:
        return _requested_gpus(requested, ranks, gpus, fits)
    reasons: list[str] = []
    tried: set[str] = set()

    def take(g: Gpu) -> bool:
        tried.add(g.uuid)
        reason = fits(g)
        if reason is not None:
            reasons.append(reason)
        return reason is None

    by_uuid = {g.uuid: g for g in gpus}
    wanted = manifest.captured_gpus()[:ranks]
    chosen: list[Gpu | None] = [by_uuid.get(u) for u in wanted] + [None] * (ranks - len(wanted))
    chosen = [g if g is not None and take(g) else None for g in chosen]
    for rank, g in enumerate(chosen):
        if g is None:
            chosen[rank] = next((o for o in gpus if o.uuid not in tried and take(o)), None)
    if any(g is None for g in chosen):
        lead = "no GPU can take this image" if ranks == 1 else f"fewer than {ranks} GPUs can take this image"
        raise HostNotReady("gpu", f"{lead}: " + "; ".join(dict.fromkeys(reasons)) if reasons else
                           ("no GPU is visible" if not gpus else f"this host has {len(gpus)} GPU(s); the image "
                                                                 f"needs {ranks} (tensor_parallel_size)"),
                           hint="stop something on a GPU, or restore on a host with free GPUs of the captured model")
    return [g for g in chosen if g is not None]


def shown(requested: str) -> str:
    """``--gpu``'s value as an error shows it: quoted, one line and at most 80 characters of it,
    however it came."""
    return repr(requested if len(requested) <= 80 else requested[:80] + "...")


def _requested_gpus(requested: str, ranks: int, gpus: list[Gpu], fits: Callable[[Gpu], str | None]) -> list[Gpu]:
    """``--gpu``: one index or UUID per rank, comma-separated, each a GPU of this host taken once."""
    names = [name.strip() for name in requested.split(",")]
    example = ",".join(map(str, range(ranks)))
    quoted = shown(requested)
    if not all(names):
        raise HostNotReady("gpu", f"--gpu {quoted} has an empty entry", hint=f"give one GPU index or UUID per rank, "
                                                                             f"in rank order (--gpu {example})")
    if len(names) != ranks:
        raise HostNotReady("gpu", f"--gpu {quoted} names {len(names)} GPU(s); the image has "
                                  f"{ranks} rank(s) (tensor_parallel_size {ranks})",
                           hint=f"give one GPU index or UUID per rank, in rank order (--gpu {example})")
    chosen: list[Gpu] = []
    for name in names:
        match = [g for g in gpus if name in (str(g.index), g.uuid)]
        if not match:
            raise HostNotReady("gpu", f"no GPU {name[:80]!r} on this host (have {', '.join(str(g.index) for g in gpus)})",
                               hint="--gpu takes indices or UUIDs from nvidia-smi -L")
        if match[0] in chosen:
            raise HostNotReady("gpu", f"--gpu {quoted} names GPU {match[0].index} twice",
                               hint=f"one GPU per rank (--gpu {example})")
        reason = fits(match[0])
        if reason:
            raise HostNotReady("gpu", reason, hint="choose another --gpu")
        chosen.append(match[0])
    return chosen
