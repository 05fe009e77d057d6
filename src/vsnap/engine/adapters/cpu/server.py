"""OpenAI-style HTTP API of the CPU engine: /v1/completions, /v1/chat/completions, /v1/models,
/health, /metrics.

Contract: the answers have OpenAI's shapes (plus ``token_ids`` in each choice, as vLLM's
``return_token_ids`` gives them); ``stream: true`` sends server-sent events, one
``data: {chunk}`` per token (its text, its id and, when asked, its logprobs), the last one with
``finish_reason``, then a usage chunk if ``stream_options.include_usage``, then
``data: [DONE]``. A streamed answer has exactly the content of the plain one: both are built
from the same tokens by the same functions, and the text of a byte that does not end a UTF-8
character is sent with the byte that does (model.TextStream).

A request is refused at once with 400 (does not fit max_model_len, sampling asked for: the
engine decodes greedily), 404 (another model) or 503 (the queue is full, scheduler.py). A client
that goes away stops its generation before the next step: a stream sees it as the disconnect
that cancels the response; a plain request has a task waiting for it beside the result.

Bounded input: a POST body must say its length (411 otherwise) and hold at most MAX_BODY_BYTES
(413), checked before a byte is read; a body that does not validate gets 400 in OpenAI's shape,
naming the fields but never echoing their values (which may be huge, NaN or not encodable). The
headers and the body must arrive within a deadline (connections.py, REQUEST_S from the request's
first byte): a client that stops halfway, or drips, has its connection closed.

/metrics (Prometheus text) shows the scheduler's counters: requests running and waiting,
finished, cancelled, rejected, failed, worker steps and generated tokens.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Annotated, Any, AsyncIterator, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from . import model as cpu_model
from .scheduler import Scheduler, Sequence, SequenceState, ServerBusy

MAX_TEXT = 16384  # characters in a prompt or a message; more can never fit max_model_len (4096 at most)
MAX_BODY_BYTES = 1 << 20  # 256 messages of MAX_TEXT characters fit; nothing larger is read


class BodyLimit:
    """ASGI middleware: a POST must send Content-Length, at most MAX_BODY_BYTES, or it is answered
    411 / 413 before its body is read (the server would otherwise buffer any size in memory)."""

    def __init__(self, app: Any, limit: int = MAX_BODY_BYTES) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope.get("method") == "POST":
            length = dict(scope.get("headers") or []).get(b"content-length")
            status, message = 0, ""
            if length is None or not length.isdigit():
                status, message = 411, "send the request body with a Content-Length"
            elif int(length) > self.limit:
                status, message = 413, f"the request body holds {int(length)} bytes; at most {self.limit} are read"
            if status:
                await _error(status, message)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False


class _Sampling(BaseModel):
    """What both endpoints share. Unknown fields are ignored, as OpenAI's clients send many."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    temperature: float | None = None
    n: int = 1
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None


class CompletionRequest(_Sampling):
    prompt: str = Field(max_length=MAX_TEXT)
    max_tokens: int = Field(default=16, ge=1, le=4096)
    logprobs: int | None = Field(default=None, ge=0, le=20)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text"]
    text: str = Field(max_length=MAX_TEXT)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str = Field(max_length=32)
    content: Annotated[str, Field(max_length=MAX_TEXT)] | Annotated[list[TextPart], Field(max_length=256)]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1, max_length=256)
    max_tokens: int | None = Field(default=None, ge=1, le=4096)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=4096)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)


def _error(status: int, message: str, kind: str = "invalid_request_error",
           headers: dict[str, str] | None = None) -> JSONResponse:
    safe = message.encode("utf-8", "backslashreplace").decode("utf-8")  # a lone surrogate cannot be sent
    return JSONResponse(status_code=status, headers=headers,
                        content={"error": {"message": safe, "type": kind, "code": status}})


def _invalid_body(errors: list[dict[str, Any]]) -> JSONResponse:
    """400 naming each invalid field and why, without the values (huge, NaN, not encodable)."""
    parts = [f"{'.'.join(str(p) for p in e.get('loc', ()) if p != 'body') or 'body'}: {e.get('msg', 'invalid')}"
             for e in errors[:8]]
    return _error(400, "invalid request: " + "; ".join(parts)[:2000])


