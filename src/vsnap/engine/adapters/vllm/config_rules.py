"""The model rules: which resolved vLLM configurations vsnap can capture (the second of the two
stages rules describes), on vLLM's own VllmConfig before workers are built: a generation model,
not multimodal (untried), no KV/EC transfer, weights that can be reloaded from safetensors, no
CPU offload; on CUDA sleep mode on, through vLLM's cumem allocator as vLLM sleeps by default; on
vLLM's CPU backend (no CUDA checkpoint, no sleep: weights and KV cache stay in the image) a head
size its attention supports; tensor parallelism alone, with the settings the argument rules gave
it still in force.

Quantization, mixture of experts, LoRA adapters and speculative decoding are not refused: the
capture's rehearsal (sleep, wake, refill, oracle) decides, and configuration_support says which of
them a GPU record has tested and which are allowed on the rehearsal's word.

Every refusal is a rules.Refusal; vllm is imported lazily.
"""

from __future__ import annotations

import argparse
from typing import Any

from .rules import (
    LOAD_BALANCING_FLAGS,
    LOCAL,
    SINGLE_RANK_SIZES,
    SLEEP_SETTINGS,
    TENSOR_PARALLEL_SIZES,
    TP_ARGUMENTS,
    TP_PASS_CONFIG,
    Refusal,
)


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
    tp = parallel.tensor_parallel_size
    if (parallel.data_parallel_size != 1 or parallel.data_parallel_size_local != 1
            or parallel.data_parallel_rank != 0 or parallel.nnodes != 1 or parallel.node_rank != 0
            or parallel.data_parallel_backend != "mp" or parallel._api_process_count != 1
            or parallel.distributed_executor_backend not in ("uni", "mp")):
        refuse("parallel", LOCAL)
    elif tp == 1 and parallel.world_size != 1:
        refuse("parallel", LOCAL)
    elif tp > 1:
        refusals += _tensor_parallel_config_refusals(config, is_cuda=is_cuda)
    for name in ("kv_transfer_config", "ec_transfer_config"):
        if getattr(config, name, None) is not None:
            refuse(name, "KV/EC transfer connects the engine to other processes or hosts, which a snapshot cannot carry")
    speculative = getattr(config, "speculative_config", None)
    method = str(getattr(speculative, "method", "")) if speculative is not None else ""
    if speculative is not None and method not in MODEL_FREE_SPECULATION:
        refuse("speculative_config", f"speculative decoding with a draft model ({method}) is not supported yet: vLLM "
                                     "rebuilds some drafters' buffers at wake before vsnap refills their weights, its own "
                                     "reload skips the drafter, and the oracle cannot tell (a broken drafter changes "
                                     "speed, not greedy outputs); ngram and suffix decoding work")
    if config.load_config.load_format not in ("auto", "safetensors"):
        refuse("load_format", "weights are reloaded from safetensors after restore: use auto or safetensors")
    offload = config.offload_config
    if offload.uva.cpu_offload_gb:
        refuse("cpu_offload_gb", "CPU offload is not supported")
    if offload.prefetch.offload_group_size:
        refuse("offload_group_size", "CPU offload is not supported")
    if is_cuda and not model.enable_sleep_mode:
        refuse("enable_sleep_mode", "snapshots need sleep mode")
    elif is_cuda:
        refusals += sleep_refusals(model)
    return refusals


def sleep_refusals(model: Any) -> list[Refusal]:
    """How the resolved ModelConfig sleeps, against SLEEP_SETTINGS (backing up argument_refusals:
    a default vLLM or a plugin set may differ). A field this vLLM does not have (0.26 has only
    sleep_mode_backend) reads as its default."""
    return [Refusal(name, reason) for name, (default, reason) in SLEEP_SETTINGS.items()
            if getattr(model, name, default) not in (None, default)]


