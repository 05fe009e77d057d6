"""Weights by reference on CPU: safetensors headers read as hostile, the matcher against files
written here (dense, fused, FP8-like, partial, tensor-parallel slices, tied), the plan and its
JSON, and save + load + refresh through the worker's methods with CPU tensors. dma_into's
version against the fake driver is in test_weights_dma.py; the real GPU in
tests/gpu/test_weights_reference.py."""

from __future__ import annotations

import io
import json
import os
import struct
import threading
import weakref
from pathlib import Path
from typing import Any

import pytest

np = pytest.importorskip("numpy")

from vsnap.engine.adapters.vllm.weights.references import (  # noqa: E402
    IMAGE,
    Extent,
    ModelFile,
    Plan,
    ReferenceMatcher,
    _one_ahead,
    plan_file_name,
    write_by_reference,
)
from vsnap.engine.adapters.vllm.weights.safetensors_header import UnusableHeader, read_header  # noqa: E402

KIB = 1024


def random_bytes(n: int, seed: int) -> Any:
    return np.random.default_rng(seed).integers(0, 256, size=n, dtype=np.uint8)


def write_safetensors(path: Path, tensors: dict[str, Any], *, pad_header: int = 0) -> dict[str, int]:
    """A .safetensors file of uint8 tensors back to back; returns each tensor's offset in the file."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, array in tensors.items():
        header[name] = {"dtype": "U8", "shape": [int(array.size)], "data_offsets": [offset, offset + int(array.size)]}
        offset += int(array.size)
    raw = json.dumps(header).encode() + b" " * pad_header
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for array in tensors.values():
            f.write(array.tobytes())
    return {name: 8 + len(raw) + header[name]["data_offsets"][0] for name in tensors}


def write_raw(path: Path, header: bytes, data: bytes = b"", length: int | None = None) -> Path:
    path.write_bytes(struct.pack("<Q", len(header) if length is None else length) + header + data)
    return path


def header_of(path: Path) -> list[Any]:
    fd = os.open(path, os.O_RDONLY)
    try:
        return read_header(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)


def pool_bytes(plan: Plan, rank: bytes) -> bytes:
    """The pool as the plan rebuilds it from the model files and the rank file's bytes."""
    out = bytearray()
    for e in plan.extents:
        if e.source == IMAGE:
            out += rank[e.offset:e.offset + e.nbytes]
        else:
            with open(plan.model_path(e.source), "rb") as f:
                f.seek(e.offset)
                out += f.read(e.nbytes)
    return bytes(out)


def save(pool: list[Any], model: Path, parts: int = 1) -> tuple[Plan, bytes]:
    out = io.BytesIO()
    plan = write_by_reference(out, pool, str(model), parts=parts)
    return plan, out.getvalue()


@pytest.fixture
def checkpoint(tmp_path: Path) -> dict[str, Any]:
    model = tmp_path / "model"
    model.mkdir()
    tensors = {"q": random_bytes(128 * KIB, 1), "k": random_bytes(64 * KIB, 2), "v": random_bytes(64 * KIB, 3),
               "norm": random_bytes(8 * KIB, 4)}
    more = {"embed": random_bytes(300_000, 5), "gate": random_bytes(96 * KIB, 6), "up": random_bytes(96 * KIB, 7),
            "zeros": np.zeros(128 * KIB, dtype=np.uint8)}
    write_safetensors(model / "model-00001-of-00002.safetensors", tensors)
    write_safetensors(model / "model-00002-of-00002.safetensors", more, pad_header=5)
    (model / "config.json").write_text("{}")
    return {"dir": model, **tensors, **more}


# --- the matcher ------------------------------------------------------------------------------


def test_dense_tensors_are_references_and_small_ones_literal(checkpoint: dict[str, Any]) -> None:
    c = checkpoint
    pool = [c["q"].copy(), c["norm"].copy(), c["embed"].copy()]
    plan, rank = save(pool, c["dir"])
    assert [(e.source != IMAGE, e.nbytes) for e in plan.extents] == [(True, 128 * KIB), (False, 8 * KIB), (True, 300_000)]
    assert plan.literal_bytes == len(rank) == 8 * KIB and rank == c["norm"].tobytes()
    assert plan.referenced_bytes == 128 * KIB + 300_000
    assert [f.path for f in plan.files] == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert pool_bytes(plan, rank) == b"".join(p.tobytes() for p in pool)


