"""Which vLLM configurations vsnap can capture, checked with vLLM's own parser and config.

Two stages, as in vLLM's startup-snapshot reference:

* argument rules (this module), on the parsed serve arguments, before anything starts: one
  Python HTTP frontend, one local rank or tensor parallelism over 2 local GPUs (mp executor,
  CUDA, the settings of TP_SETTINGS), no external load balancing or expert parallelism, a local
  executor, logprobs that can be compared, Linux x86_64, spawned workers;
* model rules (config_rules), on the resolved VllmConfig, before workers are built: a generation
  model, not multimodal (untried), no KV/EC transfer, weights that can be reloaded from
  safetensors, no CPU offload; on CUDA sleep mode on; on vLLM's CPU backend (no CUDA checkpoint,
  no sleep: weights and KV cache stay in the image) a head size its attention supports.

The same rules hold for vLLM 0.26.0, 0.32.0 and 0.33.0; the names that moved between them come
from compat.

The engine runs as root and a model.yaml may come from anyone, so serve arguments through which
the spec would choose code for the engine to run, or a path for it to write, are refused by name
before vLLM's parser sees them (parsing some of them already imports what they name:
``compilation_config.inductor_passes``); no value may start with ``-`` (it would be read as another
argument: ``--config FILE``, a second ``--model``). The files and directories the engine reads
(tokenizer, chat template, draft model, adapters, TLS files...) must be given as absolute paths
(``paths_read``); that they are root's alone is checked on the filesystem by the orchestrator
(vsnap.spec.vllm_check), which the engine side may not import.

Every refusal is a ``Refusal(argument, reason)``; callers turn them into SpecError (at
validate/capture time) or an engine error (inside the tree). vllm is imported lazily.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import re
from dataclasses import dataclass
from typing import Any

from .serve_args import given as _given


@dataclass(frozen=True)
class Refusal:
    argument: str
    reason: str

    def __str__(self) -> str:
        return f"{self.argument}: {self.reason}"


# Sizes that must stay 1, each with why and what to do instead (tensor_parallel_size: TP rules below).
SINGLE_RANK_SIZES: dict[str, str] = {
    "pipeline_parallel_size": "pipeline parallelism sends tensors between stages over torch's NCCL process groups, "
                              "which cannot be rebuilt after a restore (set it to 1; tensor_parallel_size: 2 splits "
                              "a model over two GPUs)",
    "data_parallel_size": "data parallelism runs several engine cores and a coordinator with their own NCCL groups, "
                          "which a snapshot cannot carry (set it to 1; restore one image per GPU instead)",
    "prefill_context_parallel_size": "context parallelism adds groups and a torch NCCL all-to-all that cannot be "
                                     "rebuilt after a restore (set it to 1)",
    "decode_context_parallel_size": "context parallelism adds groups and a torch NCCL all-to-all that cannot be "
                                    "rebuilt after a restore (set it to 1)",
    "nnodes": "a snapshot covers the process tree of one host: several nodes cannot be frozen together (set it to 1)",
}
LOCAL = "snapshots need local single-rank execution"
EXPERT = ("expert parallelism uses all-to-all buffers in peer or NVSHMEM memory, which a CUDA checkpoint cannot "
          "carry (leave it off: the experts are then split by tensor parallelism)")
# How vLLM sleeps: vsnap sleeps the engine before the checkpoint and wakes it after every restore
# through vLLM's cumem allocator (the weights and KV cache tags, vsnap's weights file and its CUDA
# graph pool in that allocator). Settings that change it (0.32 and 0.33 added them; 0.26 only
# has the backend, without a flag) must keep their defaults: name -> (the default, why).
SLEEP_SETTINGS: dict[str, tuple[Any, str]] = {
    "sleep_mode_backend": ("cumem", "vsnap sleeps and wakes the engine through vLLM's cumem allocator (its weights "
                                    "and KV cache tags, vsnap's weights file and graph pool); another backend is "
                                    "untried (leave it cumem)"),
    "sleep_mode_offload_cudagraph": (False, "vsnap keeps the CUDA graphs in its own pool of the sleep allocator; "
                                            "vLLM's copy of graph memory to host memory during sleep is untried with "
                                            "it (leave it off)"),
    "enable_nccl_comm_suspend": (False, "vsnap destroys and rebuilds the NCCL communicators around the checkpoint "
                                        "itself; suspending them in sleep is untried with that (leave it off)"),
}
LOAD_BALANCING_FLAGS: dict[str, str] = {
    "data_parallel_external_lb": LOCAL,
    "data_parallel_hybrid_lb": LOCAL,
    "data_parallel_multi_port_external_lb": LOCAL,
    "enable_expert_parallel": EXPERT,
    "enable_eplb": "expert load balancing keeps its own NCCL communicator, which a snapshot cannot carry (leave it "
                   "off)",
    "enable_elastic_ep": "elastic expert parallelism needs Ray and rebuilds groups vsnap does not (leave it off)",
}

# Tensor parallelism: the sizes a GPU record has covered (TP>2 waits for one: the reduction order
# and NCCL's tuning must be pinned for a bit-identical oracle).
TENSOR_PARALLEL_SIZES = (1, 2)
# What vsnap sets on the parsed arguments when tensor_parallel_size > 1, and refuses a spec that
# sets otherwise (docs/design/tensor-parallel-2.md 4.1): each keeps IPC or multicast memory, which
# CUDA graphs capture by address and a CUDA checkpoint cannot carry, out of the engine.
TP_ARGUMENTS: dict[str, tuple[Any, str]] = {
    "disable_custom_all_reduce": (True, "vLLM's custom all-reduce maps the other GPU's memory through CUDA IPC and "
                                        "bakes those addresses into CUDA graphs"),
}
TP_PASS_CONFIG: dict[str, tuple[Any, str]] = {
    "fuse_allreduce_rms": (False, "the FlashInfer all-reduce + RMSNorm fusion keeps an IPC/multicast workspace and "
                                  "a torch NCCL group"),
    "enable_sp": (False, "sequence parallelism uses torch symmetric memory"),
    "fuse_gemm_comms": (False, "GEMM + collective fusion uses torch symmetric memory"),
}
# The environment of a tensor-parallel engine, set by the engine itself before EngineCore and the
# workers start (vllm.py); a one-rank tree keeps the environment it had (the first is part of
# vLLM's compile-cache key).
TP_ENVIRONMENT: dict[str, str] = {
    "VLLM_ALLREDUCE_USE_SYMM_MEM": "0",  # on by default; maps peer memory even when it then disables itself
    "NCCL_NVLS_ENABLE": "0",  # NVLink SHARP multicast objects: a CUDA checkpoint hangs on them
    "NCCL_RAS_ENABLE": "0",  # NCCL's RAS thread keeps TCP connections that outlive the communicators
    "NCCL_CUMEM_ENABLE": "1",  # peer buffers through cuMem, not legacy IPC (which enables peer access for good)
}
# Environment refused with tensor parallelism: (name, the values that trigger it, why).
TP_REFUSED_ENVIRONMENT: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("VLLM_USE_NCCL_SYMM_MEM", ("1", "true"), "NCCL symmetric memory is registered peer memory, and its custom op "
                                              "keeps the old communicator"),
    ("VLLM_ALLREDUCE_USE_FLASHINFER", ("1", "true"), "FlashInfer's all-reduce keeps an IPC workspace"),
    ("VLLM_DISABLE_PYNCCL", ("1", "true"), "it moves the collectives onto torch's NCCL process groups, which "
                                           "cannot be rebuilt after a restore"),
    ("VLLM_DISTRIBUTED_USE_SPLIT_GROUP", ("1", "true"), "it initialises torch's NCCL communicators at boot, which "
                                                        "cannot be rebuilt after a restore"),
    ("VLLM_ENABLE_V1_MULTIPROCESSING", ("0", "false"), "the engine core must run in its own process (the tree "
                                                       "shape vsnap checkpoints)"),
    ("VLLM_USE_BREAKABLE_CUDAGRAPH", ("1", "true"), "breakable CUDA graphs are not tried with tensor parallelism"),
)
# Opt-in (in the environment of `vsnap capture`): with one rank, run the tensor-parallel path anyway
# (CUDA graphs dropped before the checkpoint and captured again after every restore; the worker's
# disconnect and reconnect steps, which find no communicator), so that one GPU exercises it.
TP1_RECAPTURE_ENV = "VSNAP_TP1_RECAPTURE"


def tensor_parallel_size(serve: dict[str, Any]) -> int:
    """The spec's tensor_parallel_size as vLLM's parser reads it (1 when absent or unreadable: the
    rules refuse what is not 1 or 2 before anything runs)."""
    _, value = _given(serve, "tensor_parallel_size")
    if isinstance(value, bool):
        return 1
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.strip().isdigit():
        return int(value.strip())
    return 1


def recaptures_graphs(tp: int, environ: dict[str, str] | None = None) -> bool:
    """Does this engine drop its CUDA graphs before a checkpoint and capture them again after a
    restore (always with tensor parallelism; with one rank when TP1_RECAPTURE_ENV is 1)?"""
    env = os.environ if environ is None else environ
    return tp > 1 or env.get(TP1_RECAPTURE_ENV, "") == "1"
# set by vsnap itself: a spec must not try to
RESERVED = ("model", "model_tag", "host", "port", "enable_sleep_mode", "config")

# Serve arguments refused whenever the spec gives them a value (an empty one aside), each with why:
# the engine runs as root, so what they name would be imported, read or written as root.
CODE = "code of the spec's choosing would run as root"
TRANSFER = "connects the engine to other processes or hosts, which a snapshot cannot carry"
REFUSED_ARGUMENTS: dict[str, str] = {
    "tool_parser_plugin": f"vLLM imports this Python file or module: {CODE}",
    "reasoning_parser_plugin": f"vLLM imports this Python file or module: {CODE}",
    "middleware": f"vLLM imports these objects by name into the HTTP server: {CODE}",
    "logits_processors": f"vLLM imports these classes by name: {CODE}",
    "scheduler_cls": f"vLLM imports this class by name: {CODE}",
    "model_class_overrides": f"vLLM imports these model classes by name: {CODE}",
    "io_processor_plugin": f"vLLM loads this plugin (for pooling models, which snapshots do not serve): {CODE}",
    "log_config_file": "a logging configuration can build any Python object by name and open any file for writing, "
                       "as root",
    "download_dir": "vLLM would download and write files into this directory as root; the model comes from model:",
    "allowed_local_media_path": "every HTTP client could make the root engine read files below this directory "
                                "(and multimodal models are not supported)",
    "mm_encoder_fp8_scale_path": "multimodal models are not supported (the root engine would read this file)",
    "mm_encoder_fp8_scale_save_path": "multimodal models are not supported (the root engine would write this file)",
    "default_mm_loras": "multimodal models are not supported (the root engine would load adapters from these paths)",
    "tool_server": "connects the engine to tool servers, or (demo) runs model-written Python: a snapshot cannot "
                   f"carry the connections, and {CODE}",
    "otlp_traces_endpoint": "the engine would send its traces to this collector; a snapshot cannot carry the "
                            "exporter's connection",
    "profiler_config": "the profiler writes its traces into a directory the spec names, as root",
    "kv_transfer_config": f"KV transfer {TRANSFER}, and its connector module is imported by name",
    "ec_transfer_config": f"EC transfer {TRANSFER}, and its connector module is imported by name",
    "kv_events_config": "KV cache events are published on a socket, which a snapshot cannot carry",
}
# Fields of the JSON-valued arguments refused in the same way (keys with "-" count as with "_").
REFUSED_FIELDS: dict[tuple[str, str], str] = {
    ("compilation_config", "inductor_passes"): f"vLLM imports these functions by name while it parses: {CODE}",
    ("compilation_config", "cache_dir"): "compiled code would be written into this directory and loaded back from "
                                         "it, as root (vsnap keeps vLLM's compile cache in /var/cache/vsnap/vllm)",
    ("compilation_config", "local_cache_dir"): "compiled code would be written into this directory and loaded back "
                                               "from it, as root",
    ("compilation_config", "debug_dump_path"): "vLLM would write its debug dumps there, as root",
    ("speculative_config", "draft_load_config"): "the draft model is loaded like the model (auto or safetensors, "
                                                 "from its directory): no loader settings of its own",
    ("structured_outputs_config", "reasoning_parser_plugin"): f"vLLM imports this Python file or module: {CODE}",
    ("logging_config", "pylogging_config_file"): "a logging configuration can build any Python object by name and "
                                                 "open any file for writing, as root",
    ("ec_manager_config", "encoder_cache_manager_cls"): f"vLLM imports this class by name: {CODE}",
    ("watchdog_config", "dump_dir"): "vLLM's watchdog would write its stack dumps into this directory, as root",  # 0.33
}
# Names that, on an argument or a field nobody has classified above (a vLLM newer than the ones
# read: 0.26.0, 0.32.0, 0.33.0), say it names a file, a directory, a module or a class: refused until it is.
SUSPECT_NAME = re.compile(r"(^|_)(cls|class|path|paths|dir|dirs|file|files|module|plugin|plugins|passes|"
                          r"endpoint|url|uri)$")
# checked below (paths_read, worker_extension_cls), or harmless (root_path: the URL prefix behind a proxy)
NOT_SUSPECT = ("worker_extension_cls", "hf_config_path", "root_path")
SUSPECT = "names a file, a directory, a module or a class, which vsnap has not been taught to check"
QUALNAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)+")
# vsnap's own extension (weights.extension.EXTENSION), set by the engine when the spec sets none
VSNAP_WORKER_EXTENSION = "vsnap.engine.adapters.vllm.weights.extension.WeightsFileExtension"
# where earlier vsnap versions kept it: a spec that spells one out is told the name to use now
FORMER_WORKER_EXTENSIONS = ("vsnap.engine.adapters.vllm_weights.WeightsFileExtension",
                            "vsnap.engine.adapters.vllm.weights.WeightsFileExtension")


def _unset(value: Any) -> bool:
    return value is None or value is False or value in ("", [], {})


def _suspect(name: str, value: Any) -> bool:
    """A name that says "a file, a module, a class" given a value that could be one (not a flag)."""
    return bool(SUSPECT_NAME.search(name)) and not isinstance(value, bool) and not _unset(value)


def _mapping(value: Any, config: bool) -> tuple[dict[str, Any] | None, str | None]:
    """The mapping a JSON-valued argument holds (given as a mapping, or as a JSON object in a string,
    as vLLM reads it), or why it cannot be read as one. ``config``: vLLM reads it as one of its
    config dataclasses, whose parser also takes what json does not (1k for 1000): such a string
    must be plain JSON, or a mapping."""
    if isinstance(value, dict):
        return value, None
    if not isinstance(value, str) or not value.lstrip().startswith("{"):
        return None, None

    twice: list[str] = []

    def pairs_hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        keys = [key for key, _ in pairs]
        twice.extend(key for key in set(keys) if keys.count(key) > 1)
        return dict(pairs)

    try:
        mapping = json.loads(value, object_pairs_hook=pairs_hook)
    except ValueError as exc:  # a config dataclass may still read it: not unchecked; anything else: vLLM's error
        return None, (f"is not a JSON object vsnap can check ({exc}): give it as a mapping" if config else None)
    except RecursionError:
        return None, "is JSON nested too deeply to check: give it as a flat mapping"
    if twice:  # which one counts is the parser's choice: give each once
        return None, f"is a JSON object that gives {', '.join(sorted(twice))} twice"
    return mapping, None


def _field_refusals(argument: str, dest: str, mapping: dict[str, Any], top: bool = True) -> list[Refusal]:
    """The fields of one JSON-valued argument (``top``) or of a mapping nested in it."""
    refusals: list[Refusal] = []
    for key, value in mapping.items():
        name = str(key).replace("-", "_")
        where = f"{argument}.{key}"
        reason = REFUSED_FIELDS.get((dest, name)) if top else None
        if reason is not None and not _unset(value):
            refusals.append(Refusal(where, reason))
        elif name == "trust_remote_code" and value:
            refusals.append(Refusal(where, "vsnap runs the engine as root: the model's own Python code would run "
                                           "as root"))
        elif top and dest == "compilation_config" and name == "backend" and "." in str(value):
            refusals.append(Refusal(where, f"a backend given by its qualified name is imported: {CODE} (name a "
                                           "registered backend: inductor, eager)"))
        elif top and dest == "compilation_config" and name == "inductor_compile_config" and isinstance(value, dict):
            refusals += [Refusal(f"{where}.{option}", "only true/false and numbers: a string or a list here can "
                                                      "name a compiler, a kernel directory or an output path")
                         for option, setting in value.items() if not isinstance(setting, (bool, int, float))]
        elif top and dest == "speculative_config" and name == "method" and value == "custom_class":
            refusals.append(Refusal(where, f"a custom proposer class is imported by name: {CODE}"))
        elif _suspect(name, value) and (dest, name) not in REFUSED_FIELDS:
            refusals.append(Refusal(where, SUSPECT))
        elif isinstance(value, dict):
            refusals += _field_refusals(where, dest, value, top=False)
        elif isinstance(value, list):
            for item in value:
                if isinstance(item, dict):
                    refusals += _field_refusals(where, dest, item, top=False)
    return refusals


def value_refusals(argument: str, dest: str, value: Any, config: bool = False) -> list[Refusal]:
    """What a spec may not give one serve argument, decided on the value as written (before vLLM's
    parser sees it: parsing some arguments already imports what they name). ``config``: vLLM parses
    the argument into one of its config dataclasses."""
    items = value if isinstance(value, list) else [value]
    if any(isinstance(item, str) and item.startswith("-") for item in items):
        return [Refusal(argument, "a value must not start with '-': vLLM's parser would read it as another "
                                  "argument (such as --config FILE or a second --model)")]
    if dest in REFUSED_ARGUMENTS:
        return [] if _unset(value) else [Refusal(argument, REFUSED_ARGUMENTS[dest])]
    if dest == "worker_cls":
        return [] if value in (None, "", "auto") else [
            Refusal(argument, f"vLLM imports this worker class by name: {CODE} (vsnap needs vLLM's own worker: auto)")]
    if dest == "worker_extension_cls":
        if _unset(value) or value == VSNAP_WORKER_EXTENSION:
            return []
        if value in FORMER_WORKER_EXTENSIONS:
            return [Refusal(argument, f"vsnap's worker extension is now {VSNAP_WORKER_EXTENSION} (the package's "
                                      "rooms, session 12): remove worker_extension_cls (vsnap sets it) or use that name")]
        if not isinstance(value, str) or not QUALNAME.fullmatch(value) or "__main__" in value.split("."):
            return [Refusal(argument, "must be package.module.Class, the qualified name of a class in a module "
                                      "installed in root's site-packages")]
        return []  # where it resolves, spec.vllm_check decides (root's own site-packages only)
    if dest == "spec_method" and value == "custom_class":
        return [Refusal(argument, f"a custom proposer class is imported by name: {CODE}")]
    if _suspect(dest, value) and dest not in NOT_SUSPECT:
        return [Refusal(argument, SUSPECT)]
    mapping, problem = _mapping(value, config)
    if problem:
        return [Refusal(argument, problem)]
    return _field_refusals(argument, dest, mapping) if mapping else []


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

    from . import compat as vllm_compat

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
        refused = value_refusals(f"serve.{key}", dest, value, getattr(action.type, "__name__", "") == "parse_dataclass")
        if refused:
            refusals += refused
            continue
        if isinstance(value, list) and action.nargs is None and not isinstance(action, argparse._AppendAction):
            # `--flag a b` would give vLLM a and make b a positional argument (the model tag)
            refusals.append(Refusal(f"serve.{key}", "takes one value, not a list"))
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
    refusals = tensor_parallel_settings(args, serve, cuda=cuda)
    if refusals:
        return None, refusals
    env = os.environ if environ is None else environ
    # an empty VLLM_CPU_KVCACHE_SPACE is ignored by vLLM, so it does not count as set
    if not cuda and getattr(args, "kv_cache_memory_bytes", None) is None and not env.get("VLLM_CPU_KVCACHE_SPACE"):
        args.kv_cache_memory_bytes = CPU_KV_CACHE_BYTES
    return args, []


def tensor_parallel_settings(args: argparse.Namespace, serve: dict[str, Any], *, cuda: bool) -> list[Refusal]:
    """With tensor_parallel_size > 1: refuse what the spec sets against TP_ARGUMENTS and
    TP_PASS_CONFIG, then set them (and the mp executor) on ``args``. Nothing changes with one rank."""
    tp = getattr(args, "tensor_parallel_size", 1) or 1
    if tp <= 1:
        return []
    if not cuda:
        return [Refusal("tensor_parallel_size", "tensor parallelism on vLLM's CPU backend uses its shared-memory "
                                                "communicator, which vsnap does not rebuild (set tensor_parallel_size: "
                                                "1 on a host without a GPU)")]
    refusals = []
    for name, (value, why) in TP_ARGUMENTS.items():
        given, wrote = _given(serve, name)
        if given and wrote != value:
            refusals.append(Refusal(f"serve.{name}", f"must be {str(value).lower()} with tensor parallelism, which "
                                                     f"vsnap sets: {why} (remove it)"))
    compilation = getattr(args, "compilation_config", None)
    passes = getattr(compilation, "pass_config", None)
    for name, (value, why) in TP_PASS_CONFIG.items():
        wrote = getattr(passes, name, None)
        if wrote is not None and wrote != value:
            refusals.append(Refusal(f"serve.compilation_config.pass_config.{name}",
                                    f"must be {str(value).lower()} with tensor parallelism, which vsnap sets: {why} "
                                    "(remove it)"))
    if refusals:
        return refusals
    for name, (value, _) in TP_ARGUMENTS.items():
        setattr(args, name, value)
    if passes is not None:
        compilation = copy.deepcopy(compilation)  # the parser's default object is shared between parses
        for name, (value, _) in TP_PASS_CONFIG.items():
            if hasattr(compilation.pass_config, name):  # vLLM 0.32 moved enable_sp and fuse_gemm_comms
                setattr(compilation.pass_config, name, value)
        args.compilation_config = compilation
    if getattr(args, "distributed_executor_backend", None) is None:
        args.distributed_executor_backend = "mp"  # vLLM would choose Ray if a Ray placement group were active
    return []


def argument_refusals(args: argparse.Namespace, environ: dict[str, str] | None = None) -> list[Refusal]:
    """The reference's dispatch rules on parsed serve arguments."""
    env = os.environ if environ is None else environ
    refusals: list[Refusal] = []

    def refuse(argument: str, reason: str) -> None:
        refusals.append(Refusal(argument, reason))

    if getattr(args, "headless", False):
        refuse("headless", "snapshots need the one Python HTTP frontend on the host that holds the GPUs (remove "
                           "headless)")
    if getattr(args, "grpc", False):
        refuse("grpc", "snapshots need the one Python HTTP frontend")
    if getattr(args, "api_server_count", None) not in (None, 1):
        refuse("api_server_count", "snapshots need exactly one API server process")
    if getattr(args, "uds", None):
        refuse("uds", "snapshots serve on host:port given at restore")
    if getattr(args, "ssl_cert_reqs", 0) not in (None, 0, 1):  # ssl.CERT_NONE, CERT_OPTIONAL
        refuse("ssl_cert_reqs", "the restore asks the server's /health before it reports it serving, and presents "
                                "no client certificate (ssl_cert_reqs must be 0 or 1)")
    for name in ("VLLM_USE_RUST_FRONTEND", "VLLM_USE_RUST_BENCH"):  # 0.32 starts it on either
        if env.get(name, "0") not in ("", "0"):
            refuse(name, "snapshots need the Python HTTP frontend")
    tp = getattr(args, "tensor_parallel_size", 1) or 1
    if tp not in TENSOR_PARALLEL_SIZES:
        refuse("tensor_parallel_size", f"tensor_parallel_size {tp} is not supported until a GPU record exists for it "
                                       "(its reduction order and NCCL tuning must be pinned for a bit-identical "
                                       "oracle): use 1 or 2")
    for name, reason in SINGLE_RANK_SIZES.items():
        if getattr(args, name, 1) not in (None, 1):
            refuse(name, reason)
    if getattr(args, "data_parallel_size_local", None) not in (None, 1):
        refuse("data_parallel_size_local", LOCAL)
    if getattr(args, "node_rank", 0) not in (None, 0):
        refuse("node_rank", "a snapshot covers the process tree of one host (remove node_rank)")
    if getattr(args, "data_parallel_backend", "mp") not in (None, "mp"):
        refuse("data_parallel_backend", "snapshots need the mp backend")
    for name, reason in LOAD_BALANCING_FLAGS.items():
        if getattr(args, name, None):
            refuse(name, reason)
    for name in ("data_parallel_rank", "data_parallel_start_rank"):
        if getattr(args, name, None) is not None:
            refuse(name, LOCAL)
    backend = getattr(args, "distributed_executor_backend", None)
    if backend not in (None, "mp", "uni"):
        refuse("distributed_executor_backend", "snapshots need a local executor (mp or uni)")
    elif tp > 1 and backend not in (None, "mp"):
        refuse("distributed_executor_backend", f"tensor parallelism needs the mp executor (one local process tree), "
                                               f"not {backend} (set it to mp or remove it)")
    if tp > 1:
        refusals += tensor_parallel_refusals(args, env)
    elif recaptures_graphs(tp, env):
        refusals += one_rank_recapture_refusals(args)
    if getattr(args, "trust_remote_code", False):
        refuse("trust_remote_code", "vsnap runs the engine as root: the model's own Python code would run as root "
                                    "(use a model vLLM supports natively)")
    adapters = len(getattr(args, "lora_modules", None) or [])
    cpu_slots = getattr(args, "max_cpu_loras", None) or getattr(args, "max_loras", 1) or 1
    if getattr(args, "enable_lora", False) and adapters > cpu_slots:
        refuse("max_cpu_loras", f"{adapters} LoRA adapters are given at boot but vLLM keeps {cpu_slots} in memory: the "
                                f"others would be read from disk again after every restore (set max_cpu_loras to "
                                f"at least {adapters})")
    for name, (default, reason) in SLEEP_SETTINGS.items():
        if getattr(args, name, default) not in (None, default):
            refuse(name, reason)
    if getattr(args, "logprobs_mode", None) in ("raw_logits", "processed_logits"):
        refuse("logprobs_mode", "the oracle compares log probabilities, not logits")
    if platform.system() != "Linux" or platform.machine() != "x86_64":
        refuse("platform", f"snapshots need Linux x86_64, not {platform.system()} {platform.machine()}")
    if env.get("VLLM_WORKER_MULTIPROC_METHOD", "spawn") != "spawn":
        refuse("VLLM_WORKER_MULTIPROC_METHOD", "snapshots need spawned workers")
    for argument, path in paths_read(args):
        # vLLM reads a relative path from the engine's directory (/), `~` from a home directory, and a
        # name that is no local path from the Hugging Face hub: none is what vsnap would have checked
        if not os.path.isabs(path):
            speculative = argument in ("speculative_config.model", "spec_model")
            hint = SPECULATIVE_HINT if speculative and QUALNAME.fullmatch(path) else ""
            refuse(argument, f"{path!r} must be an absolute path (the engine reads it as root, and vsnap checks that "
                             f"it is root's alone){hint}")
    return refusals


