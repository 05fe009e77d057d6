"""A bounded load generator for a restored server: concurrent completions on loopback.

Bounded in time and in request count, loopback addresses only (it refuses anything else), and
it stops by itself. Used by scripts/load_cpu.py (benchmark record) and the load test.
"""

from __future__ import annotations

import ipaddress
import json
import statistics
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from typing import Callable


@dataclass
class LoadResult:
    concurrency: int
    seconds: float
    requests: int = 0
    errors: int = 0
    error_samples: list[str] = field(default_factory=list)
    latencies_s: list[float] = field(default_factory=list)

    def percentile(self, q: float) -> float:
        if not self.latencies_s:
            return float("nan")
        ordered = sorted(self.latencies_s)
        return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]

    def summary(self) -> dict[str, float | int]:
        return {
            "concurrency": self.concurrency, "duration_s": self.seconds, "requests": self.requests,
            "errors": self.errors, "throughput_rps": self.requests / self.seconds if self.seconds else 0.0,
            "latency_p50_s": self.percentile(50), "latency_p90_s": self.percentile(90),
            "latency_p99_s": self.percentile(99), "latency_max_s": max(self.latencies_s, default=float("nan")),
            "latency_mean_s": statistics.fmean(self.latencies_s) if self.latencies_s else float("nan"),
        }


def _require_loopback(url: str) -> None:
    host = urllib.parse.urlparse(url).hostname or ""
    if host != "localhost" and not ipaddress.ip_address(host).is_loopback:
        raise ValueError(f"load tests target loopback addresses only, not {host}")


def run_load(url: str, *, concurrency: int = 4, seconds: float = 10.0, max_requests: int = 10_000,
             prompt: str = "The capital of France is", max_tokens: int = 4) -> LoadResult:
    """Send completions from ``concurrency`` threads for ``seconds`` (at most ``max_requests``)."""
    _require_loopback(url)
    result = LoadResult(concurrency, seconds)
    lock = threading.Lock()
    deadline = time.monotonic() + seconds
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}).encode()

    def worker() -> None:
        while time.monotonic() < deadline:
            with lock:
                if result.requests + result.errors >= max_requests:
                    return
            request = urllib.request.Request(f"{url}/v1/completions", data=body,
                                             headers={"content-type": "application/json"})
            start = time.monotonic()
            try:
                with urllib.request.urlopen(request, timeout=60) as response:
                    ok = response.status == 200 and len(json.load(response)["choices"][0]["token_ids"]) == max_tokens
                    problem = "" if ok else f"HTTP {response.status} or short completion"
            except (urllib.error.URLError, OSError, ValueError, KeyError) as exc:
                ok, problem = False, f"{type(exc).__name__}: {exc}"
            elapsed = time.monotonic() - start
            with lock:
                if ok:
                    result.requests += 1
                    result.latencies_s.append(elapsed)
                else:
                    result.errors += 1
                    if len(result.error_samples) < 5:
                        result.error_samples.append(problem)

    result.seconds = _on_threads(worker, concurrency, seconds + 120)
    return result


def _on_threads(worker: Callable[[], None], concurrency: int, join_s: float) -> float:
    """``worker`` on ``concurrency`` daemon threads, each waited for at most ``join_s``; the wall time."""
    threads = [threading.Thread(target=worker, daemon=True) for _ in range(concurrency)]
    started = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=join_s)
    return time.monotonic() - started


@dataclass
class Throughput:
    """A fixed batch of greedy completions: how fast a server generates under load."""

    requests: int
    concurrency: int
    max_tokens: int
    seconds: float = 0.0
    completion_tokens: int = 0
    errors: int = 0
    error_samples: list[str] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / self.seconds if self.seconds else 0.0

    def summary(self) -> dict[str, float | int | list[str]]:
        return {"requests": self.requests, "concurrency": self.concurrency, "max_tokens": self.max_tokens,
                "seconds": self.seconds, "completion_tokens": self.completion_tokens,
                "tokens_per_s": self.tokens_per_s, "errors": self.errors, "error_samples": self.error_samples}


def run_throughput(url: str, model: str, prompts: list[str], *, requests: int = 64, concurrency: int = 32,
                   max_tokens: int = 64, timeout_s: float = 300.0) -> Throughput:
    """``requests`` greedy completions of ``max_tokens`` tokens each (EOS ignored, so every request
    generates as many), ``concurrency`` in flight, over ``prompts`` in turn: the completion tokens
    the server reports (its ``usage``) over the wall time of the whole batch. Loopback only."""
    _require_loopback(url)
    result = Throughput(requests, concurrency, max_tokens)
    lock = threading.Lock()
    queue = list(range(requests))

    def worker() -> None:
        while True:
            with lock:
                if not queue:
                    return
                n = queue.pop()
            body = json.dumps({"model": model, "prompt": prompts[n % len(prompts)], "max_tokens": max_tokens,
                               "temperature": 0, "ignore_eos": True}).encode()
            request = urllib.request.Request(f"{url}/v1/completions", data=body,
                                             headers={"content-type": "application/json"})
            try:
                with urllib.request.urlopen(request, timeout=timeout_s) as response:
                    tokens = int(json.load(response)["usage"]["completion_tokens"])
                problem = ""
            except (urllib.error.URLError, OSError, ValueError, KeyError, TypeError) as exc:
                tokens, problem = 0, f"{type(exc).__name__}: {exc}"
            with lock:
                result.completion_tokens += tokens
                if problem:
                    result.errors += 1
                    if len(result.error_samples) < 5:
                        result.error_samples.append(problem[:300])

    result.seconds = _on_threads(worker, concurrency, timeout_s + 60)
    return result
