"""The engine tree's startup coroutine: build, prepare, barrier, activation, recover, bind, serve.

No TCP socket exists before activation: the HTTP socket is bound only after the oracle has
passed again, on the host and port the activation names.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from pathlib import Path

from vsnap.protocol import control
from vsnap.protocol.control import Activation, LaunchConfig, Ready, Standby, Status
from vsnap.protocol.errors import ControlProtocolError, PhaseTimeout
from vsnap.protocol.oracle import compare_oracles

from .adapters import make_adapter
from .heap import release_heap


async def wait_for_activation(control_dir: Path, timeout_s: float) -> Activation:
    """Wait for activation.json. Clock jumps across checkpoint/restore do not count (see _control).
    A standby (standby.json beside it, written before CRIU restored this tree) waits without a
    timeout: `vsnap activate` may come hours later, and `vsnap stop` or its owner's death end it."""
    budget = control.WaitBudget(timeout_s)
    while True:
        activation = control.read_message(control_dir, control.ACTIVATION, Activation)
        if activation is not None:
            return activation
        if budget.expired() and control.read_message(control_dir, control.STANDBY, Standby) is None:
            raise PhaseTimeout("wait for activation", timeout_s)
        await asyncio.sleep(0.01)
        budget.tick()


async def _receive_socket(control_dir: Path, launch: LaunchConfig, detail: dict, times: dict[str, float]) -> socket.socket:
    """Report "validated", then take the HTTP socket the orchestrator bound on the host.

    The tree has its own network namespace, so the orchestrator binds host:port and passes the
    socket in (SCM_RIGHTS), only now that the oracle has passed; then report "serving".
    """
    handoff = control.open_handoff(control_dir)
    handoff.setblocking(False)  # accepted by the event loop, so that a SIGTERM cancels the wait at once
    control.write_message(control_dir, control.STATUS, Status(state="validated", times=times, detail=detail))
    try:
        try:
            conn, _ = await asyncio.wait_for(asyncio.get_running_loop().sock_accept(handoff), launch.timeout_s)
        except asyncio.TimeoutError:
            raise PhaseTimeout("wait for the HTTP socket", launch.timeout_s) from None
        with conn:
            sock = control.take_listener(conn)
    finally:
        handoff.close()
        (control_dir / control.LISTENER).unlink(missing_ok=True)
    times["bound"] = time.time()
    control.write_message(control_dir, control.STATUS, Status(
        state="serving", times=times, detail={**detail, "port": sock.getsockname()[1]}))
    return sock


async def run_engine(control_dir: Path) -> None:
    launch = control.read_message(control_dir, control.LAUNCH, LaunchConfig)
    if launch is None:
        raise ControlProtocolError(control_dir / control.LAUNCH, "missing")
    times: dict[str, float] = {"start": time.time()}
    adapter = make_adapter(launch)
    sock: socket.socket | None = None
    phase = "build engine"
    try:
        await adapter.build()
        times["built"] = time.time()
        if launch.mode == "serve":  # a plain cold start: no oracle, no barrier
            sock = await _receive_socket(control_dir, launch, {}, times)
            await adapter.serve(sock)
            return
        phase = "prepare"
        oracle = await adapter.prepare()
        release_heap()  # freed memory would otherwise be written into the image
        times["prepared"] = time.time()
        phase = "capture barrier"
        control.write_message(control_dir, control.READY, Ready(pid=os.getpid(), oracle=oracle, times=times, **control.stamp()))
        activation = await wait_for_activation(control_dir, launch.timeout_s)
        # From here on the tree may have been restored: wall-clock times only.
        phase = "recover"
        recovery: dict[str, float] = {"activated": time.time()}
        control.write_message(control_dir, control.STATUS, Status(state="recovering", times=recovery))
        detail = await adapter.recover(activation)
        recovery["recovered"] = time.time()
        again = await adapter.run_oracle()
        recovery["oracle_checked"] = time.time()
        worst = compare_oracles(oracle, again, launch.oracle_tolerance)
        phase = "serve"
        sock = await _receive_socket(control_dir, launch, {**detail, "oracle_max_abs_diff": worst}, recovery)
        await adapter.serve(sock)
        control.write_message(control_dir, control.STATUS, Status(state="stopped"))
    except BaseException as error:
        try:
            control.write_message(control_dir, control.ERROR, control.error_report(phase, error))
        except Exception:
            pass  # the tree's exit still tells the host; the error itself is what propagates
        raise
    finally:
        if sock is not None:
            sock.close()
        await adapter.shutdown()
