"""A really restored CPU engine over real HTTP: streaming, chat, concurrent requests taking turns,
and a client that goes away stopping the worker (seen in the server's /metrics)."""

from __future__ import annotations

import json
import threading
import time
from typing import Iterator

import httpx
import pytest

from tests.conftest import engine_processes
from tests.integration.conftest import CapturedImage
from vsnap import RestoredServer, restore_image, stop_server

pytestmark = pytest.mark.criu


@pytest.fixture(scope="module")
def restored(captured: CapturedImage) -> Iterator[RestoredServer]:
    server = restore_image(captured.image, port=0)
    try:
        yield server
    finally:
        stop_server(server)
    assert engine_processes(captured.control_dir) == []


def metrics(url: str) -> dict[str, int]:
    """/metrics as {name{labels}: value}."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {line.rsplit(" ", 1)[0]: int(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line and not line.startswith("#")}


def stream_events(url: str, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", f"{url}/v1/{path}", json={**body, "stream": True}, timeout=60) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]" and all(line.startswith("data: ") for line in lines)
    return [json.loads(line[6:]) for line in lines[:-1]]


def test_streamed_completion_equals_the_plain_one(restored: RestoredServer, captured: CapturedImage) -> None:
    sample = captured.manifest.oracle.samples[0]
    body = {"prompt": sample.prompt, "max_tokens": len(sample.token_ids), "logprobs": 2}
    plain = httpx.post(f"{restored.url}/v1/completions", json=body, timeout=60).json()["choices"][0]
    assert plain["token_ids"] == sample.token_ids  # the oracle, served
    parts = [e["choices"][0] for e in stream_events(restored.url, "completions", body)]
    assert "".join(p["text"] for p in parts) == plain["text"]
    assert [t for p in parts for t in p["token_ids"]] == plain["token_ids"]
    assert [x for p in parts for x in p["logprobs"]["token_logprobs"]] == plain["logprobs"]["token_logprobs"]
    assert [x for p in parts for x in p["logprobs"]["top_logprobs"]] == plain["logprobs"]["top_logprobs"]
    assert parts[-1]["finish_reason"] == "length"


def test_chat_completions(restored: RestoredServer) -> None:
    body = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 6}
    plain = httpx.post(f"{restored.url}/v1/chat/completions", json=body, timeout=60).json()
    assert plain["object"] == "chat.completion" and plain["usage"]["completion_tokens"] == 6
    message = plain["choices"][0]["message"]
    assert message["role"] == "assistant"
    # the same as a completion of the documented template
    completion = httpx.post(f"{restored.url}/v1/completions", timeout=60,
                            json={"prompt": "<|user|>\nHello\n<|assistant|>\n", "max_tokens": 6}).json()
    assert message["content"] == completion["choices"][0]["text"]
    events = stream_events(restored.url, "chat/completions", body)
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events) == message["content"]


def test_a_short_request_sent_after_a_long_one_finishes_first(restored: RestoredServer) -> None:
    finished: dict[str, float] = {}
    first_chunk = threading.Event()

    def long_stream() -> None:
        with httpx.stream("POST", f"{restored.url}/v1/completions", timeout=60,
                          json={"prompt": "x", "max_tokens": 100, "stream": True}) as response:
            for line in response.iter_lines():
                first_chunk.set()
                if line == "data: [DONE]":
                    finished["long"] = time.monotonic()

    thread = threading.Thread(target=long_stream)
    thread.start()
    try:
        assert first_chunk.wait(30)
        short = httpx.post(f"{restored.url}/v1/completions", json={"prompt": "y", "max_tokens": 4}, timeout=60)
        finished["short"] = time.monotonic()
        assert short.status_code == 200 and len(short.json()["choices"][0]["token_ids"]) == 4
        assert "long" not in finished  # the long one is still generating
    finally:
        thread.join(60)
    assert finished["short"] < finished["long"]


def test_a_client_that_goes_away_stops_the_worker(restored: RestoredServer) -> None:
    before = metrics(restored.url)
    with httpx.stream("POST", f"{restored.url}/v1/completions", timeout=60,
                      json={"prompt": "z", "max_tokens": 200, "stream": True}) as response:
        received = 0
        for line in response.iter_lines():
            received += line.startswith("data: ")
            if received == 3:
                break  # the client goes away mid-stream
    cancelled = 'vsnap_cpu_requests_total{outcome="cancelled"}'
    deadline = time.monotonic() + 10
    while True:
        now = metrics(restored.url)
        if now[cancelled] == before[cancelled] + 1 and now["vsnap_cpu_requests_running"] == 0:
            break
        assert time.monotonic() < deadline, now
        time.sleep(0.05)
    time.sleep(0.5)
    after = metrics(restored.url)
    assert after["vsnap_cpu_generated_tokens_total"] == now["vsnap_cpu_generated_tokens_total"]  # stopped
    assert after["vsnap_cpu_generated_tokens_total"] - before["vsnap_cpu_generated_tokens_total"] < 50  # not 200
