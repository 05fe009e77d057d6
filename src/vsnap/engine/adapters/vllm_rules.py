"""Which vLLM configurations vsnap can capture, checked with vLLM's own parser and config.

Two stages, as in vLLM's startup-snapshot reference:

* argument rules, on the parsed serve arguments, before anything starts: one Python HTTP
  frontend, one local rank, no external load balancing or expert parallelism, a local
  executor, logprobs that can be compared, Linux x86_64, spawned workers;
* model rules, on the resolved VllmConfig, before workers are built: a generation model, not
  multimodal (untried), no KV/EC transfer, weights that can be reloaded from safetensors, no CPU
  offload; on CUDA sleep mode on; on vLLM's CPU backend (no CUDA checkpoint, no sleep: weights
  and KV cache stay in the image) a head size its attention supports.

Quantization, mixture of experts, LoRA adapters and speculative decoding are not refused: the
capture's rehearsal (sleep, wake, refill, oracle) decides, and configuration_support says which of
them a GPU record has tested and which are allowed on the rehearsal's word.

The same rules hold for vLLM 0.26.0 and 0.32.0; the names that moved between them come from
vllm_compat.

The engine runs as root and a model.yaml may come from anyone: no serve value may start with
``-``, which vLLM's parser would read as another argument (``--config FILE``, a second ``--model``).

Every refusal is a ``Refusal(argument, reason)``; callers turn them into SpecError (at
validate/capture time) or an engine error (inside the tree). vllm is imported lazily.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Refusal:
    argument: str
    reason: str

    def __str__(self) -> str:
        return f"{self.argument}: {self.reason}"


SINGLE_RANK_SIZES = (
    "tensor_parallel_size",
    "pipeline_parallel_size",
    "data_parallel_size",
    "prefill_context_parallel_size",
    "decode_context_parallel_size",
    "nnodes",
)
LOAD_BALANCING_FLAGS = (
    "data_parallel_external_lb",
    "data_parallel_hybrid_lb",
    "data_parallel_multi_port_external_lb",
    "enable_expert_parallel",
    "enable_elastic_ep",
)
# set by vsnap itself: a spec must not try to
RESERVED = ("model", "model_tag", "host", "port", "enable_sleep_mode", "config")


def value_refusals(argument: str, dest: str, value: Any) -> list[Refusal]:
    """What a spec may not give one serve argument, decided on the value as written (before vLLM's
    parser sees it)."""
    items = value if isinstance(value, list) else [value]
    if any(isinstance(item, str) and item.startswith("-") for item in items):
        return [Refusal(argument, "a value must not start with '-': vLLM's parser would read it as another "
                                  "argument (such as --config FILE or a second --model)")]
    return []


def ensure_platform() -> None:
    """On a host without a GPU, parse with vLLM's CPU platform: argument parsing needs a device
    type, and the argument rules do not depend on it (`vsnap validate` runs anywhere)."""
    import vllm.platforms as platforms

    if not platforms.current_platform.device_type:
        from vllm.platforms.cpu import CpuPlatform

        platforms._current_platform = CpuPlatform()


def on_cuda() -> bool:
    """Does this vLLM run on a CUDA GPU here (else on its CPU backend)?"""
    ensure_platform()
    from vllm.platforms import current_platform

    return bool(current_platform.is_cuda())


def make_parser() -> argparse.ArgumentParser:
    ensure_platform()  # before vLLM modules bind current_platform at import
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from . import vllm_compat

    return vllm_compat.get("make_arg_parser")(FlexibleArgumentParser(prog="vsnap"))


def serve_argv(parser: argparse.ArgumentParser, serve: dict[str, Any]) -> tuple[list[str], list[Refusal]]:
    """Turn the spec's ``serve:`` mapping into vLLM command-line arguments."""
    actions = {action.dest: action for action in parser._actions}
    argv: list[str] = []
    refusals: list[Refusal] = []
    for key, value in serve.items():
        dest = key.replace("-", "_")
        if dest in RESERVED:
            refusals.append(Refusal(f"serve.{key}", "is set by vsnap (model:, restore --host/--port, sleep mode)"))
            continue
        action = actions.get(dest)
        if action is None or not action.option_strings:
            refusals.append(Refusal(f"serve.{key}", "is not a vLLM serve argument"))
            continue
        refused = value_refusals(f"serve.{key}", dest, value)
        if refused:
            refusals += refused
            continue
        flag = next((s for s in action.option_strings if s.startswith("--")), action.option_strings[0])
        if isinstance(value, bool):
            if isinstance(action, argparse.BooleanOptionalAction):
                argv.append(flag if value else "--no-" + flag[2:])
            elif action.nargs == 0:
                if value:
                    argv.append(flag)
            else:
                argv += [flag, "true" if value else "false"]
        elif isinstance(value, (dict,)):
            argv += [flag, json.dumps(value)]
        elif isinstance(value, list):
            argv += [flag, *(json.dumps(v) if isinstance(v, (dict, list)) else str(v) for v in value)]
        elif value is None:
            continue
        else:
            argv += [flag, str(value)]
    return argv, refusals


