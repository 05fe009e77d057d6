"""The outputs compared, cold against restored: the same greedy completions asked of every server.

BENCH_PROMPTS prompts x BENCH_TOKENS greedy tokens, sent one at a time (the same batches on every
server), through the served model and each LoRA adapter given at boot; token ids and logprobs
compared (restored vs cold is the result; cold vs cold says how far the engine agrees with itself).
Plain HTTP to 127.0.0.1: the bench refuses a spec that serves TLS.
"""

from __future__ import annotations

import json
import math
import time
import urllib.request
from typing import Any, Callable

from vsnap.protocol.errors import EngineError
from vsnap.spec.schema import ModelSpec

BENCH_PROMPTS = 32

BENCH_TOKENS = 16

REQUEST_TIMEOUT_S = 300


Completion = tuple[list[int], list[float]]  # token ids, the logprob of each


def _post(url: str, body: dict[str, Any], *, timeout_s: float = REQUEST_TIMEOUT_S, phase: str = "bench",
          failed: str = "RequestFailed") -> dict[str, Any]:
    """POST ``body`` to the server's completions; its JSON answer (EngineError ``failed`` naming
    how long it waited if it fails)."""
    request = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"content-type": "application/json"})
    started = time.monotonic()
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            answer = json.load(response)
    except (OSError, ValueError) as exc:  # URLError and HTTPError are OSErrors
        raise EngineError(phase, failed, f"POST {url}/v1/completions failed after "
                                         f"{time.monotonic() - started:.1f} s: {exc}") from None
    if not isinstance(answer, dict):
        raise EngineError(phase, failed, f"POST {url}/v1/completions answered no JSON object")
    return answer


def first_token(url: str, model: str, *, timeout_s: float = REQUEST_TIMEOUT_S, phase: str = "bench") -> None:
    """One greedy one-token completion through the served port: the first request a user would
    send (the bench times a start to it; `vsnap serve` makes a cold start ready on it).
    EngineError FirstCompletionFailed if it fails or answers no choice."""
    body = {"model": model, "prompt": "Hello", "max_tokens": 1, "temperature": 0}
    if not _post(url, body, timeout_s=timeout_s, phase=phase, failed="FirstCompletionFailed").get("choices"):
        raise EngineError(phase, "FirstCompletionFailed", f"POST {url}/v1/completions answered no choice")


def bench_prompts(n: int = BENCH_PROMPTS) -> list[str]:
    """``n`` different short prompts, the same in every run."""
    subjects = ["The capital of France is", "def fibonacci(n):", "1, 2, 3, 5, 8,", "Once upon a time",
                "The weather today", "import numpy as np", "Dear Sir or Madam,", "SELECT * FROM"]
    return [f"{subjects[i % len(subjects)]} ({i})" for i in range(n)]


def parse_completion(choice: dict[str, Any]) -> Completion:
    """Token ids and their logprobs from one completion choice: the ids from ``token_ids`` (the
    cpu engine, vLLM with return_token_ids) or from vLLM's ``token_id:N`` logprob tokens
    (return_tokens_as_token_ids), the logprobs from ``logprobs.token_logprobs``."""
    logprobs = choice.get("logprobs") or {}
    ids = choice.get("token_ids")
    if not isinstance(ids, list):
        tokens = logprobs.get("tokens") or []
        try:
            ids = [int(str(t).removeprefix("token_id:")) for t in tokens]
        except ValueError:
            raise EngineError("bench", "NoTokenIds", f"the completion has no token ids (tokens {tokens[:3]}...)") from None
    values = [float("nan") if v is None else float(v) for v in logprobs.get("token_logprobs") or []]
    return [int(t) for t in ids], values


def lora_adapter_names(serve: dict[str, Any]) -> list[str]:
    """The names of the LoRA adapters a vLLM spec loads at boot (``lora_modules``: ``name=path``
    strings or ``{"name": ..., "path": ...}`` mappings, as vLLM's parser takes them)."""
    modules = serve.get("lora_modules", serve.get("lora-modules")) or []
    names = []
    for module in modules if isinstance(modules, list) else [modules]:
        if isinstance(module, dict):
            names.append(str(module.get("name", "")))
        elif isinstance(module, str):
            text = module.strip()
            names.append(str(json.loads(text).get("name", "")) if text.startswith("{") else text.split("=", 1)[0])
    return [name for name in names if name]


def served_models(spec: ModelSpec) -> list[str]:
    """The names the bench asks: the served model, then each LoRA adapter given at boot."""
    return [spec.served_model_name, *lora_adapter_names(spec.serve)]


def completions(url: str, model: str, prompts: list[str], max_tokens: int = BENCH_TOKENS) -> list[Completion]:
    """Greedy completions of each prompt, one request at a time (the same batches on every server)."""
    out = []
    for prompt in prompts:
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "logprobs": 1,
                "ignore_eos": True, "return_tokens_as_token_ids": True}
        out.append(parse_completion(_post(url, body)["choices"][0]))
    return out


def outputs_of(spec: ModelSpec) -> Callable[[str], list[Completion]]:
    """What the bench asks a server at ``url`` for: every prompt through the model, then through
    each LoRA adapter."""
    prompts = bench_prompts()
    models = served_models(spec)

    def outputs(url: str) -> list[Completion]:
        return [c for model in models for c in completions(url, model, prompts)]

    return outputs


def compare_outputs(expected: list[Completion], actual: list[Completion]) -> dict[str, Any]:
    """Per prompt, the first position where the token ids differ (a shorter output differs where
    it ends); the largest |logprob difference| over the positions before that (after it the two
    continue from different tokens). A NaN logprob on either side counts as a differing token."""
    if len(expected) != len(actual):
        raise ValueError(f"{len(expected)} completions to compare with {len(actual)}")
    mismatches, worst, tokens = [], 0.0, 0
    for index, ((ids_a, lps_a), (ids_b, lps_b)) in enumerate(zip(expected, actual)):
        tokens += len(ids_a)
        first = next((p for p, (a, b) in enumerate(zip(ids_a, ids_b)) if a != b), None)
        if first is None and len(ids_a) != len(ids_b):
            first = min(len(ids_a), len(ids_b))
        end = len(ids_a) if first is None else first
        for position in range(min(end, len(lps_a), len(lps_b))):
            a, b = lps_a[position], lps_b[position]
            if math.isnan(a) or math.isnan(b):
                first = position if first is None else min(first, position)
                break
            worst = max(worst, abs(a - b))
        if first is not None:
            mismatches.append({"prompt": index, "position": first})
    return {"prompts": len(expected), "tokens": tokens, "mismatched_prompts": len(mismatches),
            "first_mismatch_position": min((m["position"] for m in mismatches), default=None),
            "max_logprob_diff": worst, "mismatches": mismatches}

