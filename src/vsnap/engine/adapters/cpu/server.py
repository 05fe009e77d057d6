"""OpenAI-style HTTP API of the CPU engine: /v1/completions, /v1/models, /health."""

from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from . import model as cpu_model

if TYPE_CHECKING:
    from .adapter import CpuAdapter


class CompletionRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str
    max_tokens: int = Field(default=16, ge=1, le=1024)
    temperature: float | None = None
    logprobs: int | None = Field(default=None, ge=0, le=20)


def _error(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse(status_code=status, content={"error": {"message": message, "type": kind, "code": status}})


def build_app(engine: "CpuAdapter", served_model_name: str) -> FastAPI:
    app = FastAPI(title="vsnap cpu engine", docs_url=None, redoc_url=None)
    created = int(time.time())

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": served_model_name, "object": "model", "created": created,
                                            "owned_by": "vsnap", "max_model_len": engine.max_len}]}

    @app.post("/v1/completions", response_model=None)
    async def completions(request: CompletionRequest) -> Any:
        if request.model not in (None, served_model_name):
            return _error(404, f"model {request.model!r} does not exist; this server serves {served_model_name!r}")
        if request.temperature not in (None, 0, 0.0):
            return _error(400, "the cpu engine decodes greedily: send temperature 0 or leave it out")
        top_k = max(request.logprobs or 0, 1)
        try:
            out = await engine.generate(request.prompt, request.max_tokens, top_k)
        except ValueError as exc:
            return _error(400, str(exc))
        ids: list[int] = out["token_ids"]
        choice: dict[str, Any] = {
            "index": 0,
            "text": cpu_model.decode(ids),
            "token_ids": ids,
            "logprobs": None,
            "finish_reason": "length",
        }
        if request.logprobs is not None:
            choice["logprobs"] = {
                "tokens": [cpu_model.token_text(t) for t in ids],
                "token_logprobs": [top[str(t)] for t, top in zip(ids, out["logprobs"])],
                "top_logprobs": [
                    {cpu_model.token_text(int(k)): v for k, v in list(top.items())[: request.logprobs]}
                    for top in out["logprobs"]
                ],
            }
        return {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": served_model_name,
            "choices": [choice],
            "usage": {"prompt_tokens": out["prompt_tokens"], "completion_tokens": len(ids),
                      "total_tokens": out["prompt_tokens"] + len(ids)},
        }

    return app