def _tensor_parallel_config_refusals(config: Any, *, is_cuda: bool) -> list[Refusal]:
    """The resolved configuration of a tensor-parallel engine: TP=2 alone (world size 2, the mp
    executor, on CUDA) with the settings vsnap gave the arguments still in force after vLLM's
    defaults (backing up argument_refusals and tensor_parallel_settings)."""
    parallel = config.parallel_config
    tp = parallel.tensor_parallel_size
    refusals: list[Refusal] = []
    if not is_cuda:
        refusals.append(Refusal("tensor_parallel_size", "tensor parallelism on vLLM's CPU backend is not supported (set "
                                                        "tensor_parallel_size: 1 on a host without a GPU)"))
    if tp not in TENSOR_PARALLEL_SIZES or parallel.world_size != tp:
        refusals.append(Refusal("parallel", f"snapshots need tensor parallelism alone over {tp} local GPUs (world "
                                            f"size {parallel.world_size})"))
    if parallel.distributed_executor_backend != "mp":
        refusals.append(Refusal("distributed_executor_backend", "tensor parallelism needs the mp executor"))
    for name in ("pipeline_parallel_size", "decode_context_parallel_size", "prefill_context_parallel_size"):
        if getattr(parallel, name, 1) not in (None, 1):
            refusals.append(Refusal(name, SINGLE_RANK_SIZES[name]))
    for name in ("enable_expert_parallel", "enable_eplb", "enable_elastic_ep"):
        if getattr(parallel, name, False):
            refusals.append(Refusal(name, LOAD_BALANCING_FLAGS[name]))
    if getattr(parallel, "enable_dbo", False) or (getattr(parallel, "ubatch_size", 0) or 0) > 1:
        refusals.append(Refusal("enable_dbo", "dual-batch overlap is not supported with tensor parallelism"))
    for name, (value, why) in TP_ARGUMENTS.items():
        if getattr(parallel, name, value) != value:
            refusals.append(Refusal(name, f"must be {str(value).lower()} with tensor parallelism: {why}"))
    passes = getattr(getattr(config, "compilation_config", None), "pass_config", None)
    for name, (value, why) in TP_PASS_CONFIG.items():
        if bool(getattr(passes, name, value)) != value:
            refusals.append(Refusal(f"compilation_config.pass_config.{name}",
                                    f"must be {str(value).lower()} with tensor parallelism: {why}"))
    if getattr(config, "weight_transfer_config", None) is not None:
        refusals.append(Refusal("weight_transfer_config", "weight transfer keeps a live NCCL communicator to an "
                                                          "external trainer, which a snapshot cannot carry"))
    return refusals


# What the GPU records in docs/benchmarks/ show captured and restored with a bit-identical oracle and
# outputs equal to a cold start (vLLM 0.26.0, H200; and compressed-tensors FP8 per channel: the
# 70B-class record, vLLM 0.26.0, H100, and the families on 0.33.0); see docs/model-yaml.md.
TESTED_QUANTIZATION = ("fp8",)
FP8_PER_CHANNEL = "compressed-tensors (FP8 weights per channel)"
TESTED_SPECULATION = ("ngram",)
# speculative methods that need no draft model (no weights of their own to bring back)
MODEL_FREE_SPECULATION = ("ngram", "ngram_gpu", "suffix")


def configuration_support(config: Any) -> list[tuple[str, str]]:
    """What a resolved VllmConfig uses beyond a dense bf16 model, each with "tested" (a committed
    GPU record covers it) or "on trust" (allowed because the capture's rehearsal (sleep, wake,
    reload, oracle) must pass before an image is published)."""
    model = config.model_config
    found: list[tuple[str, str]] = []
    if model.quantization == "compressed-tensors" and fp8_per_channel(model):
        found.append((f"quantization {FP8_PER_CHANNEL}", "tested"))
    elif model.quantization is not None:
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
    tp = getattr(getattr(config, "parallel_config", None), "tensor_parallel_size", 1) or 1
    if tp > 1:  # no GPU record yet (docs/design/tensor-parallel-2.md 8)
        found.append((f"tensor parallelism over {tp} GPUs (NCCL and CUDA graphs rebuilt at every restore)", "on trust"))
    return found


def fp8_per_channel(model: Any) -> bool:
    """Whether the model's compressed-tensors config is the scheme the GPU records ran: every group's
    weights 8-bit floats with one scale per output channel, its input activations dynamic 8-bit
    floats (or none), no output activations, no KV-cache scheme. Any other compressed-tensors
    scheme (int4, blocks, static activations, ...) stays "on trust"."""
    quant = getattr(getattr(model, "hf_config", None), "quantization_config", None)
    groups = quant.get("config_groups") if isinstance(quant, dict) else None
    if not isinstance(groups, dict) or not groups or quant.get("kv_cache_scheme") is not None:
        return False

    def fp8(scheme: Any, **more: Any) -> bool:
        return (isinstance(scheme, dict) and scheme.get("num_bits") == 8 and scheme.get("type") == "float"
                and all(scheme.get(k) == v for k, v in more.items()))

    return all(isinstance(group, dict) and fp8(group.get("weights"), strategy="channel")
               and (group.get("input_activations") is None or fp8(group.get("input_activations"), dynamic=True))
               and group.get("output_activations") is None
               for group in groups.values())


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
