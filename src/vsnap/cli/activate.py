"""vsnap activate INSTANCE"""

from __future__ import annotations

from typing import Optional

import typer

from . import _app as app
from . import _render, error_boundary
from .restore import serving_document, serving_line


@app.command(help="Serve a standby (`vsnap restore IMAGE --standby`): restore its CUDA state onto --gpu, bring "
                  "its weights back, prove it with the oracle, then serve on --host/--port. Returns once it "
                  "serves; the instance keeps the owner the standby had while that vsnap runs (else it is "
                  "left detached). A failed activation ends the standby.")
@error_boundary
def activate(
    instance: str = typer.Argument(..., help="the standby's instance id (vsnap ps)"),
    host: str = typer.Option("127.0.0.1", "--host", help="address to serve on"),
    port: int = typer.Option(8000, "--port", min=0, max=65535, help="port to serve on (0: any free port)"),
    gpu: Optional[str] = typer.Option(None, "--gpu", help="GPU index or UUID (a tensor-parallel image takes one per "
                                                          "rank: --gpu 0,1; default: the captured GPUs, else the first "
                                                          "of their model with enough free memory)"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON document on stdout"),
) -> None:
    from vsnap.host import gpu_early  # light: it starts the driver before the restore path's imports

    gpu_early.start()  # the CUDA driver starts while the restore path is imported
    # here, not at import: every vsnap command loads every command module
    from vsnap.host.proctree import seconds_since_start
    from vsnap.ops.standby import activate_instance

    started_s = seconds_since_start()  # the interpreter's start and the imports, before any phase
    progress = _render.PhaseProgress()
    try:
        server = activate_instance(instance, host=host, port=port, gpu=gpu, on_event=progress)
    finally:
        progress.close()
    if as_json:
        _render.print_json("activate", serving_document(server, started_s))
        return
    _render.stdout.print(_render.timing_table(f"activated {server.instance_id}", server.timings, server.recovery))
    _render.stdout.print(serving_line(server), markup=False)
