"""The built-in CPU engine with its real model, in-process (no root): the scheduler, the worker
over its pipe, the streamed and plain OpenAI answers, disconnects and the bounded queue.

The reference for every number is the greedy loop as it was before generation became step-wise
(``_generate_as_before``, copied verbatim): the oracle of an existing image must not change.
"""

from __future__ import annotations

import asyncio
import json
import random
import socket
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest
import torch

from vsnap.engine.adapters.cpu import model as cpu_model
from vsnap.engine.adapters.cpu.scheduler import Scheduler, SequenceState, ServerBusy
from vsnap.protocol.control import Activation, LaunchConfig

PROMPTS = ["The capital of France is", "a", "Once upon a time, in a land far away, there lived"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return cpu_model.write_model(tmp_path_factory.mktemp("cpu") / "model")


@pytest.fixture(scope="module")
def model(model_dir: Path) -> cpu_model.TinyDecoder:
    torch.set_num_threads(1)  # as in the worker; and the test machine is shared
    tiny = cpu_model.TinyDecoder(cpu_model.read_config(model_dir)).eval()
    cpu_model.load_weights(tiny, model_dir)
    return tiny


@torch.no_grad()
def _generate_as_before(model: cpu_model.TinyDecoder, prompt: str, max_tokens: int, top_k: int) -> dict[str, Any]:
    """cpu_model.generate before this change, verbatim (one pipe call generated the whole answer)."""
    ids = cpu_model.encode(prompt)
    tokens: list[int] = []
    logprobs: list[dict[str, float]] = []
    for _ in range(max_tokens):
        logits = model(torch.tensor([ids + tokens]))[0, -1].float()
        log_probs = torch.log_softmax(logits, dim=-1)
        values, indices = torch.topk(log_probs, top_k)
        chosen = int(indices[0])
        tokens.append(chosen)
        logprobs.append({str(int(i)): float(v) for v, i in zip(values, indices)})
    return {"token_ids": tokens, "logprobs": logprobs, "prompt_tokens": len(ids)}


def _local_step(model: cpu_model.TinyDecoder, log: list[list[int]] | None = None):
    """The worker's step, in a thread as the adapter runs it; ``log`` records each step's first prompt bytes."""
    async def step(batch: list[tuple[list[int], int]]) -> list[cpu_model.Step]:
        if log is not None:
            log.append([ids[1] for ids, _ in batch])
        return await asyncio.to_thread(cpu_model.step, model, batch)
    return step


# --- the scheduler -----------------------------------------------------------------------

def test_concurrent_requests_get_exactly_the_answers_of_one_at_a_time(model: cpu_model.TinyDecoder) -> None:
    cases = [(p, n, k) for p, n, k in zip(PROMPTS, (12, 5, 9), (5, 1, 3))]

    async def run() -> list[Any]:
        scheduler = Scheduler(_local_step(model), max_len=256)
        sequences = [scheduler.submit(cpu_model.encode(p), n, k) for p, n, k in cases]
        return await asyncio.gather(*(s.result() for s in sequences))

    for (prompt, n, k), sequence in zip(cases, asyncio.run(run())):
        before = _generate_as_before(model, prompt, n, k)
        assert sequence.token_ids == before["token_ids"]
        assert sequence.logprobs == before["logprobs"]  # bit-identical floats, same order
        assert [list(top) for top in sequence.logprobs] == [list(top) for top in before["logprobs"]]
        assert cpu_model.generate(model, prompt, n, k, 256) == before


def test_a_short_request_sent_after_a_long_one_finishes_first(model: cpu_model.TinyDecoder) -> None:
    steps: list[list[int]] = []

    async def run() -> tuple[list[str], Any, Any]:
        scheduler = Scheduler(_local_step(model, steps), max_len=256)
        finished: list[str] = []

        async def wait(name: str, sequence: Any) -> Any:
            await sequence.result()
            finished.append(name)
            return sequence

        long = scheduler.submit(cpu_model.encode(PROMPTS[0]), 30, 1)
        long_done = asyncio.ensure_future(wait("long", long))
        while len(long.token_ids) < 3:
            await asyncio.sleep(0.001)
        short = scheduler.submit(cpu_model.encode(PROMPTS[1]), 3, 1)
        await asyncio.gather(long_done, wait("short", short))
        return finished, long, short

    finished, long, short = asyncio.run(run())
    assert finished == ["short", "long"]
    assert short.token_ids == _generate_as_before(model, PROMPTS[1], 3, 1)["token_ids"]
    assert long.token_ids == _generate_as_before(model, PROMPTS[0], 30, 1)["token_ids"]
    assert [len(s) for s in steps].count(2) == 3  # both advanced together for the short one's 3 tokens
    assert len(steps) == 30


def test_the_queue_is_bounded_and_served_in_arrival_order(model: cpu_model.TinyDecoder) -> None:
    async def run() -> None:
        release = asyncio.Event()
        started: list[list[int]] = []

        async def step(batch: list[tuple[list[int], int]]) -> list[cpu_model.Step]:
            started.append([len(ids) for ids, _ in batch])
            await release.wait()
            return cpu_model.step(model, batch)

        scheduler = Scheduler(step, max_len=256, max_running=1, max_waiting=2)
        first = scheduler.submit(cpu_model.encode("1"), 1, 1)
        second = scheduler.submit(cpu_model.encode("22"), 1, 1)
        third = scheduler.submit(cpu_model.encode("333"), 1, 1)
        await asyncio.sleep(0.01)
        assert (first.state, second.state, third.state) == (SequenceState.RUNNING, SequenceState.WAITING,
                                                            SequenceState.WAITING)
        with pytest.raises(ServerBusy, match="1 requests running and 2 waiting"):
            scheduler.submit(cpu_model.encode("4444"), 1, 1)
        assert scheduler.stats.rejected == 1 and scheduler.stats.waiting == 2
        release.set()
        await asyncio.gather(first.result(), second.result(), third.result())
        assert started == [[2], [3], [4]]  # one at a time, first come first served
        assert scheduler.stats.finished == 3 and scheduler.stats.running == 0

    asyncio.run(run())


def test_a_cancelled_request_gets_no_further_step(model: cpu_model.TinyDecoder) -> None:
    steps: list[list[int]] = []

    async def run() -> Scheduler:
        scheduler = Scheduler(_local_step(model, steps), max_len=256)
        sequence = scheduler.submit(cpu_model.encode("x"), 100, 1)
        other = scheduler.submit(cpu_model.encode("yy"), 20, 1)
        received = 0
        async for _ in sequence.stream():
            received += 1
            if received == 4:
                sequence.cancel()
        assert sequence.state is SequenceState.CANCELLED and received == 4
        await other.result()
        assert len(other.token_ids) == 20
        return scheduler

    scheduler = asyncio.run(run())
    # 4 tokens read, at most one more computed (the step that ran while it was cancelled)
    assert 4 <= sum(step.count(ord("x")) for step in steps) <= 5
    assert sum(step.count(ord("y")) for step in steps) == 20
    assert scheduler.stats.cancelled == 1 and scheduler.stats.finished == 1
    assert scheduler.stats.generated_tokens <= 20 + 5


def test_too_long_a_request_and_a_failing_worker(model: cpu_model.TinyDecoder) -> None:
    async def run() -> None:
        async def broken(batch: list[tuple[list[int], int]]) -> list[cpu_model.Step]:
            raise RuntimeError("worker gone")

        scheduler = Scheduler(broken, max_len=16)
        with pytest.raises(ValueError, match="exceeds max_model_len 16"):
            scheduler.submit(cpu_model.encode("0123456789"), 6, 1)
        sequence = scheduler.submit(cpu_model.encode("hi"), 3, 1)
        with pytest.raises(RuntimeError, match="worker gone"):
            await sequence.result()
        assert sequence.state is SequenceState.FAILED and scheduler.stats.failed == 1
        await scheduler.close(RuntimeError("stopping"))
        with pytest.raises(ServerBusy, match="stopping"):
            scheduler.submit(cpu_model.encode("hi"), 3, 1)

    asyncio.run(run())


def test_streamed_text_is_the_plain_text() -> None:
    rng = random.Random(0)
    samples = [list("héllo, wörld €😀".encode()), [0xE2, 0x82], [0xF0, 0x9F, 256, 0x98, 0x80, 257], [0xFF, 0x41]]
    samples += [[rng.choice([*range(256), 256, 257]) for _ in range(rng.randint(1, 40))] for _ in range(300)]
    for tokens in samples:
        stream = cpu_model.TextStream()
        assert "".join(stream.push(t) for t in tokens) + stream.flush() == cpu_model.decode(tokens)
    stream = cpu_model.TextStream()
    assert [stream.push(t) for t in "€".encode()] == ["", "", "€"]  # a character goes out with its last byte


def test_chat_template() -> None:
    assert cpu_model.chat_prompt([("system", "Be brief."), ("user", "Hi")]) == \
        "<|system|>\nBe brief.\n<|user|>\nHi\n<|assistant|>\n"
    with pytest.raises(ValueError, match="role 'tool'"):
        cpu_model.chat_prompt([("tool", "{}")])


def test_the_worker_over_its_pipe_gives_the_same_oracle_before_and_after_reload(model_dir: Path,
                                                                               model: cpu_model.TinyDecoder) -> None:
    from vsnap.engine.adapters.cpu.adapter import CpuAdapter

    # model_construct: the adapter reads these fields only; the version stamp is the launcher's business
    launch = LaunchConfig.model_construct(engine="cpu", model=str(model_dir), served_model_name="tiny",
                                          oracle_prompts=PROMPTS, oracle_max_tokens=6, oracle_top_k=4,
                                          oracle_tolerance=0.0, timeout_s=60)

    async def run() -> tuple[Any, Any]:
        adapter = CpuAdapter(launch)
        try:
            await adapter.build()
            oracle = await adapter.prepare()  # the oracle, then the weights dropped
            await adapter.recover(Activation.model_construct(host="127.0.0.1", port=0))
            return oracle, await adapter.run_oracle()
        finally:
            await adapter.shutdown()

    oracle, again = asyncio.run(run())
    assert oracle == again
    for sample in oracle.samples:
        before = _generate_as_before(model, sample.prompt, 6, 4)
        assert (sample.token_ids, sample.logprobs) == (before["token_ids"], before["logprobs"])


# --- the HTTP API, served by uvicorn on loopback ----------------------------------------

class _Server:
    def __init__(self, model: cpu_model.TinyDecoder, **limits: int) -> None:
        import uvicorn

        from vsnap.engine.adapters.cpu.server import build_app

        self.release = threading.Event()
        self.release.set()
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.ready = threading.Event()

        async def step(batch: list[tuple[list[int], int]]) -> list[cpu_model.Step]:
            await asyncio.to_thread(self.release.wait)
            return await asyncio.to_thread(cpu_model.step, model, batch)

        async def serve() -> None:
            self.scheduler = Scheduler(step, max_len=256, **limits)
            app = build_app(self.scheduler, "tiny")
            self.server = uvicorn.Server(uvicorn.Config(app, lifespan="off", log_level="warning"))
            self.ready.set()
            await self.server.serve(sockets=[self.sock])

        self.thread = threading.Thread(target=asyncio.run, args=(serve(),), daemon=True)
        self.thread.start()
        assert self.ready.wait(10)
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline
            time.sleep(0.01)

    def stop(self) -> None:
        self.release.set()
        self.server.should_exit = True
        self.thread.join(10)

    def wait_for(self, condition: Any, timeout: float = 10) -> None:
        deadline = time.monotonic() + timeout
        while not condition(self.scheduler.stats):
            assert time.monotonic() < deadline, self.scheduler.stats
            time.sleep(0.01)


@pytest.fixture(scope="module")
def server(model: cpu_model.TinyDecoder) -> Iterator[_Server]:
    served = _Server(model)
    yield served
    served.stop()


def _events(response: httpx.Response) -> list[Any]:
    """The SSE stream: every event is one ``data:`` line and a blank line."""
    assert response.headers["content-type"].startswith("text/event-stream")
    text = response.text
    assert text.endswith("data: [DONE]\n\n")
    blocks = text[:-2].split("\n\n")
    assert all(b.startswith("data: ") and "\n" not in b for b in blocks)
    return [json.loads(b[6:]) for b in blocks[:-1]]


def test_streamed_completion_is_the_plain_completion(server: _Server, model: cpu_model.TinyDecoder) -> None:
    body = {"prompt": "Bonjour, ", "max_tokens": 12, "logprobs": 3}
    plain = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30).json()
    choice = plain["choices"][0]
    before = _generate_as_before(model, "Bonjour, ", 12, 3)
    assert choice["token_ids"] == before["token_ids"] and choice["finish_reason"] == "length"
    assert choice["logprobs"]["token_logprobs"] == [top[str(t)] for t, top in zip(before["token_ids"],
                                                                                  before["logprobs"])]
    streamed = httpx.post(f"{server.url}/v1/completions", timeout=30,
                          json={**body, "stream": True, "stream_options": {"include_usage": True}})
    events = _events(streamed)
    chunks, usage = events[:-1], events[-1]
    assert len(chunks) == 12 and all(c["object"] == "text_completion" and len(c["choices"]) == 1 for c in chunks)
    assert len({c["id"] for c in events}) == 1
    parts = [c["choices"][0] for c in chunks]
    assert [p["finish_reason"] for p in parts] == [None] * 11 + ["length"]
    assert "".join(p["text"] for p in parts) == choice["text"]
    assert [t for p in parts for t in p["token_ids"]] == choice["token_ids"]
    for key in ("tokens", "token_logprobs", "top_logprobs"):
        assert [x for p in parts for x in p["logprobs"][key]] == choice["logprobs"][key]
    assert usage["choices"] == [] and usage["usage"] == plain["usage"] == \
        {"prompt_tokens": 10, "completion_tokens": 12, "total_tokens": 22}
    without = _events(httpx.post(f"{server.url}/v1/completions", timeout=30,
                                 json={"prompt": "Bonjour, ", "max_tokens": 2, "stream": True}))
    assert len(without) == 2 and all(c["choices"][0]["logprobs"] is None for c in without)


