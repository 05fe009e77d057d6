"""vsnap's snapshot rules against vLLM 0.26.0's own argument parser and resolved VllmConfig."""

from __future__ import annotations

from pathlib import Path

import pytest

from vsnap.engine.adapters import vllm_rules


def test_vllm_is_the_pinned_version() -> None:
    import vllm

    assert vllm.__version__.startswith("0.26.0")


def refused(model: Path, serve: dict, env: dict | None = None) -> list[str]:
    args, refusals = vllm_rules.parse_serve_args(str(model), serve)
    if args is None:
        return [str(r) for r in refusals]
    return [str(r) for r in vllm_rules.argument_refusals(args, env or {"VLLM_WORKER_MULTIPROC_METHOD": "spawn"})]


def test_plain_single_gpu_args_accepted(tiny_llama: Path) -> None:
    assert refused(tiny_llama, {"max_model_len": 512, "gpu_memory_utilization": 0.3, "enforce_eager": True,
                                "dtype": "bfloat16", "enable_prefix_caching": False}) == []
    args, _ = vllm_rules.parse_serve_args(str(tiny_llama), {"enable_prefix_caching": False})
    assert args.enable_sleep_mode is True and args.enable_prefix_caching is False


@pytest.mark.parametrize("serve,argument", [
    ({"tensor_parallel_size": 2}, "tensor_parallel_size"),
    ({"pipeline_parallel_size": 2}, "pipeline_parallel_size"),
    ({"data_parallel_size": 2}, "data_parallel_size"),
    ({"decode_context_parallel_size": 2}, "decode_context_parallel_size"),
    ({"api_server_count": 2}, "api_server_count"),
    ({"headless": True}, "headless"),
    ({"enable_expert_parallel": True}, "enable_expert_parallel"),
    ({"data_parallel_hybrid_lb": True}, "data_parallel_hybrid_lb"),
    ({"data_parallel_rank": 0}, "data_parallel_rank"),
    ({"node_rank": 1}, "node_rank"),
    ({"distributed_executor_backend": "ray"}, "distributed_executor_backend"),
    ({"logprobs_mode": "raw_logits"}, "logprobs_mode"),
    ({"trust_remote_code": True}, "trust_remote_code"),
    ({"logprobs_mode": "processed_logits"}, "logprobs_mode"),
])
def test_argument_rules_name_the_argument(tiny_llama: Path, serve: dict, argument: str) -> None:
    found = refused(tiny_llama, serve)
    assert found and found[0].startswith(f"{argument}:"), found


def test_environment_rules(tiny_llama: Path) -> None:
    assert any(r.startswith("VLLM_WORKER_MULTIPROC_METHOD:")
               for r in refused(tiny_llama, {}, {"VLLM_WORKER_MULTIPROC_METHOD": "fork"}))
    assert any(r.startswith("VLLM_USE_RUST_FRONTEND:") for r in refused(tiny_llama, {}, {"VLLM_USE_RUST_FRONTEND": "1"}))


def test_unknown_reserved_and_malformed_arguments(tiny_llama: Path) -> None:
    assert refused(tiny_llama, {"tensor_paralel_size": 2}) == ["serve.tensor_paralel_size: is not a vLLM serve argument"]
    assert refused(tiny_llama, {"port": 9000})[0].startswith("serve.port: is set by vsnap")
    assert refused(tiny_llama, {"max_model_len": "lots"})[0].startswith("serve: vLLM refuses the arguments")


def resolved_refusals(model: Path, serve: dict) -> list[str]:
    """Resolve a real VllmConfig on this CPU host (sleep mode needs CUDA, so it is off here)."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    args, refusals = vllm_rules.parse_serve_args(str(model), serve)
    assert args is not None, refusals
    args.enable_sleep_mode = False
    config = AsyncEngineArgs.from_cli_args(args).create_engine_config()
    return [r.argument for r in vllm_rules.config_refusals(config, is_cuda=False)]


def test_config_rules_on_a_resolved_config(tiny_llama: Path) -> None:
    # a dense unquantized Llama: only the host (no CUDA) and the sleep mode switched off here are refused
    assert resolved_refusals(tiny_llama, {"max_model_len": 512}) == ["device", "enable_sleep_mode"]
    found = resolved_refusals(tiny_llama, {"max_model_len": 512, "enable_lora": True, "load_format": "dummy",
                                           "cpu_offload_gb": 1})
    assert {"lora_config", "load_format", "cpu_offload_gb"} <= set(found)


def test_validate_spec_reports_refused_argument(tiny_llama: Path, tmp_path: Path) -> None:
    from vsnap.protocol.errors import SpecError
    from vsnap._spec import load_spec
    from vsnap._vllm_check import require_supported_args

    spec_path = tmp_path / "m.yaml"
    spec_path.write_text(f"name: m\nengine: vllm\nmodel: {tiny_llama}\nserve:\n  tensor_parallel_size: 2\n")
    with pytest.raises(SpecError) as info:
        require_supported_args(load_spec(spec_path), str(spec_path))
    assert str(info.value.issues[0]) == f"{spec_path} serve.tensor_parallel_size: snapshots need tensor_parallel_size=1 (one GPU, one rank)"