# vLLM's CPU backend: the KV cache is ordinary memory, written at boot, so it is all in the
# image. Unless the spec sets kv_cache_memory_bytes (or VLLM_CPU_KVCACHE_SPACE), vsnap sets this
# (vLLM's own default takes 92 % of the machine's memory).
CPU_KV_CACHE_BYTES = 256 << 20


def parse_serve_args(model: str, serve: dict[str, Any], *, cuda: bool = True,
                     environ: dict[str, str] | None = None) -> tuple[argparse.Namespace | None, list[Refusal]]:
    """Parse with vLLM's own parser; a parse error becomes a refusal naming the argument.

    On CUDA sleep mode is turned on (vsnap sleeps the engine before the checkpoint); on the CPU
    backend, where vLLM refuses sleep mode, it stays off and the KV cache gets a small default."""
    parser = make_parser()
    argv, refusals = serve_argv(parser, serve)
    if refusals:
        return None, refusals

    class _Raise(Exception):
        pass

    def error(message: str) -> None:
        raise _Raise(message)

    parser.error = error  # type: ignore[method-assign]
    try:
        args = parser.parse_args(["--model", model, *argv])
    except _Raise as exc:
        return None, [Refusal("serve", f"vLLM refuses the arguments: {exc}")]
    except SystemExit:
        return None, [Refusal("serve", "vLLM refuses the arguments")]
    args.enable_sleep_mode = cuda
    env = os.environ if environ is None else environ
    # an empty VLLM_CPU_KVCACHE_SPACE is ignored by vLLM, so it does not count as set
    if not cuda and getattr(args, "kv_cache_memory_bytes", None) is None and not env.get("VLLM_CPU_KVCACHE_SPACE"):
        args.kv_cache_memory_bytes = CPU_KV_CACHE_BYTES
    return args, []


def argument_refusals(args: argparse.Namespace, environ: dict[str, str] | None = None) -> list[Refusal]:
    """The reference's dispatch rules on parsed serve arguments."""
    env = os.environ if environ is None else environ
    refusals: list[Refusal] = []

    def refuse(argument: str, reason: str) -> None:
        refusals.append(Refusal(argument, reason))

    if getattr(args, "headless", False):
        refuse("headless", "snapshots need the one Python HTTP frontend")
    if getattr(args, "grpc", False):
        refuse("grpc", "snapshots need the one Python HTTP frontend")
    if getattr(args, "api_server_count", None) not in (None, 1):
        refuse("api_server_count", "snapshots need exactly one API server process")
    if getattr(args, "uds", None):
        refuse("uds", "snapshots serve on host:port given at restore")
    for name in ("VLLM_USE_RUST_FRONTEND", "VLLM_USE_RUST_BENCH"):  # 0.32 starts it on either
        if env.get(name, "0") not in ("", "0"):
            refuse(name, "snapshots need the Python HTTP frontend")
    for name in SINGLE_RANK_SIZES:
        if getattr(args, name, 1) not in (None, 1):
            refuse(name, f"snapshots need {name}=1 (one GPU, one rank)")
    if getattr(args, "data_parallel_size_local", None) not in (None, 1):
        refuse("data_parallel_size_local", "snapshots need local single-rank execution")
    if getattr(args, "node_rank", 0) not in (None, 0):
        refuse("node_rank", "snapshots need local single-rank execution")
    if getattr(args, "data_parallel_backend", "mp") not in (None, "mp"):
        refuse("data_parallel_backend", "snapshots need the mp backend")
    for name in LOAD_BALANCING_FLAGS:
        if getattr(args, name, None):
            refuse(name, "snapshots need local single-rank execution")
    for name in ("data_parallel_rank", "data_parallel_start_rank"):
        if getattr(args, name, None) is not None:
            refuse(name, "snapshots need local single-rank execution")
    if getattr(args, "distributed_executor_backend", None) not in (None, "mp", "uni"):
        refuse("distributed_executor_backend", "snapshots need a local executor (mp or uni)")
    if getattr(args, "trust_remote_code", False):
        refuse("trust_remote_code", "vsnap runs the engine as root: the model's own Python code would run as root "
                                    "(use a model vLLM supports natively)")
    if getattr(args, "logprobs_mode", None) in ("raw_logits", "processed_logits"):
        refuse("logprobs_mode", "the oracle compares log probabilities, not logits")
    if platform.system() != "Linux" or platform.machine() != "x86_64":
        refuse("platform", f"snapshots need Linux x86_64, not {platform.system()} {platform.machine()}")
    if env.get("VLLM_WORKER_MULTIPROC_METHOD", "spawn") != "spawn":
        refuse("VLLM_WORKER_MULTIPROC_METHOD", "snapshots need spawned workers")
    return refusals