def test_chat_completion_plain_and_streamed(server: _Server, model: cpu_model.TinyDecoder) -> None:
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "!"}]}]
    body = {"model": "tiny", "messages": messages, "max_completion_tokens": 7, "logprobs": True, "top_logprobs": 2}
    plain = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=30).json()
    assert plain["object"] == "chat.completion" and plain["id"].startswith("chatcmpl-")
    choice = plain["choices"][0]
    before = _generate_as_before(model, "<|system|>\nBe brief.\n<|user|>\nHi!\n<|assistant|>\n", 7, 2)
    assert choice["message"] == {"role": "assistant", "content": cpu_model.decode(before["token_ids"])}
    assert choice["token_ids"] == before["token_ids"] and choice["finish_reason"] == "length"
    entries = choice["logprobs"]["content"]
    assert [e["logprob"] for e in entries] == [top[str(t)] for t, top in zip(before["token_ids"], before["logprobs"])]
    assert all(len(e["top_logprobs"]) == 2 for e in entries)
    assert plain["usage"]["completion_tokens"] == 7
    events = _events(httpx.post(f"{server.url}/v1/chat/completions", json={**body, "stream": True}, timeout=30))
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    parts = [e["choices"][0] for e in events[1:]]
    assert "".join(p["delta"]["content"] for p in parts) == choice["message"]["content"]
    assert [e for p in parts for e in p["logprobs"]["content"]] == entries
    assert parts[-1]["finish_reason"] == "length"