def _refusal(request: _Sampling, served_model_name: str) -> JSONResponse | None:
    if request.model not in (None, served_model_name):
        return _error(404, f"model {request.model!r} does not exist; this server serves {served_model_name!r}")
    if request.temperature not in (None, 0, 0.0):
        return _error(400, "the cpu engine decodes greedily: send temperature 0 or leave it out")
    if request.n != 1:
        return _error(400, "the cpu engine returns one choice per request: send n 1 or leave it out")
    if request.stop:
        return _error(400, "the cpu engine does not support stop sequences: leave stop out")
    return None


# --- the pieces of an answer, one function each so that streamed and plain answers agree ---

def completion_logprobs(ids: list[int], tops: list[dict[str, float]], count: int) -> dict[str, Any]:
    return {
        "tokens": [cpu_model.token_text(t) for t in ids],
        "token_logprobs": [top[str(t)] for t, top in zip(ids, tops)],
        "top_logprobs": [{cpu_model.token_text(int(k)): v for k, v in list(top.items())[:count]} for top in tops],
    }


def _token_bytes(token: int) -> list[int]:
    return [token] if token < 256 else []


def chat_logprobs(ids: list[int], tops: list[dict[str, float]], count: int) -> dict[str, Any]:
    return {"content": [
        {"token": cpu_model.token_text(t), "logprob": top[str(t)], "bytes": _token_bytes(t),
         "top_logprobs": [{"token": cpu_model.token_text(int(k)), "logprob": v, "bytes": _token_bytes(int(k))}
                          for k, v in list(top.items())[:count]]}
        for t, top in zip(ids, tops)
    ]}


def usage(sequence: Sequence) -> dict[str, int]:
    prompt, completion = len(sequence.prompt_ids), len(sequence.token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def sse(data: dict[str, Any] | str) -> str:
    """One server-sent event; JSON written as JSONResponse writes it (no NaN, compact)."""
    if not isinstance(data, str):
        data = json.dumps(data, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    return f"data: {data}\n\n"


class _Answer:
    """Shapes one request's answer: the plain body, or its stream of chunk bodies."""

    def __init__(self, kind: Literal["completion", "chat"], served_model_name: str, logprobs: int | None) -> None:
        self.kind, self.logprobs = kind, logprobs
        prefix, self.object = ("cmpl", "text_completion") if kind == "completion" else ("chatcmpl", "chat.completion")
        self.head = {"id": f"{prefix}-{uuid.uuid4().hex}", "object": self.object, "created": int(time.time()),
                     "model": served_model_name}

    def _logprobs(self, ids: list[int], tops: list[dict[str, float]]) -> dict[str, Any] | None:
        if self.logprobs is None:
            return None
        shape = completion_logprobs if self.kind == "completion" else chat_logprobs
        return shape(ids, tops, self.logprobs)

    def _choice(self, text: str, ids: list[int], tops: list[dict[str, float]], finish: str | None,
                delta: bool) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0}
        if self.kind == "completion":
            choice["text"] = text
        elif delta:
            choice["delta"] = {"content": text}
        else:
            choice["message"] = {"role": "assistant", "content": text}
        return {**choice, "token_ids": ids, "logprobs": self._logprobs(ids, tops), "finish_reason": finish}

    def body(self, sequence: Sequence) -> dict[str, Any]:
        choice = self._choice(cpu_model.decode(sequence.token_ids), sequence.token_ids, sequence.logprobs,
                              "length", delta=False)
        return {**self.head, "choices": [choice], "usage": usage(sequence)}

    async def chunks(self, sequence: Sequence, include_usage: bool) -> AsyncIterator[str]:
        stream_object = "chat.completion.chunk" if self.kind == "chat" else self.object
        head = {**self.head, "object": stream_object}
        if self.kind == "chat":  # OpenAI's first chat chunk names the role
            yield sse({**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                            "logprobs": None, "finish_reason": None}]})
        text = cpu_model.TextStream()
        sent = 0
        try:
            async for token, top in sequence.stream():
                piece = text.push(token)
                sent += 1
                last = sent == sequence.max_tokens
                if last:
                    piece += text.flush()
                yield sse({**head, "choices": [self._choice(piece, [token], [top], "length" if last else None,
                                                            delta=True)]})
        except Exception as exc:  # the worker failed mid-stream: say so in the stream, then end it
            yield sse({"error": {"message": str(exc), "type": "internal_error", "code": 500}})
        else:
            if include_usage:
                yield sse({**head, "choices": [], "usage": usage(sequence)})
        yield sse("[DONE]")