def config_refusals(config: Any, *, is_cuda: bool) -> list[Refusal]:
    """The reference's model rules on a resolved VllmConfig."""
    refusals: list[Refusal] = []

    def refuse(argument: str, reason: str) -> None:
        refusals.append(Refusal(argument, reason))

    model = config.model_config
    parallel = config.parallel_config
    if not is_cuda:
        head_size = model.get_head_size()
        supported = cpu_head_sizes()
        if supported is not None and head_size not in supported:
            refuse("model", f"head size {head_size} is not one vLLM's CPU attention supports "
                            f"({', '.join(map(str, supported))})")
    if model.runner_type != "generate":
        refuse("runner", f"snapshots need a generation model, not {model.runner_type!r}")
    if model.is_multimodal_model:
        refuse("model", "multimodal models are not supported yet (not tried: no multimodal test model)")
    if (parallel.world_size != 1 or parallel.data_parallel_size != 1 or parallel.data_parallel_size_local != 1
            or parallel.data_parallel_rank != 0 or parallel.nnodes != 1 or parallel.node_rank != 0
            or parallel.data_parallel_backend != "mp" or parallel._api_process_count != 1
            or parallel.distributed_executor_backend not in ("uni", "mp")):
        refuse("parallel", "snapshots need local single-rank execution")
    for name in ("kv_transfer_config", "ec_transfer_config"):
        if getattr(config, name, None) is not None:
            refuse(name, "KV/EC transfer connects the engine to other processes or hosts, which a snapshot cannot carry")
    if config.load_config.load_format not in ("auto", "safetensors"):
        refuse("load_format", "weights are reloaded from safetensors after restore: use auto or safetensors")
    offload = config.offload_config
    if offload.uva.cpu_offload_gb:
        refuse("cpu_offload_gb", "CPU offload is not supported")
    if offload.prefetch.offload_group_size:
        refuse("offload_group_size", "CPU offload is not supported")
    if is_cuda and not model.enable_sleep_mode:
        refuse("enable_sleep_mode", "snapshots need sleep mode")
    return refusals


# What the GPU records in docs/benchmarks/ show captured and restored with a bit-identical oracle and
# outputs equal to a cold start (vLLM 0.26.0, H200); see docs/model-yaml.md.
TESTED_QUANTIZATION = ("fp8",)
TESTED_SPECULATION = ("ngram",)


def configuration_support(config: Any) -> list[tuple[str, str]]:
    """What a resolved VllmConfig uses beyond a dense bf16 model, each with "tested" (a committed
    GPU record covers it) or "on trust" (allowed because the capture's rehearsal (sleep, wake,
    reload, oracle) must pass before an image is published)."""
    model = config.model_config
    found: list[tuple[str, str]] = []
    if model.quantization is not None:
        found.append((f"quantization {model.quantization}",
                      "tested" if model.quantization in TESTED_QUANTIZATION else "on trust"))
    if model.is_moe:
        architecture = (getattr(model, "architectures", None) or ["?"])[0]
        found.append((f"mixture of experts ({architecture})",
                      "tested" if architecture == "MixtralForCausalLM" else "on trust"))
    if getattr(config, "lora_config", None) is not None:
        found.append(("LoRA adapters", "tested"))
    speculative = getattr(config, "speculative_config", None)
    if speculative is not None:
        method = str(getattr(speculative, "method", "?"))
        found.append((f"speculative decoding ({method})", "tested" if method in TESTED_SPECULATION else "on trust"))
    if model.is_hybrid:
        found.append(("hybrid attention + state-space model", "on trust"))
    return found


def cpu_head_sizes() -> list[int] | None:
    """The head sizes vLLM's CPU attention backend takes (a list, not a lower bound), or None."""
    try:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    except ImportError:
        return None
    return sorted(CPUAttentionBackend.get_supported_head_sizes())


def resolve_config(args: argparse.Namespace) -> Any:
    """vLLM's own VllmConfig for parsed serve arguments (reads the model's config, loads nothing)."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.usage.usage_lib import UsageContext

    return AsyncEngineArgs.from_cli_args(args).create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)
