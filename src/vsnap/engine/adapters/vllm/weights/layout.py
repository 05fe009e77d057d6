"""The weights file's layout: one flat file per rank (file_name), each tensor's bytes back to back
in the order given (Segment, layout), tensors seen as their bytes (flat_bytes, storage_view), and a
checksum per tensor (fingerprint) to name what did not come back."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Segment:
    name: str
    offset: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]


def file_name(rank: int) -> str:
    return f"rank{rank}.bin"


def layout(named: list[tuple[str, Any]]) -> list[Segment]:
    """Where each parameter lives in the file (byte offsets; parameters back to back)."""
    segments, offset = [], 0
    for name, tensor in named:
        nbytes = tensor.numel() * tensor.element_size()
        segments.append(Segment(name, offset, nbytes, str(tensor.dtype), tuple(tensor.shape)))
        offset += nbytes
    return segments


def flat_bytes(tensor: Any) -> Any:
    """The tensor's storage as a 1-D uint8 tensor (the same memory)."""
    import torch

    if not tensor.is_contiguous():
        raise ValueError("parameter is not contiguous")
    return tensor.detach().reshape(-1).view(torch.uint8)


def storage_view(tensor: Any) -> Any:
    """A flat uint8 tensor over the whole storage behind ``tensor`` (the same memory, kept alive)."""
    import torch

    storage = tensor.untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(storage, 0, (storage.nbytes(),), (1,))


CHECKSUM_WORDS = 1 << 22  # int32 words summed at a time (as int64, weighted: ~100 MB of scratch on the device)


def fingerprint(named: list[tuple[str, Any]]) -> dict[str, int]:
    """A checksum per tensor, to name what did not come back: over its whole storage, int32 word
    by word, each word weighted by its position (1 to 251, repeating), each chunk of
    CHECKSUM_WORDS by its index too, so that moved bytes (swapped LoRA slots) count as changed;
    trailing bytes added last. Taken only at capture."""
    import torch

    sums = {}
    for name, tensor in named:
        flat = storage_view(tensor)
        words = flat[: flat.numel() // 4 * 4].view(torch.int32)
        total = 0
        for index, start in enumerate(range(0, words.numel(), CHECKSUM_WORDS)):
            chunk = words[start:start + CHECKSUM_WORDS].to(torch.int64)
            weights = torch.arange(chunk.numel(), device=chunk.device, dtype=torch.int64) % 251 + 1
            total = (total + (index + 1) * int((chunk * weights).sum().item())) % (1 << 63)
        sums[name] = total + int(flat[words.numel() * 4:].sum().item())
    return sums