def one_rank_recapture_refusals(args: argparse.Namespace) -> list[Refusal]:
    """What one rank refuses when it drops and captures its CUDA graphs again (TP1_RECAPTURE_ENV)."""
    refusals: list[Refusal] = []

    def refuse(argument: str, reason: str) -> None:
        refusals.append(Refusal(argument, reason))

    extension = getattr(args, "worker_extension_cls", "") or ""
    if extension and extension != VSNAP_WORKER_EXTENSION:
        refuse("worker_extension_cls", f"{TP1_RECAPTURE_ENV}=1 drops and captures CUDA graphs again, which needs "
                                       f"vsnap's worker extension: remove worker_extension_cls or unset {TP1_RECAPTURE_ENV}")
    if _dual_batch_overlap(args):
        refuse("enable_dbo", f"{TP1_RECAPTURE_ENV}=1 drops and captures CUDA graphs again, which vsnap does not do "
                             "for dual-batch overlap's micro-batch graphs (turn enable_dbo and ubatch_size off)")
    return refusals


def _dual_batch_overlap(args: argparse.Namespace) -> bool:
    return bool(getattr(args, "enable_dbo", False)) or (getattr(args, "ubatch_size", 0) or 0) > 1


def _truthy(value: str, triggers: tuple[str, ...]) -> bool:
    return value.strip().lower() in triggers


