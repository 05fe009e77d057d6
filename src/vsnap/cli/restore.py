"""vsnap restore IMAGE"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, Optional

import typer

if TYPE_CHECKING:
    from vsnap.ops.bringup import RestoredServer

from . import _app as app
from . import _render, error_boundary

INTERRUPTS = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}  # each ends a restore (error_boundary)


@app.command(help="Restore IMAGE, prove it with the oracle, then serve on --host/--port. "
                  "Foreground by default (Ctrl-C stops it and leaves nothing running). With --standby: "
                  "restore the processes only (CUDA state checkpointed, no GPU memory, no port) and let "
                  "`vsnap activate INSTANCE` serve them.")
@error_boundary
def restore(
    image: Path = typer.Argument(..., help="image directory"),
    host: str = typer.Option("127.0.0.1", "--host", help="address to serve on"),
    port: int = typer.Option(8000, "--port", min=0, max=65535, help="port to serve on (0: any free port)"),
    gpu: Optional[str] = typer.Option(None, "--gpu", help="GPU index or UUID (vLLM images; a tensor-parallel image "
                                                  "takes one per rank: --gpu 0,1; default: the captured GPUs, else "
                                                  "the first of their model with enough free memory)"),
    detach: bool = typer.Option(False, "--detach", help="leave the server running and print its pid"),
    rehash: bool = typer.Option(False, "--rehash", help="hash every image file, even those this host "
                                                        "verified before and that did not change since"),
    lazy_pages: bool = typer.Option(False, "--lazy-pages", help="let CRIU return before the tree's memory is "
                                                                "read: pages arrive on first touch (criu lazy-pages)"),
    standby: bool = typer.Option(False, "--standby", help="stop before the GPU: the instance waits, holding host "
                                                          "memory only, until `vsnap activate INSTANCE`"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON document on stdout"),
) -> None:
    try:
        # an interrupt that arrived while blocked (a parent's signal mask is inherited) is taken now
        signal.pthread_sigmask(signal.SIG_UNBLOCK, INTERRUPTS)
        from vsnap.host import gpu_early  # light: it starts the driver before the restore path's imports

        gpu_early.start()  # the CUDA driver starts while the restore path is imported
        # here, not at import: every vsnap command loads every command module
        from vsnap.host.proctree import seconds_since_start
        from vsnap.ops.restore import restore_image, wait_server
        from vsnap.ops.stop import stop_server
        from vsnap.protocol.errors import EngineError

        started_s = seconds_since_start()  # the interpreter's start and the imports, before any phase
        progress = _render.PhaseProgress()
        try:
            server = restore_image(image, host=host, port=port, gpu=gpu, rehash=rehash, lazy_pages=lazy_pages,
                                   standby=standby, on_event=progress)
        finally:
            progress.close()
    except KeyboardInterrupt:
        exit_interrupted()
    try:  # from here an interrupt stops the server: the command did not hand it over
        _report(server, as_json, detach, standby, lazy_pages, started_s)
        if detach:
            server.detach()
            return
        if not as_json:
            _render.stderr.print("Ctrl-C stops the " + ("standby (and the server it becomes)" if standby else "server"))
        wait_server(server.pid)
    except KeyboardInterrupt:
        _render.stderr.print("stopping the server…")
        stop_server(server)
        raise
    exited = EngineError("serve", "EngineExited", "the server exited", log_path=server.engine_log)
    if as_json:  # stdout holds the serving document: it stays the one document, the exit is said on stderr
        _render.print_error(exited, as_json=False)
        raise typer.Exit(code=exited.exit_code)
    raise exited


def _report(server: RestoredServer, as_json: bool, detach: bool, standby: bool, lazy_pages: bool,
            started_s: float) -> None:
    if not as_json:
        for warning in server.host_warnings:  # before the table: they may explain what follows
            _render.stderr.print(f"warning: {_render.one_line(warning)}", markup=False)
    if standby:
        _report_standby(server, as_json, detach, started_s)
    elif as_json:
        _render.print_json("restore", {
            **serving_document(server, started_s), "hashed_files": server.hashed_files, "lazy_pages": lazy_pages,
            "restore_log": str(server.restore_log), "detached": detach, "host_warnings": server.host_warnings,
        })
    else:
        _render.stdout.print(_render.timing_table(f"restored {server.image_dir}", server.timings, server.recovery))
        _render.stdout.print(serving_line(server), markup=False)


def exit_interrupted() -> NoReturn:
    """Ctrl-C (or SIGTERM, SIGHUP) before the server was returned: restore_image has released
    everything it made. Exit 130 now, not through the interpreter's exit: that would wait for the
    threads the interrupted verify phase left running (hashing the image's files has no deadline:
    minutes for a large image) and run the CUDA driver's exit handlers while the thread that starts
    the driver (host.gpu_early) may still be inside cuInit."""
    _render.stderr.print("interrupted")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(130)


def serving_document(server: RestoredServer, started_s: float) -> dict[str, Any]:
    """What `vsnap restore --json` and `vsnap activate --json` both say of a server that serves."""
    return {
        "pid": server.pid, "url": server.url, "host": server.host, "port": server.port,
        "instance": server.instance_id, "instance_dir": str(server.instance_dir), "gpu": server.gpu,
        "timings": server.timings, "total_s": sum(server.timings.values()), "command_start_s": started_s,
        "recovery": server.recovery, "weights_source": server.weights_source, "engine_log": str(server.engine_log),
    }


def serving_line(server: RestoredServer) -> str:
    return (f"instance {server.instance_id} serving {server.url} (pid {server.pid}"
            f"{', GPU ' + server.gpu if server.gpu else ''}"
            f"{', weights from the ' + server.weights_source if server.weights_source else ''}); "
            f"engine log {server.engine_log}")


def _report_standby(server: RestoredServer, as_json: bool, detach: bool, started_s: float) -> None:
    memory = server.memory_bytes or 0
    if as_json:
        _render.print_json("restore", {
            "pid": server.pid, "state": "standby", "instance": server.instance_id,
            "instance_dir": str(server.instance_dir), "timings": server.timings, "total_s": sum(server.timings.values()),
            "command_start_s": started_s, "memory_bytes": memory, "hashed_files": server.hashed_files,
            "engine_log": str(server.engine_log), "restore_log": str(server.restore_log), "detached": detach,
        })
        return
    _render.stdout.print(_render.timing_table(f"standby of {server.image_dir}", server.timings, {}))
    _render.stdout.print(f"instance {server.instance_id} standing by (pid {server.pid}, {memory / 1e9:.2f} GB of host "
                         f"memory, no GPU, no port); `vsnap activate {server.instance_id}` serves it", markup=False)
