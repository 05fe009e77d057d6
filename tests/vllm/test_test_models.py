"""The test models' formats as vLLM itself reads them (scripts/make_test_model.py): the per-tensor
"fp8" checkpoint and the per-channel compressed-tensors one that most published FP8 checkpoints
use (issue 28's 70B-class model is written in it), and the 70B shape's size."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from tests.vllm.conftest import SCRIPT


def _script():
    spec = importlib.util.spec_from_file_location("make_test_model", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_vllm_reads_the_per_tensor_checkpoint_as_fp8(tiny_fp8: Path) -> None:
    from vllm.config import ModelConfig

    assert ModelConfig(model=str(tiny_fp8), tokenizer=str(tiny_fp8)).quantization == "fp8"


def test_vllm_reads_the_per_channel_checkpoint_as_compressed_tensors_channel_weights_token_activations(
        tiny_fp8_channel: Path) -> None:
    from vllm.config import ModelConfig
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import CompressedTensorsConfig

    assert ModelConfig(model=str(tiny_fp8_channel), tokenizer=str(tiny_fp8_channel)).quantization == "compressed-tensors"
    config = json.loads((tiny_fp8_channel / "config.json").read_text())["quantization_config"]
    scheme = CompressedTensorsConfig.from_config(config).target_scheme_map["Linear"]
    assert (scheme["weights"].strategy, scheme["weights"].dynamic) == ("channel", False)
    assert (scheme["input_activations"].strategy, scheme["input_activations"].dynamic) == ("token", True)


def test_per_channel_scales_are_one_per_output_row_and_scale_back_to_the_weights(tiny_fp8_channel: Path) -> None:
    import torch
    from safetensors import safe_open

    script = _script()
    original = dict(script.tensors(dict(script.SHAPES["tiny"]), 0))
    with safe_open(str(tiny_fp8_channel / "model.safetensors"), "pt") as f:
        weight = f.get_tensor("model.layers.1.mlp.down_proj.weight")
        scale = f.get_tensor("model.layers.1.mlp.down_proj.weight_scale")
        assert "lm_head.weight_scale" not in f.keys() and f.get_tensor("lm_head.weight").dtype == torch.bfloat16
    want = original["model.layers.1.mlp.down_proj.weight"].float()
    assert weight.dtype == torch.float8_e4m3fn and scale.dtype == torch.bfloat16
    assert tuple(scale.shape) == (want.shape[0], 1)
    error = (weight.float() * scale.float() - want).abs().max() / want.abs().max()
    assert error < 0.07  # e4m3 keeps 3 mantissa bits: a relative error of at most 1/16 of the largest


def test_the_70b_shape_is_llama_3_70b() -> None:
    cfg = _script().SHAPES["70b"]
    h, i, v, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    kv = cfg["num_key_value_heads"] * h // cfg["num_attention_heads"]
    params = 2 * v * h + layers * (2 * h * h + 2 * kv * h + 3 * h * i + 2 * h) + h
    assert round(params / 1e9, 1) == 70.6
