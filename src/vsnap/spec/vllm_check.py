"""The vLLM argument and model rules, run from the orchestrator (validate, capture preflight),
and the installed vLLM against the versions they were tested with.

Imports vLLM (slow, seconds), so only for `engine: vllm` specs.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import site
import sys
import sysconfig
from collections.abc import Callable
from pathlib import Path

from vsnap.engine.adapters.vllm.compat import TESTED_VLLM
from vsnap.host.facts import Check, vllm_version
from vsnap.host.trust import require_trusted_file, require_trusted_path, unreadable_by_others, untrusted_module
from vsnap.protocol.errors import HostNotReady, ImageUntrusted, SpecError, SpecIssue

from .schema import ModelSpec


def _issues(source: str, refusals: list) -> SpecError:
    def field(argument: str) -> str:
        return argument if argument.startswith("serve") or argument == "model" else f"serve.{argument}"

    return SpecError([SpecIssue(source, None, None, field(r.argument), r.reason) for r in refusals],
                     hint="vsnap captures one local rank, or tensor parallelism over 2 local GPUs; docs/model-yaml.md lists "
                          "the rules")


VERSION_CHECK = "vllm version"


def _to_stderr(line: str) -> None:
    print(f"warning: {line}", file=sys.stderr, flush=True)


def tested_vllm(version: str) -> bool:
    """Is ``version`` one vsnap was tested with? A local label (``0.26.0+cu130``) is the same
    release; anything else, a patch release or a pre-release among them, is not."""
    return version.split("+", 1)[0] in TESTED_VLLM


def vllm_version_check(version: str | None = None) -> Check | None:
    """The installed vLLM (or ``version``) against TESTED_VLLM: ok when it is one of them; else a
    warning in one line, not a refusal, since a vLLM in the extra's range usually works (the
    capture's rehearsal still has to pass). None when no vLLM is installed (the engine's own
    preflight check says so)."""
    version = vllm_version() if version is None else version
    if version is None:
        return None
    tested = ", ".join(TESTED_VLLM)
    if tested_vllm(version):
        return Check(VERSION_CHECK, True, f"vllm {version}, one of the versions vsnap is tested with ({tested})")
    return Check(VERSION_CHECK, True, f"vllm {version} is not a version vsnap is tested with ({tested}): the "
                                      "snapshot rules and the engine adapter may not fit it", warning=True)


def require_supported_args(spec: ModelSpec, source: str = "model.yaml",
                           warn: Callable[[str], None] | None = _to_stderr) -> str:
    """Parse the spec's serve arguments with vLLM's parser and apply the argument rules. An
    installed vLLM vsnap was not tested with is first said to ``warn`` (a capture's preflight: one
    line on stderr; `vsnap validate` shows vllm_version_check as its own row and passes None).

    vLLM logs to stdout (its logging handler is bound to sys.stdout when vLLM is first imported);
    here that goes to stderr, so that `--json` output stays one document on stdout."""
    version = vllm_version_check()
    if warn is not None and version is not None and version.warning:
        warn(version.detail)
    with contextlib.redirect_stdout(sys.stderr):
        return _require_supported_args(spec, source)


def _require_supported_args(spec: ModelSpec, source: str) -> str:
    try:
        from vsnap.engine.adapters.vllm import config_rules as vllm_config_rules
        from vsnap.engine.adapters.vllm import rules as vllm_rules
    except ImportError as exc:  # pragma: no cover - the module itself has no hard imports
        raise HostNotReady("engine", f"cannot load the vLLM rules: {exc}") from None
    from vsnap.host.facts import vllm_device

    cuda = vllm_device() == "cuda"
    try:
        args, refusals = vllm_rules.parse_serve_args(str(spec.model), dict(spec.serve), cuda=cuda)
    except ImportError as exc:
        raise HostNotReady("engine", f"vLLM cannot be imported: {exc}", hint="pip install 'vsnap[vllm]'") from None
    if args is None or refusals:
        raise _issues(source, refusals)
    # the environment the engine will have: the caller's, with what the engine sets over it at TP > 1
    environ = {**os.environ, **vllm_rules.TP_ENVIRONMENT, "VLLM_WORKER_MULTIPROC_METHOD": "spawn"}
    refusals = vllm_rules.argument_refusals(args, environ=environ)
    if refusals:
        raise _issues(source, refusals)
    require_engine_reads(args, spec, source)
    # the resolved configuration (vLLM's own config; reads the model's config.json, loads nothing):
    # on the CPU backend its model rules apply here; on CUDA the engine applies them when it builds
    # (at capture), and here it only says what the configuration uses beyond a dense model
    try:
        config = vllm_config_rules.resolve_config(args)
    except Exception as exc:  # vLLM's own refusal of the configuration, in its words
        if not cuda:
            raise _issues(source, [vllm_rules.Refusal("serve", f"vLLM refuses the configuration: {exc}")]) from None
        return (f"{len(spec.serve)} serve arguments accepted by vLLM's parser and the snapshot rules "
                f"(the configuration is resolved at capture: {type(exc).__name__})")
    refusals = [] if cuda else vllm_config_rules.config_refusals(config, is_cuda=False)
    if refusals:
        raise _issues(source, refusals)
    support = vllm_config_rules.configuration_support(config)
    beyond = ("; beyond a dense model: " + ", ".join(f"{feature} ({how})" for feature, how in support)
              if support else "")
    if cuda:  # the model rules on this configuration run when the engine builds it (at capture)
        return (f"{len(spec.serve)} serve arguments accepted by vLLM's parser and the snapshot rules; the "
                f"configuration resolved by vLLM (its model rules run at capture){beyond}")
    return (f"{len(spec.serve)} serve arguments and the resolved configuration accepted by vLLM and the "
            f"snapshot rules (CPU backend){beyond}")


def require_engine_reads(args: argparse.Namespace, spec: ModelSpec, source: str) -> None:
    """What the parsed serve arguments make the engine, as root, read or import (beyond the model,
    which the callers check) is root's alone: before vLLM resolves the configuration, which already
    reads some of it. Raises ImageUntrusted naming the file, or SpecError naming the argument."""
    from vsnap.engine.adapters.vllm import rules as vllm_rules

    if args.model != str(spec.model):  # vsnap put --model first and refuses values that look like options
        raise _issues(source, [vllm_rules.Refusal("serve", f"vLLM would load {args.model}, not model: {spec.model}")])
    for argument, path in vllm_rules.paths_read(args):
        what = f"the serve.{argument}"
        if argument != "chat_template":
            require_trusted_path(Path(path), what)  # a directory (every file in it) or a file
        else:
            require_trusted_file(Path(path), what)
            problem = unreadable_by_others(Path(path))
            if problem:
                raise ImageUntrusted(path, f"{what} would be disclosed: its text is rendered into the prompts every "
                                           f"HTTP client can read back, and {problem}",
                                     hint="give the template inline, or a copy of it that anyone may read")
    template = getattr(args, "chat_template", None)
    if template and vllm_rules.inline_template(template):
        first = os.path.join("/", template.split("/")[0])  # vLLM opens it as a file first, from the engine's /
        if os.path.lexists(first):
            raise _issues(source, [vllm_rules.Refusal("chat_template", f"vLLM would read it as a file under {first} "
                                                      "first: give the template inline without that prefix, or "
                                                      "an absolute path")])
    extension = getattr(args, "worker_extension_cls", "")
    if extension and extension != vllm_rules.VSNAP_WORKER_EXTENSION:
        problem = untrusted_module(extension, engine_path(), installed_roots())
        if problem:
            raise _issues(source, [vllm_rules.Refusal("worker_extension_cls", f"the engine would import {problem}: "
                                                      "only a module installed in root's site-packages, and root's "
                                                      "alone, may be a worker extension")])


def engine_path() -> list[str]:
    """Where the engine's interpreter looks for modules: vsnap's own package directory first (the
    tree's PYTHONPATH), then this interpreter's path (the engine runs with PYTHONSAFEPATH, from /:
    no working directory on it)."""
    return [str(Path(__file__).resolve().parents[2]), *(entry for entry in sys.path if entry)]  # src/ of src/vsnap/spec


def installed_roots() -> list[str]:
    """This interpreter's site-packages: where root installs packages (not the standard library,
    some of whose modules act when imported)."""
    paths = sysconfig.get_paths()
    return sorted({paths["purelib"], paths["platlib"], *site.getsitepackages()})
