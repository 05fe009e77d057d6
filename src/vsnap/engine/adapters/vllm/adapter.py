"""Real vLLM (AsyncLLM + its OpenAI app): on one CUDA GPU with sleep mode and weight reload, or on
vLLM's CPU backend.

CPU backend: there is no CUDA state and vLLM refuses sleep mode, so nothing is released: the
weights and the (small, see vllm.rules.CPU_KV_CACHE_BYTES) KV cache stay in the tree's memory,
in the image. prepare() computes the oracle and prebuilds the app; recover() has nothing to
refill; the launcher re-runs the oracle as on a GPU.

On CUDA:

prepare(): oracle, the weights file (weights/), a sleep/wake rehearsal (so a restore never
runs a path that was never run), then sleep level 2 (weights and KV cache released: little GPU
memory left to checkpoint).
recover(): wake the weights, stream them back from the image's weights file (or reload them
from the model's safetensors through vLLM's loader), wake the KV cache.
serve(): vLLM's own OpenAI app on the socket bound after activation.

Tensor parallelism (tensor_parallel_size 2, one worker process per GPU): every worker method
runs on each rank (results merged by merge_ranks; one weights file per rank). Before each sleep
the workers drop their CUDA graphs and destroy their NCCL communicators (vllm.tp); after each
wake they rebuild the communicators and capture the graphs again, in the rehearsal and at every
restore (``nccl_init_s``, ``graph_capture_s``). With one rank the same drop and recapture run
when vllm.rules.TP1_RECAPTURE_ENV is 1 in the capture's environment.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import time
import uuid
from pathlib import Path
from typing import Any

from vsnap.engine.adapters.base import EngineAdapter
from vsnap.protocol.control import Activation
from vsnap.protocol.errors import EngineError, OracleMismatch
from vsnap.protocol.oracle import Oracle, OracleSample, compare_oracles

from . import compat as vllm_compat
from . import config_rules as vllm_config_rules
from . import rules as vllm_rules
from .weights import extension as weights_extension
from .weights import layout as weights_layout


def _refuse(phase: str, refusals: list[vllm_rules.Refusal]) -> EngineError:
    return EngineError(phase, "UnsupportedConfiguration", "; ".join(map(str, refusals)),
                       hint="vsnap validate SPEC names each refused argument")


class RehearsalMismatch(Exception):
    """The capture's rehearsal did not reproduce the oracle: the mismatch and which of the model's
    state did not come back (the engine reports it as the capture's failure, in these words)."""

    def __init__(self, mismatch: OracleMismatch, changed: list[str], weights_source: str) -> None:
        where = "the weights file" if weights_source == "file" else "vLLM's reload from the model's files"
        if changed:
            shown = ", ".join(changed[:4]) + (f" and {len(changed) - 4} more" if len(changed) > 4 else "")
            account = f"after sleep and {where}, these did not come back: {shown}"
        else:
            account = (f"after sleep and {where} every parameter, buffer and tensor of the weights pool came "
                       "back: the state that differs is held outside them")
        self.message = f"the rehearsal's oracle differs ({mismatch.engine_message}); {account}"
        self.changed = changed
        super().__init__(self.message)


def changed_state(before: dict[str, int], after: dict[str, int]) -> list[str]:
    """Names whose checksum differs between two vsnap_fingerprint results (or that went missing)."""
    return [name for name, value in before.items() if after.get(name) != value]


# Deadlines of the tensor-parallel worker calls (a rank that fails while the other waits in a
# collective would otherwise hang the engine core); the engine's own wait adds RPC_MARGIN_S.
DISCONNECT_TIMEOUT_S = 120.0
BARRIER_TIMEOUT_S = 60.0  # vsnap_tp_reconnect's gloo barrier, inside its call
RECONNECT_TIMEOUT_S = 180.0
RECAPTURE_TIMEOUT_S = 300.0  # vLLM: "This usually takes 5~20 seconds"; the restore waits 600 s for recover
RPC_MARGIN_S = 30.0


def merge_ranks(results: list[dict[str, Any]]) -> dict[str, Any]:
    """One worker method's results, one dict per rank, as one: a single rank's as it is; else
    times (``*_s``) the slowest rank's (the ranks run side by side), other numbers summed (bytes,
    counts, rates ``*_per_s``), anything else rank 0's where all ranks agree, else each rank's
    after its name."""
    if len(results) <= 1:
        return dict(results[0]) if results else {}
    merged: dict[str, Any] = {}
    for key in dict.fromkeys(k for result in results for k in result):
        values = [result.get(key) for result in results]
        numbers = [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
        if len(numbers) == len(values):
            slowest = key.endswith("_s") and not key.endswith("_per_s")  # rates add up, like bytes
            merged[key] = max(numbers) if slowest else sum(numbers)
        elif all(v == values[0] for v in values):
            merged[key] = values[0]
        else:
            merged[key] = "; ".join(f"rank{rank} {value}" for rank, value in enumerate(values))
    return merged


def _report(values: dict[str, Any]) -> str:
    """Byte counts in MB, for the engine log."""
    return ", ".join(f"{k.removesuffix('_bytes')} {v / 1e6:.1f} MB" if k.endswith("_bytes") else f"{k} {v}"
                     for k, v in values.items())


class VllmAdapter(EngineAdapter):
    def __init__(self, launch: Any) -> None:
        super().__init__(launch)
        self.engine: Any = None
        self.args: Any = None
        self.app: Any = None  # vLLM's OpenAI app, built before the capture when possible
        # "file": weights come back from the image's weights file; "model": through vLLM's loader;
        # "image memory": the CPU backend, where they never left
        self.weights_source = "model"
        self.cuda = True
        self.tp = 1  # tensor_parallel_size: worker processes, one GPU each
        self.recapture = False  # drop CUDA graphs and NCCL before each sleep, rebuild after each wake
        self._unlocking: asyncio.Task[None] | None = None  # the weights file's unlocking, once serving

    async def build(self) -> None:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.usage.usage_lib import UsageContext
        from vllm.v1.engine.async_llm import AsyncLLM

        # import the serving stack now, so that it is in the image and not paid for at restore
        vllm_compat.server_module()

        self.cuda = vllm_rules.on_cuda()
        args, refusals = vllm_rules.parse_serve_args(self.launch.model, self.launch.serve_args, cuda=self.cuda)
        if args is None:
            raise _refuse("build engine", refusals)
        refusals = vllm_rules.argument_refusals(args)
        if refusals:
            raise _refuse("build engine", refusals)
        vllm_compat.get("validate_parsed_serve_args")(args)
        args.served_model_name = [self.launch.served_model_name]
        if not self.cuda:
            self.weights_source = "image memory"
        elif not args.worker_extension_cls:  # a user's extension wins (then: no weights file, vLLM's graph pool)
            args.worker_extension_cls = weights_extension.EXTENSION
            # the worker, spawned below, captures its CUDA graphs into the sleep allocator
            os.environ.setdefault(weights_extension.GRAPH_POOL_ENV, "sleep")
        self.tp = int(getattr(args, "tensor_parallel_size", 1) or 1)
        # argument_refusals (above) refused a user's worker extension wherever graphs are captured again
        self.recapture = self.cuda and vllm_rules.recaptures_graphs(self.tp)
        if self.tp > 1:  # for EngineCore and the workers spawned below (only with TP: one rank keeps its environment)
            os.environ.update(vllm_rules.TP_ENVIRONMENT)
        self.args = args
        engine_args = AsyncEngineArgs.from_cli_args(args)
        config = engine_args.create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)
        refusals = vllm_config_rules.config_refusals(config, is_cuda=self.cuda)
        if refusals:
            raise _refuse("build engine", refusals)
        for feature, support in vllm_config_rules.configuration_support(config):
            print(f"vsnap: configuration: {feature} ({support})", flush=True)
        self.engine = AsyncLLM.from_vllm_config(
            vllm_config=config,
            usage_context=UsageContext.OPENAI_API_SERVER,
            enable_log_requests=engine_args.enable_log_requests,
            disable_log_stats=engine_args.disable_log_stats,
        )

    @property
    def _ours(self) -> bool:
        """vLLM's worker carries vsnap's extension (weights.extension): the weights file, the graph
        pool, the stack limit and the tensor-parallel methods are there to call."""
        return bool(self.args.worker_extension_cls == weights_extension.EXTENSION)

    def _adapters(self) -> list[tuple[str, Any]]:
        """The LoRA adapters the server loaded at boot (``--lora-modules``): (name, LoRARequest).
        Known once the OpenAI app's state is built (_prebuild_app)."""
        models = getattr(getattr(self.app, "state", None), "openai_serving_models", None)
        return sorted(dict(getattr(models, "lora_requests", None) or {}).items())

    async def run_oracle(self) -> Oracle:
        """The spec's prompts through the base model, then the first prompt through each LoRA
        adapter loaded at boot (so the rehearsal and every restore check the adapters' state too)."""
        from vllm import SamplingParams

        jobs: list[tuple[str, str | None, Any]] = [(p, None, None) for p in self.launch.oracle_prompts]
        jobs += [(self.launch.oracle_prompts[0], name, request) for name, request in self._adapters()]
        samples = []
        for index, (prompt, model, lora_request) in enumerate(jobs):
            params = SamplingParams(temperature=0.0, max_tokens=self.launch.oracle_max_tokens,
                                    min_tokens=self.launch.oracle_max_tokens, ignore_eos=True, seed=0,
                                    logprobs=self.launch.oracle_top_k)
            final = None
            async for output in self.engine.generate(prompt, params, request_id=f"vsnap-oracle-{index}-{uuid.uuid4().hex}",
                                                     lora_request=lora_request):
                final = output
            if final is None:
                raise EngineError("oracle", "NoOutput", f"no output for oracle prompt {index}")
            completion = final.outputs[0]
            logprobs = [{str(token): float(lp.logprob) for token, lp in position.items()}
                        for position in (completion.logprobs or [])]
            samples.append(OracleSample(prompt=prompt, token_ids=list(completion.token_ids), logprobs=logprobs,
                                        text=completion.text, model=model))
        return Oracle(samples=samples)

    async def _sleep(self) -> None:
        """Sleep level 2, then release what the next wake rebuilds by itself. The rehearsal runs
        this too, so a restore wakes from exactly the state the capture checkpointed. With
        tensor parallelism (or the one-rank opt-in) the workers first drop their CUDA graphs and
        NCCL communicators, awake (vllm.tp)."""
        ours = self._ours
        if ours:  # no page of the weights file may stay locked into the checkpoint
            await self._rpc("vsnap_unlock_weights_file", False)
        disconnected = await self._rpc("vsnap_tp_disconnect", timeout=DISCONNECT_TIMEOUT_S) if self.recapture else {}
        if disconnected:
            print(f"vsnap: disconnected: {_report(disconnected)}", flush=True)
        tagged = await self._rpc("vsnap_before_sleep") if ours else {}
        await self.engine.sleep(level=2)
        if ours:
            released = await self._rpc("vsnap_release_memory")
            print(f"vsnap: after sleep: {_report({**tagged, **released})}", flush=True)

    async def _rpc_all(self, method: str, *args: Any, timeout: float | None = None) -> list[dict[str, Any]]:
        """``method`` on every worker (rank order), each result as a dict ({} for None). With a
        ``timeout`` the executor gives up after it, and this wait RPC_MARGIN_S later."""
        call = self.engine.collective_rpc(method, timeout=timeout, args=args)
        results = await (asyncio.wait_for(call, timeout + RPC_MARGIN_S) if timeout is not None else call)
        return [dict(result) if result else {} for result in results or []]

    async def _rpc(self, method: str, *args: Any, timeout: float | None = None) -> dict[str, Any]:
        return merge_ranks(await self._rpc_all(method, *args, timeout=timeout))

    def _weights_file_visible(self, weights_dir: str | None) -> bool:
        if self.weights_source != "file" or not weights_dir:
            return False
        missing = [name for name in map(weights_layout.file_name, range(self.tp)) if not Path(weights_dir, name).is_file()]
        if not missing:
            return True
        print(f"vsnap: {', '.join(missing)} of {weights_dir} not visible in the restored tree; reloading from the "
              "model's files", flush=True)
        return False

    async def recover(self, activation: Activation) -> dict[str, Any]:
        if not self.cuda:  # the CPU backend released nothing: weights and KV cache are in the image
            return {"weights_source": self.weights_source}
        return await self._wake(activation.weights_dir)

    async def _wake(self, weights_dir: str | None) -> dict[str, Any]:
        """Wake the weights, refill them, wake the KV cache. From the weights file, the KV cache
        is woken while the weights stream in (the file's bytes need no allocation)."""
        times: dict[str, Any] = {}
        if self._ours:  # before any kernel runs
            times.update(await self._rpc("vsnap_restore_stack_limit"))
        start = time.monotonic()
        await self.engine.wake_up(tags=["weights"])
        times["wake_weights_s"] = time.monotonic() - start
        start = time.monotonic()
        if self._weights_file_visible(weights_dir):
            await self.engine.collective_rpc("vsnap_start_loading_weights", args=(weights_dir,))
            await self.engine.wake_up(tags=["kv_cache"])
            times["wake_kv_cache_s"] = time.monotonic() - start
            times.update(await self._rpc("vsnap_finish_loading_weights"))
            times["reload_weights_s"] = time.monotonic() - start  # weights and KV cache, overlapped
            times["weights_source"] = "image weights file"
        else:
            await self.engine.collective_rpc("reload_weights")
            times["reload_weights_s"] = time.monotonic() - start
            times["weights_source"] = "model files"
            start = time.monotonic()
            await self.engine.wake_up(tags=["kv_cache"])
            times["wake_kv_cache_s"] = time.monotonic() - start
        if self.recapture:
            times.update(await self._reconnect())
        return times

    async def _reconnect(self) -> dict[str, float]:
        """After the wake: fresh NCCL communicators, then the CUDA graphs captured again on them
        (the graphs' dummy forwards need the weights and the KV cache mapped)."""
        reconnected = await self._rpc("vsnap_tp_reconnect", BARRIER_TIMEOUT_S, timeout=RECONNECT_TIMEOUT_S)
        captured = await self._rpc("vsnap_recapture_graphs", timeout=RECAPTURE_TIMEOUT_S)
        print(f"vsnap: reconnected: {_report({**reconnected, **captured})}", flush=True)
        return {"nccl_init_s": float(reconnected.get("nccl_init_s", 0.0)),
                "graph_capture_s": float(captured.get("graph_capture_s", 0.0))}

    async def _rehearse(self, oracle: Oracle, before: dict[str, int]) -> None:
        """Sleep, wake and reload as a restore will, then require the same oracle. On a mismatch
        the error names the tensors (parameters, buffers, the weights file's) that differ from
        ``before`` (their checksums when the oracle was computed)."""
        ours = self._ours
        await self._sleep()
        await self._wake(self.launch.weights_dir)
        try:
            compare_oracles(oracle, await self.run_oracle(), self.launch.oracle_tolerance)
        except OracleMismatch as mismatch:
            if not ours:
                raise
            after = await self._fingerprint()
            changed = changed_state(before, after) if before and after else ["(no checksums could be taken)"]
            raise RehearsalMismatch(mismatch, changed, self.weights_source) from None

    async def _fingerprint(self) -> dict[str, int]:
        """Checksums of the model's tensors (vsnap_fingerprint); {} if they cannot be taken: they
        only explain a failure, they must never cause one."""
        try:
            results = await self._rpc_all("vsnap_fingerprint")
            if len(results) == 1:
                return results[0]
            return {f"rank{rank} {name}": value for rank, sums in enumerate(results) for name, value in sums.items()}
        except Exception as exc:
            print(f"vsnap: could not take the tensors' checksums ({type(exc).__name__}: {exc})", flush=True)
            return {}

    async def prepare(self) -> Oracle:
        await self._prebuild_app()  # first, awake: it loads the LoRA adapters given at boot, which the oracle asks
        oracle = await self.run_oracle()
        if not self.cuda:  # nothing to release or rehearse: the image holds the engine as it is
            self._freeze_gc_heap()
            return oracle
        weights_dir = self.launch.weights_dir
        if weights_dir and self._ours:
            try:
                saved = await self._rpc("vsnap_save_weights", *self._save_weights_args(weights_dir))
                print(f"vsnap: weights file written: {saved}", flush=True)
                self.weights_source = "file"
            except Exception as exc:  # e.g. two tensors of the weights pool that overlap
                self._drop_weights_file(f"could not write the weights file ({type(exc).__name__}: {exc})")
        # Rehearse the exact recovery path once before the capture: a restore must not be the
        # first time sleep level 2, weight reload and wake run in this process.
        before = await self._fingerprint() if self._ours else {}
        try:
            await self._rehearse(oracle, before)
        except RehearsalMismatch as mismatch:
            if self.weights_source != "file" or getattr(self.args, "enable_lora", False):
                raise  # with LoRA vLLM's reload cannot work at all (0.26): the file's account is the one to read
            # The weights pool's tensors do not hold all of this model's loaded state: reload through vLLM.
            self._drop_weights_file(f"the weights file did not reproduce the oracle ({mismatch.message})")
            await self._rehearse(oracle, before)
        if self.weights_source == "file":  # the rehearsal's oracle may have moved adapters between slots
            print(f"vsnap: weights file refreshed: {await self._rpc('vsnap_refresh_weights', weights_dir)}", flush=True)
        await self._sleep()
        self._freeze_gc_heap()
        return oracle

    def _save_weights_args(self, weights_dir: str) -> tuple[str, ...]:
        """vsnap_save_weights' arguments: the weights file's directory and, with weights by reference
        (weights_extension.BY_REFERENCE_ENV=1 in the capture's environment; opt-in), the model
        directory whose safetensors files the weights file may refer to."""
        if os.environ.get(weights_extension.BY_REFERENCE_ENV) == "1":
            return weights_dir, self.launch.model
        return (weights_dir,)

    @staticmethod
    def _freeze_gc_heap() -> None:
        """vLLM's app freezes the GC heap when it starts serving: a full collection of every object,
        ~0.45 s for this process. Done now, it is in the image; at restore only objects made since
        are collected."""
        from vllm.utils.gc_utils import freeze_gc_heap

        freeze_gc_heap()

    def _drop_weights_file(self, why: str) -> None:
        """Capture without the weights file: restores reload through vLLM's loader."""
        print(f"vsnap: {why}; restores will reload from the model's files", flush=True)
        shutil.rmtree(self.launch.weights_dir, ignore_errors=True)  # type: ignore[arg-type]
        self.weights_source = "model"

    async def _prebuild_app(self) -> None:
        """Build vLLM's FastAPI app and its serving state now, so the image holds it and a restore
        does not spend most of a second on it. On any failure, serve() builds it as vLLM does."""
        build_app, init_app_state = vllm_compat.get("build_app"), vllm_compat.get("init_app_state")
        try:
            tasks = await self.engine.get_supported_tasks()
            app = build_app(self.args, tasks, self.engine.model_config)
            await init_app_state(self.engine, app.state, self.args, tasks)
            import uvicorn

            uvicorn.Config(app).load()  # imports uvicorn's protocol modules now, not after restore
            self.app = app
        except Exception as exc:  # not fatal: the slower path still works
            if getattr(self.args, "lora_modules", None):  # the adapters would fail again at every restore
                raise EngineError("prepare", "LoraAdapterFailed",
                                  f"vLLM could not load the LoRA adapters given at boot ({type(exc).__name__}: {exc})",
                                  hint="check serve.lora_modules and max_lora_rank") from None
            print(f"vsnap: could not prebuild the OpenAI app ({type(exc).__name__}: {exc}); "
                  "it will be built after restore", flush=True)

    async def serve(self, sock: socket.socket) -> None:
        from vllm import envs

        serve_http, build_and_serve = vllm_compat.get("serve_http"), vllm_compat.get("build_and_serve")

        host, port = sock.getsockname()[:2]
        self.args.host, self.args.port = host, port
        if self.cuda and self._ours:
            self._unlocking = asyncio.get_running_loop().create_task(self._unlock_weights_file())
        if self.app is not None:
            asyncio.get_running_loop().create_task(self._report_started(time.monotonic()))
        if self.app is None:
            shutdown = await build_and_serve(self.engine, f"http://{host}:{port}", sock, self.args)
        else:  # the same settings build_and_serve gives uvicorn
            args = self.args
            shutdown = await serve_http(
                self.app, sock=sock, enable_ssl_refresh=args.enable_ssl_refresh, host=host, port=port,
                log_level=args.uvicorn_log_level, access_log=not args.disable_uvicorn_access_log,
                timeout_keep_alive=envs.VLLM_HTTP_TIMEOUT_KEEP_ALIVE, ssl_keyfile=args.ssl_keyfile,
                ssl_certfile=args.ssl_certfile, ssl_ca_certs=args.ssl_ca_certs, ssl_cert_reqs=args.ssl_cert_reqs,
                ssl_ciphers=args.ssl_ciphers, h11_max_incomplete_event_size=args.h11_max_incomplete_event_size,
                h11_max_header_count=args.h11_max_header_count)
        await shutdown

    async def _unlock_weights_file(self) -> None:
        """The weights file's pages the wake left locked, unlocked in the workers' background,
        beside the first requests (vsnap_unlock_weights_file). A failure is said, not raised: the
        pages stay locked until the engine exits."""
        try:
            await self._rpc("vsnap_unlock_weights_file", True)
        except Exception as exc:
            print(f"vsnap: could not unlock the weights file ({type(exc).__name__}: {exc})", flush=True)

    async def _report_started(self, since: float) -> None:
        """Log when uvicorn accepts requests (the "http_start" part of a restore's serve phase)."""
        server = None
        while server is None or not server.started:
            await asyncio.sleep(0.002)
            server = getattr(self.app.state, "server", None)
            if time.monotonic() - since > 60:
                return
        print(f"vsnap: uvicorn started {time.monotonic() - since:.3f} s after the socket arrived", flush=True)

    async def shutdown(self) -> None:
        engine, self.engine = self.engine, None
        if engine is not None:
            engine.shutdown()
