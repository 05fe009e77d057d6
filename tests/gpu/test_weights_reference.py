"""Weights by reference on a real GPU (the GPU machine only:
`pytest -m gpu -s tests/gpu/test_weights_reference.py`): a 0.5 GB bf16 model written as two
safetensors shards, a weights pool on the GPU shaped like vLLM's (embed, fused qkv and gate_up,
o and down, norms, an FP8-like tensor the files do not hold, a tied lm_head: 0.64 GB, 17 MB of
it literal), saved by reference and loaded back through the real driver: by dma_plan_into
(page-locking pieces of the model's files and of the rank file in place) and through pinned
buffers. Every byte must land; the speeds are printed, not asserted (compare them with dma_into
over the plain file, printed beside them)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")
pytest.importorskip("cuda.bindings")
safetensors_torch = pytest.importorskip("safetensors.torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from vsnap.engine.adapters.vllm.weights import copiers  # noqa: E402
from vsnap.engine.adapters.vllm.weights.layout import layout, storage_view  # noqa: E402
from vsnap.engine.adapters.vllm.weights.reference_copiers import buffered_plan_into, dma_plan_into  # noqa: E402
from vsnap.engine.adapters.vllm.weights.references import IMAGE, Plan, write_by_reference  # noqa: E402

HIDDEN, KV, INTERMEDIATE, VOCAB, LAYERS = 2048, 512, 5632, 32000, 4  # ~0.48 GB of bf16


def _checkpoint(model: Path) -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)

    def bf16(*shape: int) -> Any:
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

    tensors = {"model.embed_tokens.weight": bf16(VOCAB, HIDDEN), "model.norm.weight": bf16(HIDDEN)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        tensors |= {p + "self_attn.q_proj.weight": bf16(HIDDEN, HIDDEN), p + "self_attn.k_proj.weight": bf16(KV, HIDDEN),
                    p + "self_attn.v_proj.weight": bf16(KV, HIDDEN), p + "self_attn.o_proj.weight": bf16(HIDDEN, HIDDEN),
                    p + "mlp.gate_proj.weight": bf16(INTERMEDIATE, HIDDEN),
                    p + "mlp.up_proj.weight": bf16(INTERMEDIATE, HIDDEN),
                    p + "mlp.down_proj.weight": bf16(HIDDEN, INTERMEDIATE),
                    p + "input_layernorm.weight": bf16(HIDDEN), p + "post_attention_layernorm.weight": bf16(HIDDEN)}
    names = list(tensors)
    half = len(names) // 2
    model.mkdir()
    for k, part in enumerate((names[:half], names[half:])):
        safetensors_torch.save_file({n: tensors[n] for n in part}, str(model / f"model-0000{k + 1}-of-00002.safetensors"))
    return tensors


def _pool(t: dict[str, Any]) -> list[tuple[str, Any]]:
    """The pool on the GPU as vLLM holds it: fused qkv and gate_up, an FP8-like tensor, a tied lm_head."""
    gpu: list[tuple[str, Any]] = [("embed", t["model.embed_tokens.weight"].cuda())]
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        gpu += [(p + "qkv", torch.cat([t[p + f"self_attn.{x}_proj.weight"] for x in "qkv"]).cuda()),
                (p + "o", t[p + "self_attn.o_proj.weight"].cuda()),
                (p + "gate_up", torch.cat([t[p + "mlp.gate_proj.weight"], t[p + "mlp.up_proj.weight"]]).cuda()),
                (p + "down", t[p + "mlp.down_proj.weight"].cuda()),
                (p + "norms", torch.cat([t[p + "input_layernorm.weight"], t[p + "post_attention_layernorm.weight"]]).cuda())]
    gpu += [("fp8_like", torch.randint(0, 255, (16 << 20,), dtype=torch.uint8, device="cuda")),
            ("lm_head", t["model.embed_tokens.weight"].cuda())]
    return [(name, storage_view(tensor)) for name, tensor in gpu]


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Plan, Path, list[tuple[str, Any]], list[Any]]:
    root = tmp_path_factory.mktemp("reference")
    tensors = _checkpoint(root / "model")
    named = _pool(tensors)
    want = [t.clone() for _, t in named]
    rank_path = root / "rank0.bin"
    start = time.monotonic()
    with open(rank_path, "wb") as f:
        plan = write_by_reference(f, (t.cpu().numpy() for _, t in named), str(root / "model"))
    total = sum(t.numel() for _, t in named)
    print(f"\nsaved by reference: {total / 1e9:.3f} GB in {time.monotonic() - start:.2f} s; referenced "
          f"{plan.referenced_bytes / 1e9:.3f} GB, literal {plan.literal_bytes / 1e9:.3f} GB, "
          f"{len(plan.extents)} extents")
    return plan, rank_path, named, want


def test_only_the_literal_bytes_are_in_the_rank_file(saved: tuple[Plan, Path, list[tuple[str, Any]], list[Any]]) -> None:
    plan, rank_path, named, _ = saved
    norms = sum(t.numel() for name, t in named if name.endswith("norms"))
    assert plan.literal_bytes == rank_path.stat().st_size == norms + (16 << 20)
    references = [e for e in plan.extents if e.source != IMAGE]
    assert len(plan.files) == 2 and len(references) == 2 + 7 * LAYERS  # embed, q k v, o, gate up, down, lm_head


def _zero_and_check(named: list[tuple[str, Any]], want: list[Any], load: Any) -> dict[str, float]:
    for _, t in named:
        t.zero_()
    torch.cuda.synchronize()
    result = load()
    torch.cuda.synchronize()
    for (name, got), expected in zip(named, want):
        assert torch.equal(got, expected), name
    return result


@pytest.mark.parametrize("threads,held", [(4, 16), (2, 2)])
def test_dma_plan_into_lands_every_byte(saved: tuple[Plan, Path, list[tuple[str, Any]], list[Any]], threads: int,
                                        held: int) -> None:
    plan, rank_path, named, want = saved
    segments, targets = layout(named), [t for _, t in named]
    result = _zero_and_check(named, want, lambda: dma_plan_into(plan, rank_path, segments, targets, threads=threads,
                                                                piece=64 << 20, held=held))
    print(f"\ndma_plan_into {threads}x{held}: {result['weights_gb_per_s']:.1f} GB/s "
          f"({result['weights_load_s']:.3f} s, {result['weights_registered_pieces']:.0f} pieces)")
    maps = Path("/proc/self/maps").read_text()
    assert str(rank_path) not in maps and not any(str(plan.model_path(k)) in maps for k in range(len(plan.files)))


def test_unlock_later_hands_each_file_and_releases_it(saved: tuple[Plan, Path, list[tuple[str, Any]], list[Any]]) -> None:
    plan, rank_path, named, want = saved
    handed: list[copiers.LockedPages] = []
    result = _zero_and_check(named, want, lambda: dma_plan_into(plan, rank_path, layout(named), [t for _, t in named],
                                                                unlock_later=handed.append))
    released = copiers.release_all(handed, 0.0)
    print(f"\ndma_plan_into, unlocked later: {result['weights_gb_per_s']:.1f} GB/s; unlocking {released}")
    assert len(handed) == 0 and released["unlocked_pieces"] == result["weights_unlocked_later_pieces"]


def test_buffered_plan_into_lands_every_byte(saved: tuple[Plan, Path, list[tuple[str, Any]], list[Any]]) -> None:
    plan, rank_path, named, want = saved
    result = _zero_and_check(named, want, lambda: buffered_plan_into(plan, rank_path, layout(named), [t for _, t in named]))
    print(f"\nbuffered_plan_into: {result['weights_gb_per_s']:.1f} GB/s ({result['weights_load_s']:.3f} s)")


def test_the_plain_file_for_comparison(saved: tuple[Plan, Path, list[tuple[str, Any]], list[Any]],
                                       tmp_path: Path) -> None:
    _, _, named, want = saved
    path = tmp_path / "plain.bin"
    with open(path, "wb") as f:
        for t in want:
            f.write(memoryview(t.cpu().numpy()))
    result = _zero_and_check(named, want, lambda: copiers.dma_into(path, layout(named), [t for _, t in named]))
    print(f"\ndma_into over the plain file: {result['weights_gb_per_s']:.1f} GB/s ({result['weights_load_s']:.3f} s)")
