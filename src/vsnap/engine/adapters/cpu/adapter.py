"""The built-in CPU engine's frontend side: the adapter the launcher drives, and the HTTP server's engine.

The same process shape as vLLM: the frontend (this process) owns the HTTP socket, the
scheduler and the oracle; the spawned worker (worker.py) owns the model; they talk over IPC (a
multiprocessing pipe, one call at a time). prepare() drops the weights in the worker;
recover() reloads them from the safetensors file.

Every generation, the oracle's included, goes through one ``Scheduler`` (scheduler.py), which
asks the worker for one step of every running sequence at a time: so the oracle runs exactly
the arithmetic that serves requests, and concurrent requests take turns. Limits: serve
argument ``max_num_seqs`` (vLLM's name; default 8; the spec does not pass it yet) sequences
run at once, ``MAX_WAITING`` more wait; ``max_model_len`` (default 256) bounds prompt plus
completion.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import socket
import threading
import time
from typing import Any

from vsnap.engine.adapters.base import EngineAdapter
from vsnap.protocol.control import Activation
from vsnap.protocol.errors import EngineError
from vsnap.protocol.oracle import Oracle, OracleSample

from . import model as cpu_model
from .scheduler import Scheduler

MAX_WAITING = 64  # requests queued for a running slot before new ones get HTTP 503


class CpuAdapter(EngineAdapter):
    def __init__(self, launch: Any) -> None:
        super().__init__(launch)
        self._conn: Any = None
        self._process: multiprocessing.process.BaseProcess | None = None
        self._lock = threading.Lock()  # one request on the pipe at a time
        self.max_len = int(launch.serve_args.get("max_model_len", 256))
        self.scheduler = Scheduler(self._step, max_len=self.max_len, max_waiting=MAX_WAITING,
                                   max_running=int(launch.serve_args.get("max_num_seqs", 8)))

    # --- IPC -----------------------------------------------------------------------------
    def _call_blocking(self, verb: str, *args: Any) -> Any:
        with self._lock:
            if self._conn is None:
                raise EngineError("serve", "WorkerGone", "the worker is not running")
            try:
                self._conn.send((verb, *args))
                reply = self._conn.recv()
            except (EOFError, OSError) as exc:
                raise EngineError("serve", "WorkerGone", f"the worker died ({exc or type(exc).__name__})") from None
        if reply[0] == "ok":
            return reply[1]
        _, type_name, message = reply
        if type_name == "ValueError":
            raise ValueError(message)
        raise EngineError(verb, type_name, message)

    async def call(self, verb: str, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(None, self._call_blocking, verb, *args)

    async def _step(self, batch: list[tuple[list[int], int]]) -> list[cpu_model.Step]:
        return await self.call("step", batch)

    # --- verbs ---------------------------------------------------------------------------
    async def build(self) -> None:
        # Import the HTTP stack now, so that it is in the image and not paid for at restore.
        import uvicorn  # noqa: F401

        from . import connections, server  # noqa: F401
        from .worker import serve_pipe

        context = multiprocessing.get_context("spawn")
        parent, child = context.Pipe()
        # The event is a POSIX semaphore in /dev/shm, unlinked at once but held open: the image
        # carries a CRIU link-remap file for it, as vLLM's images do.
        self._loaded = context.Event()
        self._process = context.Process(target=serve_pipe, args=(child, self.launch.model, self._loaded),
                                        name="vsnap-cpu-worker")
        self._process.start()
        child.close()
        self._conn = parent
        loop = asyncio.get_running_loop()
        deadline = time.monotonic() + 120
        while not await loop.run_in_executor(None, self._loaded.wait, 0.2):
            if not self._process.is_alive():
                raise EngineError("build engine", "WorkerDied",
                                  f"the worker exited with code {self._process.exitcode} while loading the model")
            if time.monotonic() > deadline:
                raise EngineError("build engine", "WorkerTimeout", "the worker did not load the model within 120 s")
        if await self.call("ping") != "pong":
            raise EngineError("build engine", "WorkerProtocol", "the worker did not answer ping")

    async def run_oracle(self) -> Oracle:
        samples = []
        for prompt in self.launch.oracle_prompts:  # one at a time, as the adapter contract says
            sequence = self.scheduler.submit(cpu_model.encode(prompt), self.launch.oracle_max_tokens,
                                             self.launch.oracle_top_k)
            await sequence.result()
            samples.append(OracleSample(prompt=prompt, token_ids=sequence.token_ids, logprobs=sequence.logprobs,
                                        text=cpu_model.decode(sequence.token_ids)))
        return Oracle(samples=samples)

    async def prepare(self) -> Oracle:
        oracle = await self.run_oracle()
        await self.call("drop_weights")
        return oracle

    async def recover(self, activation: Activation) -> dict[str, Any]:
        start = time.monotonic()
        loaded = await self.call("load_weights")
        return {"reload_weights_s": time.monotonic() - start, "weight_bytes": loaded, "weights_source": "model files"}

    async def serve(self, sock: socket.socket) -> None:
        import uvicorn

        from .connections import server_options  # imported by build(), before the capture: these only name them
        from .server import build_app

        app = build_app(self.scheduler, self.launch.served_model_name)
        # A stream still open at shutdown is cut after 5 s, not waited for.
        # Idle keep-alive connections are closed after 5 s. The connections held are bounded below
        # the descriptor limit (connections.py: the idlest goes first), not by uvicorn's
        # limit_concurrency: it counts connections that never sent a request, so a few hundred idle
        # clients would make the server answer 503 to everyone (found by the second hostile pass).
        # A request's first byte, headers and body have deadlines there too (uvicorn has none).
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off",
                                timeout_graceful_shutdown=5, timeout_keep_alive=5, **server_options())
        await uvicorn.Server(config).serve(sockets=[sock])

    async def shutdown(self) -> None:
        await self.scheduler.close(EngineError("serve", "EngineStopped", "the engine is shutting down"))
        process, self._process = self._process, None
        if process is None:
            return
        try:
            await asyncio.wait_for(self.call("exit"), timeout=5)
        except Exception:
            pass
        process.join(timeout=5)
        if process.is_alive():
            process.kill()
            process.join(timeout=5)
        if self._conn is not None:
            self._conn.close()
            self._conn = None
