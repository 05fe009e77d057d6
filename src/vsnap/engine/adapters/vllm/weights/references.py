"""Weights by reference: the weights pool's bytes that are already in the model's own safetensors
files are not written again into the image; the image's rank file holds only the rest.

For a dense bf16 model most of the pool is the checkpoint's tensors as they are: a parameter
loaded whole, or vLLM's fused ones (qkv_proj is q, k and v side by side along dim 0, so its bytes
are the three checkpoint tensors back to back; gate_up_proj likewise). The model's files are
dependencies of the image (size and sha256 checked before every restore), so a reference to their
bytes is as safe as the image itself.

    Plan             extents covering every byte of the pool in pool order, each from a model
                     file or from the image's rank file; its JSON (rank<N>.refs.json) for people
                     and the host
    ReferenceMatcher finds, in one pool tensor's host bytes, the checkpoint tensors it holds
    PlanBuilder      turns the matches into extents, and says which bytes go to the rank file
    write_by_reference   the save: every pool tensor matched, its literal bytes written
    refresh_plan     a refresh: changed literal bytes rewritten, changed references made literal

Matching, per pool tensor, walking from its start: at a position p, the checkpoint tensors whose
first block (BLOCK bytes) hashes like the pool's bytes there are compared byte for byte, longest
first; the first equal one is a reference and the walk goes on at its end. Where none starts at
p, the positions p + k x STEP are looked up (the first 8 bytes of each against those of every
indexed tensor, in numpy), and each hit is tried the same way. So a checkpoint tensor is found
where it starts a pool tensor, follows another reference, or starts a multiple of STEP after
either (fused tensors whose parts start at row boundaries; padding after a tensor). What is not
found is literal: never wrong, only larger. Only ranges of at least MIN_REFERENCE bytes are
referenced, and none whose first block is one byte repeated (zero-filled tensors would match
everywhere). With tensor parallelism each 1/parts slice of a checkpoint tensor is indexed too:
a rank of a column-parallel layer holds one such slice.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import stat
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, BinaryIO, Iterable, Iterator

import numpy as np

from .safetensors_header import CheckpointTensor, UnusableHeader, read_header

IMAGE = -1  # an extent's source: the image's rank file (else an index into Plan.files)
BLOCK = 4096  # bytes hashed at the start of a checkpoint range to find candidates
MIN_REFERENCE = 64 << 10  # smaller matches stay literal: not worth an extent (norms, biases)
STEP = 4096  # after a literal stretch, candidate starts are this far apart
COMPARE_CHUNK = 8 << 20  # bytes compared at a time against a model file's mapping
SCAN_WINDOW = 1 << 16  # candidate starts looked up at a time
# A hostile model's tensors can share their first block and differ after it: every candidate is
# compared at every position that block recurs at. At most MAX_CANDIDATES ranges (the longest) are
# kept per first block (a real model has one, two with a tensor-parallel slice or a tied copy),
# and a match() compares at most COMPARE_BUDGET x the pool tensor's bytes plus COMPARE_SLACK
# (equal ranges cost their bytes once; a real model's failed comparisons are few): past it the
# rest of the tensor is literal. Never wrong, only larger; bounded time on any model directory.
MAX_CANDIDATES = 16
COMPARE_BUDGET = 2
COMPARE_SLACK = 256 << 20
MAX_PLAN_BYTES = 16 << 20  # a plan's JSON (an 8B model's: ~20 KB): from_json reads no more
PLAN_FORMAT = 1
EXTENT_FIELDS = ("pool_offset", "nbytes", "source", "offset")


def plan_file_name(rank: int) -> str:
    return f"rank{rank}.refs.json"


@dataclass(frozen=True)
class Extent:
    pool_offset: int  # where its bytes go, in the pool's flat layout (layout.Segment offsets)
    nbytes: int
    source: int  # IMAGE, or an index into Plan.files
    offset: int  # where its bytes are in that file


@dataclass(frozen=True)
class ModelFile:
    path: str  # a file name in the model directory
    size: int


@dataclass(frozen=True)
class Plan:
    """Where every byte of the weights pool comes from at a restore. The IMAGE extents tile the
    rank file, [0, literal_bytes), in some order; the extents tile the pool, [0, total_bytes), in
    pool order."""

    model_dir: str
    files: tuple[ModelFile, ...]
    extents: tuple[Extent, ...]
    skipped: tuple[tuple[str, str], ...] = ()  # model files left out of the matching, and why

    @property
    def total_bytes(self) -> int:
        return sum(e.nbytes for e in self.extents)

    @property
    def literal_bytes(self) -> int:
        return sum(e.nbytes for e in self.extents if e.source == IMAGE)

    @property
    def referenced_bytes(self) -> int:
        return self.total_bytes - self.literal_bytes

    def model_path(self, source: int) -> Path:
        return Path(self.model_dir) / self.files[source].path

    def check(self) -> None:
        """Raise ValueError unless the extents tile the pool and the rank file and stay inside
        the model files (what every copier relies on)."""
        end = 0
        for e in self.extents:
            if e.pool_offset != end or e.nbytes <= 0 or e.offset < 0:
                raise ValueError(f"weights plan: extent {e} does not follow the pool's byte {end}")
            if e.source != IMAGE and not (0 <= e.source < len(self.files)
                                          and e.offset + e.nbytes <= self.files[e.source].size):
                raise ValueError(f"weights plan: extent {e} lies outside its model file")
            end += e.nbytes
        literal = sorted((e.offset, e.nbytes) for e in self.extents if e.source == IMAGE)
        at = 0
        for offset, nbytes in literal:
            if offset != at:
                raise ValueError(f"weights plan: the rank file's bytes from {at} are not covered once")
            at += nbytes
        for f in self.files:
            if not _plain_name(f.path) or f.size < 0:
                raise ValueError(f"weights plan: model file {f.path[:200]!r} is not a file name of the model directory")
        if ("\0" in self.model_dir or not os.path.isabs(self.model_dir)
                or os.path.normpath(self.model_dir) != self.model_dir):
            raise ValueError(f"weights plan: model_dir {self.model_dir[:200]!r} is not an absolute, normalized path")

    def to_json(self, rank_file: str) -> str:
        """The plan for people and the host: the counts first, then one line per extent."""
        head = json.dumps({
            "format": PLAN_FORMAT, "rank_file": rank_file, "model_dir": self.model_dir,
            "total_bytes": self.total_bytes, "referenced_bytes": self.referenced_bytes,
            "literal_bytes": self.literal_bytes,
            "model_files": [{"path": f.path, "size": f.size} for f in self.files],
            "skipped_files": [{"path": path, "reason": why} for path, why in self.skipped],
            "extent_fields": list(EXTENT_FIELDS), "source_rank_file": IMAGE,
        }, indent=1)
        lines = ",\n  ".join(json.dumps([e.pool_offset, e.nbytes, e.source, e.offset]) for e in self.extents)
        return f'{head.removesuffix("}").rstrip()},\n "extents": [\n  {lines}\n ]\n}}\n'

    @classmethod
    def from_json(cls, text: str | bytes, *, model_dir: str | None = None, rank_file: str | None = None) -> Plan:
        """The plan a to_json wrote; ValueError for anything else (checked as check() does). The
        JSON is image content, read as hostile: at most MAX_PLAN_BYTES, no key given twice, its
        counts those of its extents, ``model_dir`` an absolute normalized path (and, if given, the
        one the caller expects: the manifest's launch.model), ``rank_file`` a plain file name (and,
        if given, this one)."""
        if len(text) > MAX_PLAN_BYTES:
            raise ValueError(f"not a weights plan: {len(text)} bytes, over {MAX_PLAN_BYTES}")
        try:
            raw = json.loads(text, object_pairs_hook=_no_duplicates)
            if type(raw["format"]) is not int or raw["format"] != PLAN_FORMAT or raw["extent_fields"] != list(EXTENT_FIELDS):
                raise ValueError(f"weights plan of format {_shown(raw['format'])}, not {PLAN_FORMAT}")
            if type(raw["source_rank_file"]) is not int or raw["source_rank_file"] != IMAGE:
                raise ValueError(f"weights plan: source_rank_file is {_shown(raw['source_rank_file'])}, not {IMAGE}")
            plan = cls(model_dir=_str(raw["model_dir"]),
                       files=tuple(ModelFile(_str(f["path"]), _int(f["size"])) for f in raw["model_files"]),
                       extents=tuple(Extent(*map(_int, e)) for e in raw["extents"] if len(e) == len(EXTENT_FIELDS)),
                       skipped=tuple((_str(s["path"]), _str(s["reason"])) for s in raw["skipped_files"]))
            if len(plan.extents) != len(raw["extents"]):
                raise ValueError("an extent has another number of fields")
            named = _str(raw["rank_file"])
            counts = (_int(raw["total_bytes"]), _int(raw["referenced_bytes"]), _int(raw["literal_bytes"]))
        except (KeyError, TypeError, AttributeError, RecursionError) as exc:
            raise ValueError(f"not a weights plan ({type(exc).__name__}: {str(exc)[:200]})") from None
        plan.check()
        if not _plain_name(named) or (rank_file is not None and named != rank_file):
            raise ValueError(f"weights plan: rank_file {named[:200]!r} is not {rank_file or 'a file name'}")
        if counts != (plan.total_bytes, plan.referenced_bytes, plan.literal_bytes):
            raise ValueError(f"weights plan: total, referenced and literal bytes {counts} are not its extents' "
                             f"{(plan.total_bytes, plan.referenced_bytes, plan.literal_bytes)}")
        if model_dir is not None and plan.model_dir != model_dir:
            raise ValueError(f"weights plan: model_dir {plan.model_dir[:200]!r} is not the image's model {model_dir!r}")
        if len({f.path for f in plan.files}) != len(plan.files):
            raise ValueError("weights plan: a model file is named twice")
        return plan


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:40] + "..."


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result = dict(pairs)
    if len(result) != len(pairs):
        raise TypeError("a key is given twice")
    return result


def _plain_name(name: str) -> bool:
    return bool(name) and "/" not in name and "\0" not in name and name not in (".", "..")


def _int(value: Any) -> int:
    if type(value) is not int:
        raise TypeError(f"{value!r} is not an integer")
    return int(value)


def _str(value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{value!r} is not a string")
    return value


@dataclass(frozen=True)
class CheckpointRange:
    """Bytes of a model file worth referencing: a checkpoint tensor, or one 1/parts slice of it."""

    file: int  # index into ReferenceMatcher.files
    offset: int
    nbytes: int
    name: str


def _ranges(index: int, tensor: CheckpointTensor, parts: int) -> list[CheckpointRange]:
    """The tensor whole and, with parts > 1, each 1/parts slice of it (a tensor-parallel rank's)."""
    ranges = [CheckpointRange(index, tensor.offset, tensor.nbytes, tensor.name)]
    if parts > 1 and tensor.nbytes % parts == 0:
        size = tensor.nbytes // parts
        ranges += [CheckpointRange(index, tensor.offset + k * size, size, f"{tensor.name}[{k}/{parts}]")
                   for k in range(parts)]
    return ranges


def _digest(block: Any) -> bytes:
    return hashlib.blake2b(block, digest_size=16).digest()


def _key(block: Any) -> int:
    return int.from_bytes(bytes(block[:8]), "little")


class ReferenceMatcher:
    """The checkpoint ranges of a model directory's *.safetensors files, indexed by their first
    block, and match() to find them in a pool tensor's bytes. The files are mapped read-only while
    it is open (close(), or a with block). A file that cannot be opened or whose header is unusable
    is left out (``skipped``, with the reason)."""

    def __init__(self, model_dir: Path, *, parts: int = 1, min_reference: int = MIN_REFERENCE,
                 step: int = STEP) -> None:
        if min_reference < BLOCK or step < 1 or parts < 1:
            raise ValueError(f"min_reference must be at least {BLOCK}, step and parts at least 1")
        self.min_reference, self.step = min_reference, step
        self.files: list[ModelFile] = []
        self.skipped: list[tuple[str, str]] = []
        self._maps: list[mmap.mmap] = []
        self._views: list[Any] = []  # a uint8 array over each map
        self._by_digest: dict[bytes, list[CheckpointRange]] = {}
        self._budget = 0  # bytes match() may still compare
        try:
            keys = self._index(Path(model_dir), parts)
        except BaseException:
            self.close()
            raise
        self._keys = np.array(sorted(keys), dtype="<u8")

    def __enter__(self) -> ReferenceMatcher:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def close(self) -> None:
        self._views.clear()
        for mapping in self._maps:
            try:
                mapping.close()
            except BufferError:  # a view still alive (an exception's frames): unmapped when it goes
                pass
        self._maps.clear()

    def _index(self, model_dir: Path, parts: int) -> set[int]:
        keys: set[int] = set()
        names = sorted(p.name for p in model_dir.iterdir() if p.name.endswith(".safetensors")) \
            if model_dir.is_dir() else []
        for name in names:
            tensors = self._open(model_dir / name)
            if tensors is None:
                continue
            index, view = len(self._views) - 1, self._views[-1]
            for tensor in tensors:
                for r in _ranges(index, tensor, parts):
                    if r.nbytes < self.min_reference:
                        continue
                    block = view[r.offset:r.offset + BLOCK]
                    if block.min() == block.max():  # one byte repeated: would match every such stretch
                        continue
                    self._by_digest.setdefault(_digest(block), []).append(r)
                    keys.add(_key(block))
        for entries in self._by_digest.values():  # once, not per range: n ranges of one block cost n log n
            entries.sort(key=lambda c: -c.nbytes)  # longest first
            del entries[MAX_CANDIDATES:]
        return keys

    def _open(self, path: Path) -> list[CheckpointTensor] | None:
        """The file's tensors, its map and view appended; None (and the reason in ``skipped``) if
        it is left out."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # a FIFO must not block the save
        except OSError as exc:
            self.skipped.append((path.name, f"cannot be opened: {exc.strerror}"))
            return None
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                self.skipped.append((path.name, "not a regular file"))
                return None
            tensors = read_header(fd, info.st_size)
            mapping = mmap.mmap(fd, info.st_size, prot=mmap.PROT_READ, flags=mmap.MAP_SHARED)
        except UnusableHeader as exc:
            self.skipped.append((path.name, str(exc)))
            return None
        except OSError as exc:
            self.skipped.append((path.name, f"cannot be read: {exc.strerror or exc}"))
            return None
        finally:
            os.close(fd)
        self.files.append(ModelFile(path.name, info.st_size))
        self._maps.append(mapping)
        self._views.append(np.frombuffer(mapping, dtype=np.uint8))
        return tensors

    def match(self, data: Any) -> list[tuple[int, CheckpointRange]]:
        """The checkpoint ranges found in ``data`` (a pool tensor's bytes, a 1-D uint8 array), as
        (position in data, range), in order, not overlapping."""
        found: list[tuple[int, CheckpointRange]] = []
        n, p = data.size, 0
        self._budget = COMPARE_BUDGET * n + COMPARE_SLACK
        while self._keys.size and n - p >= self.min_reference and self._budget > 0:
            at: int = p
            hit = self._at(data, p)
            if hit is None:
                at, hit = self._scan(data, p + self.step)
                if hit is None:
                    break
            found.append((at, hit))
            p = at + hit.nbytes
        return found

    def _scan(self, data: Any, start: int) -> tuple[int, CheckpointRange | None]:
        """The first of start, start + step, ... where a checkpoint range is (_at)."""
        last = data.size - self.min_reference  # the last start a reference fits after
        pos = start
        while pos <= last:
            m = min(SCAN_WINDOW, (last - pos) // self.step + 1)  # pos + (m - 1) * step + 8 <= size
            heads = np.lib.stride_tricks.as_strided(data[pos:], shape=(m, 8), strides=(self.step, 1), writeable=False)
            keys = np.ascontiguousarray(heads).view("<u8").reshape(m)
            slots = np.minimum(np.searchsorted(self._keys, keys), self._keys.size - 1)
            for k in np.flatnonzero(self._keys[slots] == keys):
                hit = self._at(data, pos + int(k) * self.step)
                if hit is not None:
                    return pos + int(k) * self.step, hit
                if self._budget <= 0:
                    return pos, None
            pos += m * self.step
        return pos, None

    def _at(self, data: Any, pos: int) -> CheckpointRange | None:
        for r in self._by_digest.get(_digest(data[pos:pos + BLOCK]), ()):
            if self._budget <= 0:
                return None
            if pos + r.nbytes <= data.size and self._equal(data, pos, r):
                return r
        return None

    def _equal(self, data: Any, pos: int, r: CheckpointRange) -> bool:
        view = self._views[r.file]
        for a in range(0, r.nbytes, COMPARE_CHUNK):
            b = min(a + COMPARE_CHUNK, r.nbytes)
            self._budget -= b - a
            if not np.array_equal(data[pos + a:pos + b], view[r.offset + a:r.offset + b]):
                return False
        return True


class PlanBuilder:
    """The extents of the pool's tensors, added one after the other in pool order; adjacent
    literal extents are one (so with no reference at all the plan is one extent, and the rank
    file is the whole pool as without references)."""

    def __init__(self) -> None:
        self._extents: list[Extent] = []
        self._pool = 0
        self._literal = 0

    def add(self, nbytes: int, references: list[tuple[int, CheckpointRange]]) -> list[tuple[int, int]]:
        """The next tensor (``nbytes``) and the references match() found in it; returns its
        literal ranges [lo, hi), which the caller writes to the rank file, in this order."""
        literal: list[tuple[int, int]] = []
        p = 0
        for at, r in [*references, (nbytes, None)]:
            if at > p:
                literal.append((p, at))
                self._add_literal(self._pool + p, at - p)
            if r is not None:
                self._extents.append(Extent(self._pool + at, r.nbytes, r.file, r.offset))
                p = at + r.nbytes
        self._pool += nbytes
        return literal

    def _add_literal(self, pool_offset: int, nbytes: int) -> None:
        last = self._extents[-1] if self._extents else None
        if last is not None and last.source == IMAGE and last.pool_offset + last.nbytes == pool_offset:
            self._extents[-1] = replace(last, nbytes=last.nbytes + nbytes)  # next in the pool and in the file
        else:
            self._extents.append(Extent(pool_offset, nbytes, IMAGE, self._literal))
        self._literal += nbytes

    def plan(self, model_dir: str, files: list[ModelFile], skipped: list[tuple[str, str]]) -> Plan:
        """The plan, naming only the model files it references (renumbered in order)."""
        used = sorted({e.source for e in self._extents if e.source != IMAGE})
        number = {old: new for new, old in enumerate(used)}
        extents = tuple(e if e.source == IMAGE else replace(e, source=number[e.source]) for e in self._extents)
        return Plan(model_dir, tuple(files[k] for k in used), extents, tuple(skipped))


def write_by_reference(out: BinaryIO, tensors: Iterable[Any], model_dir: str, *, parts: int = 1,
                       spent: dict[str, float] | None = None) -> Plan:
    """Match each pool tensor (host bytes, in pool order; taken one at a time from ``tensors``)
    against the model directory's safetensors files and write its literal bytes to ``out``.

    The next tensor is taken from ``tensors`` on a helper thread while this one is matched (for a
    worker, its copy from the GPU: both release the GIL), so at most two are in host memory at
    once. ``spent``, if given, gets the seconds spent waiting for a tensor (``host_copy_wait_s``),
    matching (``match_s``) and writing (``write_s``)."""
    builder = PlanBuilder()
    waited = matched = written = 0.0
    with ReferenceMatcher(Path(model_dir), parts=parts) as matcher:
        for tensor, wait_s in _one_ahead(tensors):
            waited += wait_s
            start = time.monotonic()
            data = np.ascontiguousarray(tensor).reshape(-1).view(np.uint8)
            found = matcher.match(data)
            middle = time.monotonic()
            for lo, hi in builder.add(data.size, found):
                out.write(memoryview(data[lo:hi]))
            matched, written = matched + middle - start, written + time.monotonic() - middle
            del tensor, data  # before the one after next is made: two in host memory at most
        plan = builder.plan(model_dir, matcher.files, matcher.skipped)
    plan.check()
    if spent is not None:
        spent.update(host_copy_wait_s=waited, match_s=matched, write_s=written)
    return plan


def _one_ahead(items: Iterable[Any]) -> Iterator[tuple[Any, float]]:
    """``items`` in order, each with the seconds the caller waited for it; the next one is made on
    one helper thread while the caller works on this one. The thread is gone when this returns or
    raises (an item's exception is raised here, in order)."""
    source = iter(items)
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="vsnap-host-copy") as helper:
        pending = helper.submit(next, source, _END)
        while True:
            start = time.monotonic()
            item = pending.result()
            waited = time.monotonic() - start
            if item is _END:
                return
            pending = helper.submit(next, source, _END)
            yield item, waited
            del item


_END = object()


def refresh_plan(plan: Plan, fd: int, changed: Iterable[tuple[int, Any]]) -> tuple[Plan, int]:
    """After the save, tensors changed (the rehearsal's oracle moves LoRA slots): ``changed`` gives
    each one's pool offset and host bytes. Their literal bytes are rewritten in place in the rank
    file (``fd``, open for writing); a reference whose bytes no longer equal the model file's
    becomes literal, its bytes appended to the rank file. Returns the new plan and how many
    references became literal."""
    extents = list(plan.extents)
    starts = [e.pool_offset for e in extents]
    end = plan.literal_bytes
    converted = 0
    for pool_offset, tensor in changed:
        data = np.ascontiguousarray(tensor).reshape(-1).view(np.uint8)
        lo, hi = pool_offset, pool_offset + data.size
        k = max(int(np.searchsorted(starts, lo, side="right")) - 1, 0)
        while k < len(extents) and extents[k].pool_offset < hi:
            e = extents[k]
            a, b = max(lo, e.pool_offset), min(hi, e.pool_offset + e.nbytes)
            piece = data[a - lo:b - lo]
            if e.source == IMAGE:
                _pwrite_all(fd, piece, e.offset + a - e.pool_offset)
            elif (a, b) != (e.pool_offset, e.pool_offset + e.nbytes):
                raise ValueError(f"weights plan: reference {e} is not inside one tensor")
            elif not _file_holds(plan.model_path(e.source), e.offset, piece):
                _pwrite_all(fd, piece, end)
                extents[k] = Extent(e.pool_offset, e.nbytes, IMAGE, end)
                end += e.nbytes
                converted += 1
            k += 1
    new = replace(plan, extents=tuple(extents))
    new.check()
    return new, converted


def _pwrite_all(fd: int, data: Any, offset: int) -> None:
    view = memoryview(np.ascontiguousarray(data)).cast("B")
    done = 0
    while done < len(view):
        n = os.pwrite(fd, view[done:], offset + done)
        if n <= 0:
            raise OSError(f"short write to the weights file at byte {offset + done}")
        done += n


def _file_holds(path: Path, offset: int, data: Any) -> bool:
    """Whether the model file holds ``data`` at ``offset`` (read-only, in chunks)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # a FIFO must not block the refresh
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return False  # the reference becomes literal
        for a in range(0, data.size, COMPARE_CHUNK):
            b = min(a + COMPARE_CHUNK, data.size)
            chunk = os.pread(fd, b - a, offset + a)
            if len(chunk) != b - a or not np.array_equal(np.frombuffer(chunk, dtype=np.uint8), data[a:b]):
                return False
        return True
    finally:
        os.close(fd)
