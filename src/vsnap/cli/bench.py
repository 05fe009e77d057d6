"""vsnap bench SPEC"""

from __future__ import annotations

from pathlib import Path

import typer

from . import _app as app
from . import _render, error_boundary


def is_breakdown(key: str) -> bool:
    """A record's phase key that is not a phase of its own (the engine's split of recover, each
    verify check side by side, the command's cost beyond its phases): shown apart, not summed."""
    return key.startswith(("engine ", "verify_")) or key in ("cli_overhead_s", "cli_start_s")


@app.command(help="Measure, in one run: cold start to first token (fully cold and with a warm compile cache), "
                  "capture, restore to first token (repeated), the per-phase breakdown, the floor, and whether "
                  "the restored server answers as the cold one did. Works on an image of its own (the spec's "
                  "image is not touched) and removes it. Writes JSON, markdown and a plot to --out.")
@error_boundary
def bench(
    spec: Path = typer.Argument(..., help="model.yaml"),
    runs: int = typer.Option(3, "--runs", min=1, max=20, help="restores to take the median of"),
    cold_runs: int = typer.Option(0, "--cold-runs", min=0, max=20,
                                  help="cold starts with a warm compile cache (0: runs - 1, at least 1)"),
    out: Path = typer.Option(Path("docs/benchmarks"), "--out", help="where the record goes"),
    lazy_pages: bool = typer.Option(False, "--lazy-pages", help="restore with CRIU lazy pages (vsnap restore --lazy-pages)"),
    standby: bool = typer.Option(True, "--standby/--no-standby", help="also time standbys: `vsnap restore --standby`, "
                                                                      "then `vsnap activate` to the first completion"),
    as_json: bool = typer.Option(False, "--json", help="print the record as JSON"),
) -> None:
    # here, not at import: every vsnap command loads every command module
    from vsnap.ops.bench.run import run_bench
    from vsnap.spec.schema import load_spec

    progress = _render.PhaseProgress()
    try:
        record = run_bench(load_spec(spec), runs=runs, cold_runs=cold_runs or None, lazy_pages=lazy_pages,
                                  standby=standby, out_dir=out, on_event=progress)
    finally:
        progress.close()
    if as_json:
        _render.print_json("bench", record)
        return
    same = record["outputs"]["restored_vs_cold"]
    _render.stdout.print(_render.timing_table(
        f"restore to first token {record['restore_to_first_token_s_median']:.2f} s (median of {runs}) vs cold start "
        f"{record['cold_start_to_first_token_s_median']:.2f} s ({record['speedup_vs_warm_cold_start']:.1f}x); "
        f"floor {record['floor_s']:.2f} s; outputs: {same['mismatched_prompts']} of {same['prompts']} prompts differ "
        f"from the cold start (largest logprob difference {same['max_logprob_diff']:.3g})",
        {k: v for k, v in record["phases"].items() if not is_breakdown(k)},
        {k.removeprefix("engine "): v for k, v in record["phases"].items() if is_breakdown(k)}))
    if record.get("standby"):
        sb = record["standby"]
        _render.stdout.print(f"standby: activation to first token {sb['activation_to_first_token_s_median']:.2f} s "
                             f"(median of {runs}); a standby holds {max(sb['standby_host_memory_bytes']) / 1e9:.2f} GB "
                             f"of host memory, no GPU memory", markup=False)