def tensor_parallel_refusals(args: argparse.Namespace, env: Any) -> list[Refusal]:
    """What tensor_parallel_size > 1 refuses on top of the one-rank rules (docs/design/tensor-parallel-2.md 6)."""
    refusals: list[Refusal] = []

    def refuse(argument: str, reason: str) -> None:
        refusals.append(Refusal(argument, reason))

    extension = getattr(args, "worker_extension_cls", "") or ""
    if extension and extension != VSNAP_WORKER_EXTENSION:
        refuse("worker_extension_cls", "tensor parallelism needs vsnap's own worker extension (it disconnects and "
                                       "reconnects NCCL around the checkpoint): remove worker_extension_cls")
    if _dual_batch_overlap(args):
        refuse("enable_dbo", "dual-batch overlap's micro-batch CUDA graphs are not dropped and captured again around "
                             "the checkpoint (turn enable_dbo and ubatch_size off with tensor parallelism)")
    if getattr(args, "weight_transfer_config", None):
        refuse("weight_transfer_config", "weight transfer keeps a live NCCL communicator to an external trainer, "
                                         "which a snapshot cannot carry (remove it)")
    for name, value in TP_ENVIRONMENT.items():
        if env.get(name, value) != value:
            refuse(name, f"must be {value} with tensor parallelism, which vsnap sets in the engine's environment "
                         "(unset it)")
    for name, triggers, why in TP_REFUSED_ENVIRONMENT:
        if _truthy(env.get(name, ""), triggers):
            refuse(name, f"refused with tensor parallelism: {why} (unset it)")
    return refusals


