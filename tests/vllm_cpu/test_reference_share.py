"""Weights by reference against real vLLM's processed weights (issue 28 item 1): vLLM on its CPU
backend loads a checkpoint and processes it as before serving (fused projections, FP8 scales), and
the capture's own matcher (references.py) finds each tensor's bytes in the model's safetensors,
through scripts/reference_share.py. What a checkpoint format leaves in the image is decided here,
by vLLM's code, not by a fake: per-channel FP8 keeps its weights' bytes (a transposed view), so
only the scales and norms are literal. (A bf16 checkpoint cannot be measured on this backend: it
packs the linear weights for oneDNN outside torch; the H200 measured the 8B's, session 14.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from vsnap.engine.adapters.vllm.weights.references import MIN_REFERENCE

ROOT = Path(__file__).resolve().parents[2]
HIDDEN, KV = 256, 2 * 64  # the tiny shape (make_test_model.py): hidden 256, 2 KV heads of 64


def share(tmp: Path, *model_args: str) -> dict[str, Any]:
    """The kinds of tensors of the tiny model in that format, as reference_share.py sums them."""
    model, out = tmp / "model", tmp / "share.json"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "make_test_model.py"), str(model), "--shape", "tiny",
                    "--device", "cpu", *model_args], check=True, capture_output=True, timeout=300)
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "reference_share.py"), str(model), "--json", str(out)],
                            check=False, capture_output=True, text=True, timeout=600, cwd="/",
                            env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["empty_parameters"] == []  # every weight measured: none repacked outside torch
    return doc["summary"]["kinds"]


def qkv_referenced(element: int) -> int:
    """Of a layer's fused qkv (``element`` bytes a weight), the bytes of its q, k and v shards that
    are large enough to be referenced (the tiny's k and v are under MIN_REFERENCE: literal)."""
    shards = [HIDDEN * HIDDEN * element, KV * HIDDEN * element, KV * HIDDEN * element]
    return sum(n for n in shards if n >= MIN_REFERENCE)


def test_per_channel_fp8_leaves_only_its_scales_and_norms_literal(tmp_path: Path) -> None:
    kinds = share(tmp_path, "--fp8", "channel")
    for name in ("self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
        k = kinds[f"layer: {name}.weight (float8_e4m3fn)"]
        assert k["referenced"] == k["bytes"] > 0, name
    qkv = kinds["layer: self_attn.qkv_proj.weight (float8_e4m3fn)"]
    assert qkv["referenced"] == qkv["count"] * qkv_referenced(1)
    for kind in ("model.embed_tokens.weight (bfloat16)", "lm_head.weight (bfloat16)"):
        assert kinds[kind]["referenced"] == kinds[kind]["bytes"] > 0
    scales = [k for name, k in kinds.items() if "weight_scale" in name]
    norms = [k for name, k in kinds.items() if "norm" in name]
    assert len(scales) == 4 and len(norms) == 3
    assert all(k["referenced"] == 0 for k in scales + norms)