@pytest.mark.parametrize("path,body,status,message", [
    ("completions", {"prompt": "x" * 250, "max_tokens": 16}, 400, "exceeds max_model_len 256"),
    ("completions", {"prompt": "x", "temperature": 0.7}, 400, "greedily"),
    ("completions", {"prompt": "x", "model": "other"}, 404, "does not exist"),
    ("completions", {"prompt": "x", "n": 2}, 400, "one choice"),
    ("completions", {"prompt": "x", "stop": ["\n"]}, 400, "stop sequences"),
    ("chat/completions", {"messages": [{"role": "tool", "content": "{}"}]}, 400, "role 'tool'"),
    ("chat/completions", {"messages": []}, 400, "invalid request: messages"),
    ("chat/completions", {"messages": [{"role": "x" * 100000, "content": "hi"}]}, 400, "messages.0.role"),
    ("completions", {"prompt": "a", "max_tokens": float("inf")}, 400, "max_tokens"),
    ("completions", {"prompt": "\ud800"}, 400, ""),
])
def test_refusals(server: _Server, path: str, body: dict, status: int, message: str) -> None:
    raw = json.dumps(body).encode()  # json.dumps writes inf as Infinity and keeps the lone surrogate escaped
    response = httpx.post(f"{server.url}/v1/{path}", content=raw, headers={"content-type": "application/json"},
                          timeout=30)
    assert response.status_code == status
    assert message in response.text
    assert len(response.content) < 4096  # the refusal never echoes what was sent


