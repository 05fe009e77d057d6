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

from .. import _control as control
from .._control import Activation, LaunchConfig, Ready, Status
from .._errors import ControlProtocolError, PhaseTimeout
from .._oracle import compare_oracles
from .adapters.base import make_adapter


async def wait_for_activation(control_dir: Path, timeout_s: float) -> Activation:
    """Wait for activation.json. Clock jumps across checkpoint/restore do not count (see _control)."""
    budget = control.WaitBudget(timeout_s)
    while True:
        activation = control.read_message(control_dir, control.ACTIVATION, Activation)
        if activation is not None:
            return activation
        if budget.expired():
            raise PhaseTimeout("wait for activation", timeout_s)
        await asyncio.sleep(0.01)
        budget.tick()


def bind_server_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(256)
    except OSError:
        sock.close()
        raise
    sock.setblocking(False)
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
        phase = "prepare"
        oracle = await adapter.prepare()
        times["prepared"] = time.time()
        phase = "capture barrier"
        control.write_message(control_dir, control.READY, Ready(pid=os.getpid(), oracle=oracle, times=times))
        activation = await wait_for_activation(control_dir, launch.timeout_s)
        # From here on the tree may have been restored: wall-clock times only.
        phase = "recover"
        recovery: dict[str, float] = {"activated": time.time()}
        control.write_message(control_dir, control.STATUS, Status(state="recovering", times=recovery))
        detail = await adapter.recover()
        recovery["recovered"] = time.time()
        again = await adapter.run_oracle()
        recovery["oracle_checked"] = time.time()
        worst = compare_oracles(oracle, again, launch.oracle_tolerance)
        control.write_message(control_dir, control.STATUS, Status(
            state="validated", times=recovery, detail={**detail, "oracle_max_abs_diff": worst}))
        phase = "serve"
        sock = bind_server_socket(activation.host, activation.port)
        port = sock.getsockname()[1]
        recovery["bound"] = time.time()
        control.write_message(control_dir, control.STATUS, Status(
            state="serving", times=recovery, detail={**detail, "oracle_max_abs_diff": worst, "port": port}))
        await adapter.serve(sock)
        control.write_message(control_dir, control.STATUS, Status(state="stopped"))
    except BaseException as error:
        report = control.error_report(phase, error)
        try:
            control.write_message(control_dir, control.ERROR, report)
        except Exception:
            pass
        raise
    finally:
        if sock is not None:
            sock.close()
        await adapter.shutdown()