def test_a_fused_tensor_is_its_checkpoint_tensors_back_to_back(checkpoint: dict[str, Any]) -> None:
    c = checkpoint
    qkv, gate_up = np.concatenate([c["q"], c["k"], c["v"]]), np.concatenate([c["gate"], c["up"]])
    plan, rank = save([qkv, gate_up], c["dir"])
    assert rank == b"" and plan.literal_bytes == 0
    assert [e.nbytes for e in plan.extents] == [128 * KIB, 64 * KIB, 64 * KIB, 96 * KIB, 96 * KIB]
    assert [e.pool_offset for e in plan.extents] == [0, 128 * KIB, 192 * KIB, 256 * KIB, 352 * KIB]
    assert pool_bytes(plan, rank) == qkv.tobytes() + gate_up.tobytes()


def test_bytes_that_differ_from_the_files_are_all_literal_like_the_plain_file(checkpoint: dict[str, Any]) -> None:
    """FP8-like: what vLLM loaded is not what the file holds (quantized, permuted): one literal
    extent, and the rank file is byte for byte what the default path writes."""
    c = checkpoint
    pool = [(c["q"] ^ 0x80).astype(np.uint8), c["embed"][::-1].copy(), (c["gate"] // 2).astype(np.uint8)]
    plan, rank = save(pool, c["dir"])
    assert plan.extents == (Extent(0, sum(p.size for p in pool), IMAGE, 0),) and plan.files == ()
    assert rank == b"".join(p.tobytes() for p in pool)


def test_partial_matches(checkpoint: dict[str, Any]) -> None:
    c = checkpoint
    head = random_bytes(8 * KIB, 9)
    padded = np.concatenate([head, c["embed"], np.zeros(1000, np.uint8)])  # literal, a reference, padding
    almost = c["gate"].copy()
    almost[-1] ^= 1  # equal but for the last byte: not a reference
    unaligned = np.concatenate([random_bytes(1000, 10), c["up"]])  # starts 1000 bytes in: not on the grid
    chained = np.concatenate([c["k"], random_bytes(4 * KIB, 11), c["v"]])  # a 4 KiB step after a reference
    pool = [padded, almost, unaligned, chained]
    plan, rank = save(pool, c["dir"])
    refs = [(e.pool_offset, e.nbytes) for e in plan.extents if e.source != IMAGE]
    base_chained = padded.size + almost.size + unaligned.size
    assert refs == [(8 * KIB, 300_000), (base_chained, 64 * KIB), (base_chained + 68 * KIB, 64 * KIB)]
    assert pool_bytes(plan, rank) == b"".join(p.tobytes() for p in pool)
    assert len(rank) == plan.literal_bytes == 8 * KIB + 1000 + almost.size + unaligned.size + 4 * KIB


def test_tensor_parallel_slices_are_found(checkpoint: dict[str, Any]) -> None:
    """A rank of a column-parallel layer holds one 1/tp slice of q, k and v (rows split along dim 0)."""
    c = checkpoint
    rank1 = np.concatenate([c["q"][64 * KIB:], c["k"][32 * KIB:], c["v"][32 * KIB:]])
    plan, rank = save([rank1], c["dir"], parts=2)
    assert [e.source != IMAGE for e in plan.extents] == [True, False]  # q's half; k's and v's are under 64 KiB
    plan4, _ = save([np.concatenate([c["q"][64 * KIB:], c["gate"][48 * KIB:]])], c["dir"], parts=2)
    assert plan4.literal_bytes == 48 * KIB and plan4.referenced_bytes == 64 * KIB
    whole, _ = save([c["q"].copy()], c["dir"], parts=2)  # a replicated tensor: still whole, the longest first
    assert [e.nbytes for e in whole.extents] == [128 * KIB]
    assert pool_bytes(plan, rank) == rank1.tobytes()


def test_tied_tensors_reference_the_same_bytes_and_zeros_are_never_indexed(checkpoint: dict[str, Any]) -> None:
    c = checkpoint
    pool = [c["embed"].copy(), c["embed"].copy(), np.zeros(256 * KIB, np.uint8)]
    plan, rank = save(pool, c["dir"])
    refs = [e for e in plan.extents if e.source != IMAGE]
    assert len(refs) == 2 and refs[0].offset == refs[1].offset
    assert plan.literal_bytes == 256 * KIB  # the zero-filled checkpoint tensor would match it everywhere


def test_no_safetensors_or_no_directory_is_all_literal(tmp_path: Path) -> None:
    pool = [random_bytes(200 * KIB, 1)]
    for model in (tmp_path, tmp_path / "absent"):
        plan, rank = save(pool, model)
        assert plan.referenced_bytes == 0 and rank == pool[0].tobytes()


def test_the_matcher_refuses_settings_that_make_no_sense(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="min_reference"):
        ReferenceMatcher(tmp_path, min_reference=100)


# --- hostile headers ----------------------------------------------------------------------------


def _entry(begin: Any, end: Any) -> dict[str, Any]:
    return {"dtype": "U8", "shape": [1], "data_offsets": [begin, end]}


@pytest.mark.parametrize("header,data,length,reason", [
    (json.dumps({"a": _entry(0, 200)}).encode(), b"x" * 100, None, "outside the file's 100 data bytes"),
    (json.dumps({"a": _entry(-1, 10)}).encode(), b"x" * 100, None, "outside"),
    (json.dumps({"a": _entry(50, 10)}).encode(), b"x" * 100, None, "outside"),
    (json.dumps({"a": _entry(0, 60), "b": _entry(50, 100)}).encode(), b"x" * 100, None, "overlap"),
    (json.dumps({"a": _entry(0, 90), "z": _entry(40, 40), "b": _entry(60, 70)}).encode(), b"x" * 100, None, "overlap"),
    (b"{}", b"", 1 << 62, "is over"),
    (b"{}", b"", 1000, "runs past the end"),
    (b"not json", b"", None, "not JSON"),
    (b"\xff\xfe", b"", None, "not JSON"),
    (b"[1, 2]", b"", None, "not a JSON object"),
    (b'{"a": {"data_offsets": [0, 1]}, "a": {"data_offsets": [1, 2]}}', b"xx", None, "not JSON"),
    (json.dumps({"a": _entry(True, 1)}).encode(), b"x", None, "no data_offsets"),
    (json.dumps({"a": _entry(0.0, 1)}).encode(), b"x", None, "no data_offsets"),
    (json.dumps({"a": {"dtype": "U8", "data_offsets": [0]}}).encode(), b"x", None, "no data_offsets"),
    (json.dumps({"a": [0, 1]}).encode(), b"x", None, "no data_offsets"),
    (b"[" * 100_000 + b"]" * 100_000, b"", None, "not JSON"),
])
def test_a_hostile_header_is_refused(tmp_path: Path, header: bytes, data: bytes, length: int | None,
                                     reason: str) -> None:
    path = write_raw(tmp_path / "bad.safetensors", header, data, length)
    with pytest.raises(UnusableHeader, match=reason):
        header_of(path)


def test_a_file_too_short_for_a_header_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "short.safetensors"
    path.write_bytes(b"\x01\x00")
    with pytest.raises(UnusableHeader, match="too short"):
        header_of(path)


def test_metadata_and_empty_tensors_are_fine(tmp_path: Path) -> None:
    header = json.dumps({"__metadata__": {"x": "y"}, "b": _entry(10, 30), "e": _entry(10, 10), "a": _entry(0, 10)})
    path = write_raw(tmp_path / "ok.safetensors", header.encode(), b"x" * 30)
    start = 8 + len(header)
    assert [(t.name, t.offset, t.nbytes) for t in header_of(path)] == [("a", start, 10), ("e", start + 10, 0),
                                                                      ("b", start + 10, 20)]


def test_files_with_unusable_headers_are_skipped_and_the_others_used(checkpoint: dict[str, Any]) -> None:
    c = checkpoint
    write_raw(c["dir"] / "a-broken.safetensors", b"{", b"")
    write_raw(c["dir"] / "b-liar.safetensors", json.dumps({"t": _entry(0, 1 << 40)}).encode(), b"x")
    (c["dir"] / "c-dir.safetensors").mkdir()
    plan, _ = save([c["q"].copy()], c["dir"])
    assert plan.referenced_bytes == 128 * KIB
    skipped = dict(plan.skipped)
    assert "not JSON" in skipped["a-broken.safetensors"] and "outside" in skipped["b-liar.safetensors"]
    assert skipped["c-dir.safetensors"] == "not a regular file"
    assert "a-broken.safetensors" in Plan.from_json(plan.to_json("rank0.bin")).skipped[0][0]


def test_the_safetensors_package_and_this_reader_agree(tmp_path: Path) -> None:
    numpy_io = pytest.importorskip("safetensors.numpy")
    arrays = {"w": np.arange(70_000, dtype=np.float32).reshape(700, 100), "b": np.ones(3, dtype=np.float16)}
    path = tmp_path / "model.safetensors"
    numpy_io.save_file(arrays, str(path))
    found = {t.name: t for t in header_of(path)}
    raw = path.read_bytes()
    for name, array in arrays.items():
        t = found[name]
        assert raw[t.offset:t.offset + t.nbytes] == array.tobytes()
    plan, rank = save([arrays["w"].view(np.uint8).reshape(-1)], tmp_path)
    assert plan.referenced_bytes == arrays["w"].nbytes and rank == b""


# --- the plan -----------------------------------------------------------------------------------


def test_the_plan_round_trips_through_json_and_says_its_counts(checkpoint: dict[str, Any], tmp_path: Path) -> None:
    c = checkpoint
    plan, _ = save([np.concatenate([c["q"], c["norm"]]), c["embed"].copy()], c["dir"])
    raw = json.loads(plan.to_json("rank0.bin"))
    assert raw["rank_file"] == "rank0.bin" and raw["source_rank_file"] == IMAGE
    assert (raw["referenced_bytes"], raw["literal_bytes"]) == (plan.referenced_bytes, plan.literal_bytes)
    assert raw["total_bytes"] == 128 * KIB + 8 * KIB + 300_000
    assert Plan.from_json(plan.to_json("rank0.bin")) == plan
    assert plan_file_name(3) == "rank3.refs.json"


@pytest.mark.parametrize("change,reason", [
    (lambda r: r["extents"].pop(0), "does not follow"),
    (lambda r: r["extents"][0].__setitem__(2, 7), "outside its model file"),
    (lambda r: r["extents"][0].__setitem__(3, 1 << 40), "outside its model file"),
    (lambda r: r["model_files"][0].__setitem__("path", "../../etc/shadow"), "not a file name"),
    (lambda r: r["extents"][1].__setitem__(3, 5), "not covered once"),
    (lambda r: r["extents"][0].__setitem__(1, True), "not an integer"),
    (lambda r: r.__setitem__("format", 2), "format 2"),
    (lambda r: r.pop("extents"), "not a weights plan"),
    (lambda r: r["extents"][0].append(1), "another number of fields"),
])
def test_a_plan_that_does_not_tile_is_refused(checkpoint: dict[str, Any], change: Any, reason: str) -> None:
    c = checkpoint
    plan, _ = save([c["q"].copy(), c["norm"].copy(), c["embed"].copy()], c["dir"])
    raw = json.loads(plan.to_json("rank0.bin"))
    change(raw)
    with pytest.raises(ValueError, match=reason):
        Plan.from_json(json.dumps(raw))


def test_a_plan_with_no_reference_is_one_literal_extent() -> None:
    plan = Plan("/m", (), (Extent(0, 10, IMAGE, 0),))
    plan.check()
    assert (plan.literal_bytes, plan.referenced_bytes) == (10, 0)
    with pytest.raises(ValueError, match="not a file name"):
        Plan("/m", (ModelFile("a/b", 1),), plan.extents).check()


# --- hostile pass h1: model directories and plans read as hostile -----------------------------


class Blocked(Exception):
    """A test's alarm: an open that would have blocked forever."""


def test_a_fifo_named_like_a_safetensors_file_is_skipped_not_opened_blocking(checkpoint: dict[str, Any]) -> None:
    import signal

    c = checkpoint
    os.mkfifo(c["dir"] / "a-fifo.safetensors")  # os.open(O_RDONLY) of a FIFO waits for a writer: forever

    def alarm(*_: object) -> None:
        raise Blocked("the save blocked for 5 s")

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(5)
    try:
        plan, _ = save([c["q"].copy()], c["dir"])
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert dict(plan.skipped)["a-fifo.safetensors"] == "not a regular file"
    assert plan.referenced_bytes == 128 * KIB


def test_tensors_that_share_their_first_block_cost_bounded_comparisons(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A hostile model: N tensors with one first block, each different after it. Every candidate
    was kept (and the list sorted again at each one: N^2 log N at indexing), and every one was
    compared at every position the block recurs at: N x 64 KiB per 4 KiB of the pool."""
    from vsnap.engine.adapters.vllm.weights import references

    model = tmp_path / "model"
    model.mkdir()
    head = random_bytes(4 * KIB, 1)
    n = 200
    tensors = {f"t{k}": np.concatenate([head, random_bytes(60 * KIB, 100 + k)]) for k in range(n)}
    write_safetensors(model / "model.safetensors", tensors)
    compared = []
    original = ReferenceMatcher._equal

    def counting(self: ReferenceMatcher, data: Any, pos: int, r: Any) -> bool:
        compared.append(r.nbytes)
        return original(self, data, pos, r)

    monkeypatch.setattr(ReferenceMatcher, "_equal", counting)
    with ReferenceMatcher(model) as matcher:
        assert max(len(v) for v in matcher._by_digest.values()) == references.MAX_CANDIDATES
    # a pool of the block repeated, each copy followed by bytes no tensor has: nothing matches
    pool = np.concatenate([np.concatenate([head, random_bytes(60 * KIB, 999)]) for _ in range(8)])
    plan, rank = save([pool], model)
    assert plan.referenced_bytes == 0 and rank == pool.tobytes()
    assert len(compared) <= 8 * references.MAX_CANDIDATES  # was 8 x 200
    # the comparison budget: past it, the rest of the tensor is literal (never wrong)
    compared.clear()
    monkeypatch.setattr(references, "COMPARE_SLACK", 0)
    monkeypatch.setattr(references, "COMPARE_BUDGET", 1)
    plan, rank = save([pool], model)
    assert sum(compared) <= pool.size + 64 * KIB and pool_bytes(plan, rank) == pool.tobytes()
    # the kept candidates still match
    compared.clear()
    monkeypatch.undo()
    plan, rank = save([tensors["t0"].copy()], model)
    assert pool_bytes(plan, rank) == tensors["t0"].tobytes()


def _plan_json(checkpoint: dict[str, Any]) -> tuple[Plan, dict[str, Any]]:
    c = checkpoint
    plan, _ = save([c["q"].copy(), c["norm"].copy(), c["embed"].copy()], c["dir"])
    return plan, json.loads(plan.to_json("rank0.bin"))


@pytest.mark.parametrize("change,reason", [
    (lambda r: r.__setitem__("format", True), "format True"),
    (lambda r: r.__setitem__("format", 1.0), "format 1.0"),
    (lambda r: r.__setitem__("source_rank_file", -2), "source_rank_file is -2"),
    (lambda r: r.__setitem__("total_bytes", 1 << 60), "are not its extents'"),
    (lambda r: r.__setitem__("literal_bytes", 0), "are not its extents'"),
    (lambda r: r.__setitem__("rank_file", "../../etc/shadow"), "rank_file '../../etc/shadow' is not a file name"),
    (lambda r: r.__setitem__("rank_file", "rank\u00000.bin"), "is not a file name"),
    (lambda r: r.__setitem__("model_dir", "relative/model"), "not an absolute, normalized path"),
    (lambda r: r.__setitem__("model_dir", "/m/../etc"), "not an absolute, normalized path"),
    (lambda r: r.__setitem__("model_dir", "/m\u0000x"), "not an absolute, normalized path"),
    (lambda r: r["model_files"].append(dict(r["model_files"][0])), "named twice"),
    (lambda r: r["model_files"][0].__setitem__("path", "/etc/shadow"), "not a file name"),
    (lambda r: r["model_files"][0].__setitem__("path", ".."), "not a file name"),
    (lambda r: r["extents"][0].__setitem__(2, -2), "outside its model file"),
    (lambda r: r["extents"][0].__setitem__(2, 1 << 40), "outside its model file"),
    (lambda r: r["extents"][0].__setitem__(1, 0), "does not follow"),
    (lambda r: r.__setitem__("extents", "abcd"), "another number of fields"),
    (lambda r: r.__setitem__("extents", 7), "not a weights plan"),
    (lambda r: r.__setitem__("model_files", [["path", 1]]), "not a weights plan"),
    (lambda r: r.__setitem__("skipped_files", {"path": 1}), "not a weights plan"),
])
def test_a_hostile_plan_json_is_refused(checkpoint: dict[str, Any], change: Any, reason: str) -> None:
    _, raw = _plan_json(checkpoint)
    change(raw)
    with pytest.raises(ValueError, match=reason):
        Plan.from_json(json.dumps(raw))


@pytest.mark.parametrize("text,reason", [
    ("[" * 100_000 + "]" * 100_000, "not a weights plan"),
    ('{"format": 1, "format": 1}', "given twice"),
    ("1" * 5000, "digits|not a weights plan"),
    ("null", "not a weights plan"),
    ('"x"', "not a weights plan"),
])
def test_hostile_plan_text_is_refused(text: str, reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        Plan.from_json(text)


def test_a_giant_plan_is_refused_before_it_is_parsed(checkpoint: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    from vsnap.engine.adapters.vllm.weights import references

    plan, _ = _plan_json(checkpoint)
    text = plan.to_json("rank0.bin")
    monkeypatch.setattr(references, "MAX_PLAN_BYTES", len(text) - 1)
    with pytest.raises(ValueError, match=f"{len(text)} bytes, over"):
        Plan.from_json(text)


def test_the_reader_names_the_model_dir_and_rank_file_it_expects(checkpoint: dict[str, Any]) -> None:
    plan, _ = _plan_json(checkpoint)
    text = plan.to_json("rank0.bin")
    assert Plan.from_json(text, model_dir=plan.model_dir, rank_file="rank0.bin") == plan
    with pytest.raises(ValueError, match="is not the image's model '/elsewhere'"):
        Plan.from_json(text, model_dir="/elsewhere")
    with pytest.raises(ValueError, match="rank_file 'rank0.bin' is not rank1.bin"):
        Plan.from_json(text, rank_file="rank1.bin")


def test_one_ahead_keeps_order_makes_the_next_beside_and_ends_its_thread() -> None:
    """The save takes the next pool tensor (its copy from the GPU) on a helper thread while it
    matches this one: items come in order, at most two exist at once, an item's error is raised in
    its place, and no thread is left (the tree is checkpointed next)."""
    class Item:
        alive = 0

        def __init__(self, n: int) -> None:
            self.n, self.thread = n, threading.current_thread().name
            Item.alive += 1
            self.most = Item.alive
            weakref.finalize(self, Item._gone)

        @staticmethod
        def _gone() -> None:
            Item.alive -= 1

    def made() -> Any:
        for n in range(6):
            yield Item(n)

    seen = []
    for item, waited in _one_ahead(made()):
        assert waited >= 0 and item.thread.startswith("vsnap-host-copy") and item.most <= 2
        seen.append(item.n)
        del item
    assert seen == list(range(6))
    assert not [t for t in threading.enumerate() if t.name.startswith("vsnap-host-copy")]

    def failing() -> Any:
        yield 1
        raise OSError("the copy failed")

    got = []
    with pytest.raises(OSError, match="the copy failed"):
        for item, _ in _one_ahead(failing()):
            got.append(item)
    assert got == [1]
    assert not [t for t in threading.enumerate() if t.name.startswith("vsnap-host-copy")]


def test_the_save_says_where_its_time_went(checkpoint: dict[str, Any]) -> None:
    spent: dict[str, float] = {}
    tensors = [np.frombuffer(np.concatenate([checkpoint["q"], checkpoint["k"]]).tobytes(), dtype=np.uint8)]
    plan = write_by_reference(io.BytesIO(), iter(tensors), str(checkpoint["dir"]), spent=spent)
    assert plan.referenced_bytes > 0
    assert set(spent) == {"host_copy_wait_s", "match_s", "write_s"} and all(v >= 0 for v in spent.values())