class _SequenceStream(StreamingResponse):
    """A stream that cancels its sequence however it ends: finished, client gone, server stopping."""

    def __init__(self, sequence: Sequence, content: AsyncIterator[str]) -> None:
        super().__init__(content, media_type="text/event-stream", headers={"cache-control": "no-cache"})
        self.sequence = sequence

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.sequence.cancel()  # no-op once finished


async def _disconnected(request: Request) -> None:
    """Returns when the client closes its connection (the body is read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _result_unless_gone(sequence: Sequence, request: Request) -> Sequence | None:
    """The finished sequence, or None (and the sequence cancelled) if the client went away first."""
    result = asyncio.ensure_future(sequence.result())
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({result, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not result.done():
            sequence.cancel()
            result.cancel()
    if result.cancelled() or sequence.state is SequenceState.CANCELLED:
        return None
    return result.result()  # raises the worker's error, if it failed


def _metrics(scheduler: Scheduler) -> str:
    stats = scheduler.stats
    rows: list[tuple[str, str, str, list[tuple[str, int]]]] = [
        ("vsnap_cpu_requests_running", "gauge", "Requests generating now.", [("", stats.running)]),
        ("vsnap_cpu_requests_waiting", "gauge", "Requests queued for a running slot.", [("", stats.waiting)]),
        ("vsnap_cpu_requests_total", "counter", "Requests that ended, by outcome.",
         [('{outcome="finished"}', stats.finished), ('{outcome="cancelled"}', stats.cancelled),
          ('{outcome="rejected"}', stats.rejected), ('{outcome="failed"}', stats.failed)]),
        ("vsnap_cpu_steps_total", "counter", "Worker steps (one token for each running request).",
         [("", stats.steps)]),
        ("vsnap_cpu_generated_tokens_total", "counter", "Tokens the worker computed.",
         [("", stats.generated_tokens)]),
    ]
    lines = []
    for name, kind, help_text, samples in rows:
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
        lines += [f"{name}{labels} {value}" for labels, value in samples]
    return "\n".join(lines) + "\n"


def build_app(scheduler: Scheduler, served_model_name: str) -> FastAPI:
    app = FastAPI(title="vsnap cpu engine", docs_url=None, redoc_url=None)
    app.add_middleware(BodyLimit)
    created = int(time.time())

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _invalid_body(list(exc.errors()))

    async def answer(body: _Sampling, request: Request, answer: _Answer, prompt: str, max_tokens: int,
                     top_k: int) -> Response:
        try:
            sequence = scheduler.submit(cpu_model.encode(prompt), max_tokens, top_k)
        except ValueError as exc:
            return _error(400, str(exc))
        except ServerBusy as exc:
            return _error(503, str(exc), "server_busy", headers={"retry-after": "1"})
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            return _SequenceStream(sequence, answer.chunks(sequence, include_usage))
        try:
            finished = await _result_unless_gone(sequence, request)
        except Exception as exc:
            return _error(500, str(exc), "internal_error")
        if finished is None:
            return Response(status_code=499)  # nginx's "client closed request": nobody reads it
        return JSONResponse(answer.body(finished))

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(_metrics(scheduler), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": served_model_name, "object": "model", "created": created,
                                            "owned_by": "vsnap", "max_model_len": scheduler.max_len}]}

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        refusal = _refusal(body, served_model_name)
        if refusal is not None:
            return refusal
        shape = _Answer("completion", served_model_name, body.logprobs)
        return await answer(body, request, shape, body.prompt, body.max_tokens, max(body.logprobs or 0, 1))

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(body: ChatRequest, request: Request) -> Response:
        refusal = _refusal(body, served_model_name)
        if refusal is not None:
            return refusal
        try:
            prompt = cpu_model.chat_prompt([(m.role, m.text()) for m in body.messages])
        except ValueError as exc:
            return _error(400, str(exc))
        count = (body.top_logprobs or 0) if body.logprobs else None
        shape = _Answer("chat", served_model_name, count)
        max_tokens = body.max_completion_tokens or body.max_tokens or 16
        return await answer(body, request, shape, prompt, max_tokens, max(count or 0, 1))

    return app