# speculative_config.model values that name a method, not a draft model
SPECULATIVE_NAMES = ("ngram", "[ngram]", "ngram_gpu", "suffix", "extract_hidden_states")
SPECULATIVE_HINT = "; a dotted name would be imported as a proposer class"
# vLLM reads a chat_template as a file unless opening it fails and it holds one of these
TEMPLATE_CHARS = "{}\n"


def inline_template(value: str) -> bool:
    """Is this chat_template given as the template itself? vLLM first tries to open any value as a
    file (relative to the engine's working directory, /); an inline one must hold ``{``, ``}`` or a
    newline, and must not start with ``/`` (vsnap reads those as paths). Whether its first
    component exists in / (only root can make it so) is the orchestrator's check."""
    return any(c in value for c in TEMPLATE_CHARS) and not value.startswith("/")


def paths_read(args: argparse.Namespace) -> list[tuple[str, str]]:
    """(argument, path) for every file or directory besides the model that the parsed arguments make
    the engine read as root: all must be absolute (argument_refusals) and root's alone
    (vsnap.spec.vllm_check). The chat template's text also reaches every HTTP client (rendered into the
    prompts /tokenize returns), so the orchestrator also requires that anyone may read it."""
    found: list[tuple[str, str]] = []

    def add(argument: str, value: Any) -> None:
        if isinstance(value, str) and value:
            found.append((argument, value))

    for name in ("tokenizer", "hf_config_path", "ssl_keyfile", "ssl_certfile", "ssl_ca_certs"):
        add(name, getattr(args, name, None))
    if getattr(args, "generation_config", "auto") not in ("auto", "vllm"):
        add("generation_config", args.generation_config)
    template = getattr(args, "chat_template", None)
    if template and not inline_template(template):
        add("chat_template", template)
    for module in getattr(args, "lora_modules", None) or []:
        add(f"lora_modules {module.name}", module.path)
    speculative = getattr(args, "speculative_config", None)
    if isinstance(speculative, dict):
        model = {key.replace("-", "_"): value for key, value in speculative.items()}.get("model")
        if model not in SPECULATIVE_NAMES:
            add("speculative_config.model", model)
    if getattr(args, "spec_model", None) not in SPECULATIVE_NAMES:
        add("spec_model", getattr(args, "spec_model", None))
    return found
