"""The vLLM argument and model rules, run from the orchestrator (validate, capture preflight).

Imports vLLM (slow, seconds), so only for `engine: vllm` specs.
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

from .protocol.errors import HostNotReady, SpecError, SpecIssue
from ._spec import ModelSpec
from ._trust import require_trusted_model


def _issues(source: str, refusals: list) -> SpecError:
    def field(argument: str) -> str:
        return argument if argument.startswith("serve") or argument == "model" else f"serve.{argument}"

    return SpecError([SpecIssue(source, None, None, field(r.argument), r.reason) for r in refusals],
                     hint="vsnap captures one local rank of a dense model; docs/model-yaml.md lists the rules")


def require_supported_args(spec: ModelSpec, source: str = "model.yaml") -> str:
    """Parse the spec's serve arguments with vLLM's parser and apply the argument rules.

    vLLM logs to stdout (its logging handler is bound to sys.stdout when vLLM is first imported);
    here that goes to stderr, so that `--json` output stays one document on stdout."""
    with contextlib.redirect_stdout(sys.stderr):
        return _require_supported_args(spec, source)


def _require_supported_args(spec: ModelSpec, source: str) -> str:
    try:
        from .engine.adapters import vllm_rules
    except ImportError as exc:  # pragma: no cover - the module itself has no hard imports
        raise HostNotReady("engine", f"cannot load the vLLM rules: {exc}") from None
    from ._host import vllm_device

    cuda = vllm_device() == "cuda"
    try:
        args, refusals = vllm_rules.parse_serve_args(str(spec.model), dict(spec.serve), cuda=cuda)
    except ImportError as exc:
        raise HostNotReady("engine", f"vLLM cannot be imported: {exc}", hint="pip install 'vsnap[vllm]'") from None
    if args is None or refusals:
        raise _issues(source, refusals)
    refusals = vllm_rules.argument_refusals(args, environ={**os.environ, "VLLM_WORKER_MULTIPROC_METHOD": "spawn"})
    if refusals:
        raise _issues(source, refusals)
    if args.model != str(spec.model):  # vsnap put --model first and refuses values that look like options
        raise _issues(source, [vllm_rules.Refusal("serve", f"vLLM would load {args.model}, not model: {spec.model}")])
    for module in getattr(args, "lora_modules", None) or []:  # read by the engine, as root, like the model
        require_trusted_model(Path(module.path))
    # the resolved configuration (vLLM's own config; reads the model's config.json, loads nothing):
    # on the CPU backend its model rules apply here; on CUDA the engine applies them when it builds
    # (at capture), and here it only says what the configuration uses beyond a dense model
    try:
        config = vllm_rules.resolve_config(args)
    except Exception as exc:  # vLLM's own refusal of the configuration, in its words
        if not cuda:
            raise _issues(source, [vllm_rules.Refusal("serve", f"vLLM refuses the configuration: {exc}")]) from None
        return (f"{len(spec.serve)} serve arguments accepted by vLLM's parser and the snapshot rules "
                f"(the configuration is resolved at capture: {type(exc).__name__})")
    refusals = [] if cuda else vllm_rules.config_refusals(config, is_cuda=False)
    if refusals:
        raise _issues(source, refusals)
    support = vllm_rules.configuration_support(config)
    beyond = ("; beyond a dense model: " + ", ".join(f"{feature} ({how})" for feature, how in support)
              if support else "")
    return (f"{len(spec.serve)} serve arguments and the resolved configuration accepted by vLLM and the "
            f"snapshot rules ({'CUDA' if cuda else 'CPU backend'}){beyond}")