def test_a_body_too_large_or_of_unknown_length_is_never_read(server: _Server) -> None:
    import socket

    from vsnap.engine.adapters.cpu.server import MAX_BODY_BYTES

    host, port = server.url.removeprefix("http://").split(":")
    for head, status in ((f"Content-Length: {MAX_BODY_BYTES + 1}\r\n", b"413"),
                         ("Transfer-Encoding: chunked\r\n", b"411")):
        with socket.create_connection((host, int(port)), timeout=10) as conn:
            conn.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         f"{head}\r\n".encode())  # and no body at all: the answer must come anyway
            assert conn.recv(4096).split(b" ")[1] == status


def test_a_client_that_disconnects_stops_its_generation(server: _Server) -> None:
    stats = server.scheduler.stats
    cancelled, generated = stats.cancelled, stats.generated_tokens
    with httpx.stream("POST", f"{server.url}/v1/completions", timeout=30,
                      json={"prompt": "x", "max_tokens": 200, "stream": True}) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")  # one token arrived; now the client goes away
    server.wait_for(lambda s: s.cancelled == cancelled + 1 and s.running == 0)
    stopped_at = stats.generated_tokens
    time.sleep(0.3)
    assert stats.generated_tokens == stopped_at < generated + 50

    # a plain (not streamed) request whose client closes the connection
    body = json.dumps({"prompt": "y", "max_tokens": 200}).encode()
    with socket.create_connection(server.sock.getsockname()) as raw:
        raw.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\n"
                    b"content-length: %d\r\n\r\n%s" % (len(body), body))
        server.wait_for(lambda s: s.running == 1)
    server.wait_for(lambda s: s.cancelled == cancelled + 2 and s.running == 0)
    stopped_at = stats.generated_tokens
    time.sleep(0.3)
    assert stats.generated_tokens == stopped_at < generated + 150
    metrics = httpx.get(f"{server.url}/metrics").text
    assert f'vsnap_cpu_requests_total{{outcome="cancelled"}} {cancelled + 2}\n' in metrics
    assert f"vsnap_cpu_generated_tokens_total {stopped_at}\n" in metrics
    assert "# TYPE vsnap_cpu_requests_running gauge\nvsnap_cpu_requests_running 0\n" in metrics


def test_a_full_queue_answers_503(model: cpu_model.TinyDecoder) -> None:
    served = _Server(model, max_running=1, max_waiting=1)
    try:
        served.release.clear()  # the worker holds its first step until told
        with httpx.Client(base_url=served.url, timeout=30) as client:
            def send(prompt: str) -> threading.Thread:
                thread = threading.Thread(target=client.post, args=("/v1/completions",),
                                          kwargs={"json": {"prompt": prompt, "max_tokens": 2}})
                thread.start()
                return thread

            threads = [send("a")]
            served.wait_for(lambda s: s.running == 1)
            threads.append(send("b"))
            served.wait_for(lambda s: s.waiting == 1)
            refused = client.post("/v1/completions", json={"prompt": "c", "max_tokens": 2})
            assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
            assert refused.json()["error"]["type"] == "server_busy"
            served.release.set()
            for thread in threads:
                thread.join(30)
            assert served.scheduler.stats.finished == 2 and served.scheduler.stats.rejected == 1
    finally:
        served.stop()
