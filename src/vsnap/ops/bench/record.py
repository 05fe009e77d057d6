"""The bench's record: its JSON document, a markdown table of it and (with matplotlib) a plot.

The document's keys and their order are the record format earlier records (docs/benchmarks) have:
a change here is a change of format. Building it measures nothing: run.py measures, this writes.
"""

from __future__ import annotations

import datetime as dt
import io
import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vsnap.host.trust import make_trusted_dirs
from vsnap.image.manifest import HostFacts
from vsnap.ops.capture import CaptureResult
from vsnap.protocol import control
from vsnap.spec.schema import ModelSpec

from .floor import Floor
from .outputs import BENCH_PROMPTS, BENCH_TOKENS, Completion, compare_outputs, served_models

NOTE_PREFIX = "vsnap:"  # the engine's own log lines worth keeping in the record


@dataclass(frozen=True)
class BenchOptions:
    """How the bench was asked to run (`vsnap bench`'s options), as its record names them."""

    runs: int = 3  # restores (and standbys) to take the median of
    cold_runs: int | None = None  # cold starts with a warm compile cache; None: runs - 1, at least 1
    lazy_pages: bool = False
    standby: bool = True

    @property
    def command(self) -> str:
        return (f"vsnap bench SPEC --runs {self.runs}" + (f" --cold-runs {self.cold_runs}" if self.cold_runs else "")
                + (" --lazy-pages" if self.lazy_pages else "") + ("" if self.standby else " --no-standby"))


@dataclass(frozen=True)
class Measured:
    """What one bench measured, before it becomes the record."""

    cold_s: list[float]  # launch to first token: the fully cold start, then each warm-cache one
    cold_outputs: list[list[Completion]]  # of the fully cold start, then of the first warm-cache one
    capture: CaptureResult
    capture_s: float
    restore_s: list[float]  # `vsnap restore` to first token, each run
    phases: list[dict[str, float]]  # each restore's (cli_phases)
    weights_sources: set[Any]  # where each restore's weights came from, as its document says
    restored_outputs: list[Completion]  # of the first restore
    standby: dict[str, Any] | None  # the standbys' part of the record; None when turned off
    notes: dict[str, list[str]]  # the engine's own lines: capture, first restore, first activation
    instances: list[str]  # the cold starts' and the restores'


NOTE_CHARS = 1200  # a weights line by reference names its referenced and literal bytes after ~420 characters


def engine_notes(log: Path, limit: int = 40) -> list[str]:
    """The engine's own ``vsnap:`` lines from one of its logs (what the record keeps of it)."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return []
    return [line[:NOTE_CHARS] for line in lines if line.startswith(NOTE_PREFIX)][-limit:]


def cli_phases(doc: dict[str, Any]) -> dict[str, float]:
    """A `vsnap restore/activate --json` document's phases and the engine's own breakdown, in seconds
    (the engine's rates, ``..._per_s``, are not seconds: they stay in its recovery document)."""
    return {**doc.get("timings", {}), **{k if k.startswith("verify_") else f"engine {k}": v
                                         for k, v in (doc.get("recovery") or {}).items()
                                         if k.endswith("_s") and not k.endswith("_per_s")},
            "cli_overhead_s": doc["cli_overhead_s"], "cli_start_s": float(doc.get("command_start_s") or 0.0)}


def median_phases(runs: list[dict[str, float]]) -> dict[str, float]:
    """Each phase all runs have, its median over them."""
    keys = [k for k in runs[0] if all(k in r for r in runs)]
    return {k: statistics.median(r[k] for r in runs) for k in keys}


def bench_record(spec: ModelSpec, options: BenchOptions, model_dir: Path, measured: Measured, floor: Floor,
                 facts: HostFacts, vllm_on: str | None) -> dict[str, Any]:
    """The record's JSON document (``vllm_on``: vllm_device() for the vllm engine, None for the cpu
    engine); run_bench adds where it worked to ``work``."""
    cold_median = statistics.median(measured.cold_s[1:])
    restores = measured.restore_s
    restore_median = statistics.median(restores)
    captured, cold_outputs, standbys = measured.capture, measured.cold_outputs, measured.standby
    return {
        "date": dt.date.today().isoformat(),
        "command": options.command,
        "timed": "from starting the `vsnap restore` (or `vsnap activate`) command to the first completion answered",
        "lazy_pages": options.lazy_pages,
        "model": f"{spec.name} ({model_dir})",
        "gpu": facts.gpus[0]["name"] if facts.gpus else None,
        "device": "cuda" if vllm_on == "cuda" else "cpu",  # vllm on "cpu": vLLM's CPU backend
        "versions": {"driver": facts.driver, "cuda": facts.cuda, "kernel": facts.kernel, "criu": facts.criu,
                     "python": facts.python, "torch": facts.torch, "vllm": facts.vllm, "vsnap": facts.vsnap},
        "runs": options.runs,
        "cold_start_fully_cold_s": measured.cold_s[0],
        "cold_start_warm_cache_s": measured.cold_s[1:],
        "cold_start_to_first_token_s_median": cold_median,
        "restore_to_first_token_s": restores,
        "restore_to_first_token_s_median": restore_median,
        "restore_spread_s": [min(restores), max(restores)],
        "speedup_vs_warm_cold_start": cold_median / restore_median,
        "capture_s": measured.capture_s,
        "capture_phases": captured.timings,
        "image_bytes": captured.image_bytes,
        "weight_bytes": floor.weight_bytes,
        "weights_source": sorted(str(x) for x in measured.weights_sources),
        "processes": captured.manifest.processes,
        "phases": median_phases(measured.phases),
        "phases_per_restore": measured.phases,  # the spread of the median, phase by phase
        "floor_s": floor.seconds,
        "floor_inputs": {"image_read_bytes_per_s": floor.read_bytes_per_s, "h2d_bytes_per_s": floor.h2d_bytes_per_s},
        "outputs": {"max_tokens": BENCH_TOKENS, "greedy": True,
                    "models": served_models(spec),
                    "restored_vs_cold": {"expected": "warm cold start #1", "actual": "restore #1",
                                         **compare_outputs(cold_outputs[1], measured.restored_outputs)},
                    "cold_vs_cold": {"expected": "fully cold start", "actual": "warm cold start #1",
                                     **compare_outputs(cold_outputs[0], cold_outputs[1])}},
        "standby": standbys,
        "engine_notes": measured.notes,
        "work": {"instances": measured.instances + [i for i in (standbys or {}).get("instances", [])]},
    }

def standby_record(restore_s: list[float], memory: list[int], activations: list[float],
                   phases: list[dict[str, float]], instances: list[str]) -> dict[str, Any]:
    """The record's ``standby``: each standby's restore time and host memory, each activation to
    the first completion, the activations' median phases."""
    return {"standby_restore_s": restore_s, "standby_restore_s_median": statistics.median(restore_s),
            "standby_host_memory_bytes": memory, "activation_to_first_token_s": activations,
            "activation_to_first_token_s_median": statistics.median(activations),
            "activation_spread_s": [min(activations), max(activations)], "phases": median_phases(phases),
            "instances": instances}



def write_record(record: dict[str, Any], out_dir: Path, stem: str) -> Path:
    """JSON, a markdown table and (when matplotlib is there) a plot, written atomically into a
    directory that is root's alone (a link planted at a record's name is replaced, never followed)."""
    make_trusted_dirs(out_dir)
    control.write_atomic(out_dir, f"{stem}.json", (json.dumps(record, indent=2) + "\n").encode())
    floor_label = ("image read + weights to device" if record["floor_inputs"].get("h2d_bytes_per_s")
                   else "image and weights read" if record["weight_bytes"] else "image read")
    weights_read = (f"{record['weight_bytes'] / 1e9:.2f} GB read besides CRIU's pages" if record["weight_bytes"]
                    else "inside CRIU's pages")
    lines = [f"# {record['model']} on {record['gpu'] or 'CPU'} ({record['date']})", "",
             f"`{record['command']}`", "", "| | seconds |", "|---|---|",
             f"| cold start to first token, fully cold | {record['cold_start_fully_cold_s']:.2f} |",
             f"| cold start to first token, warm compile cache (median) | {record['cold_start_to_first_token_s_median']:.2f} |",
             f"| **restore to first token (median of {record['runs']})** | **{record['restore_to_first_token_s_median']:.2f}** "
             f"({record['restore_spread_s'][0]:.2f} to {record['restore_spread_s'][1]:.2f}) |",
             f"| speedup over the warm cold start | {record['speedup_vs_warm_cold_start']:.1f}x |",
             f"| capture | {record['capture_s']:.2f} |",
             f"| floor ({floor_label}) | {record['floor_s']:.2f} |", "",
             f"Image {record['image_bytes'] / 1e9:.2f} GB, weights {weights_read} "
             f"(restored from: {', '.join(record.get('weights_source') or ['?'])}).", "",
             "Restore phases (medians):", "", "| phase | seconds |", "|---|---|"]
    lines += [f"| {k} | {v:.3f} |" for k, v in record["phases"].items()]
    if record.get("standby"):
        sb = record["standby"]
        lines += ["", "Standby (`vsnap restore --standby`, then `vsnap activate`):", "", "| | |", "|---|---|",
                  f"| **activation to first token (median of {len(sb['activation_to_first_token_s'])})** | "
                  f"**{sb['activation_to_first_token_s_median']:.2f} s** ({sb['activation_spread_s'][0]:.2f} to "
                  f"{sb['activation_spread_s'][1]:.2f}) |",
                  f"| standby restore (median) | {sb['standby_restore_s_median']:.2f} s |",
                  f"| host memory of a standby | {max(sb['standby_host_memory_bytes']) / 1e9:.2f} GB (no GPU memory) |"]
        lines += [f"| activation: {k} | {v:.3f} s |" for k, v in sb["phases"].items()]
    if record.get("processes"):
        lines += ["", "What fills the image (each process of the tree at the dump):", "",
                  "| process | anonymous memory | GPU memory before the CUDA checkpoint |", "|---|---|---|"]
        lines += [f"| `{proc['command'][:50]}` | {proc['anonymous_bytes'] / 1e6:.0f} MB | "
                  f"{proc['gpu_bytes'] / 1e6:.0f} MB |" if "gpu_bytes" in proc else
                  f"| `{proc['command'][:50]}` | {proc['anonymous_bytes'] / 1e6:.0f} MB | - |"
                  for proc in record["processes"]]
    if record.get("outputs"):
        models = record["outputs"].get("models") or []
        through = f", through each of {', '.join(models)}" if len(models) > 1 else ""
        lines += ["", f"Equal outputs ({BENCH_PROMPTS} prompts x {record['outputs']['max_tokens']} greedy tokens{through}, "
                      "token ids compared; logprobs before the first differing token):", "",
                  "| servers | prompts that differ | first differing position | largest logprob difference |",
                  "|---|---|---|---|"]
        for key in ("restored_vs_cold", "cold_vs_cold"):
            c = record["outputs"].get(key)
            if c:
                position = "-" if c["first_mismatch_position"] is None else c["first_mismatch_position"]
                lines.append(f"| {c['actual']} vs {c['expected']} | {c['mismatched_prompts']} of {c['prompts']} | "
                             f"{position} | {c['max_logprob_diff']:.3g} |")
    png = plot(record)
    if png is not None:
        control.write_atomic(out_dir, f"{stem}.png", png)
        lines += ["", f"![restore vs cold start]({stem}.png)"]
    control.write_atomic(out_dir, f"{stem}.md", ("\n".join(lines) + "\n").encode())
    return out_dir / f"{stem}.md"


def plot(record: dict[str, Any]) -> bytes | None:
    """The record as a PNG (None without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    labels = ["cold (fully)", "cold (warm cache)", "restore"]
    values = [record["cold_start_fully_cold_s"], record["cold_start_to_first_token_s_median"],
              record["restore_to_first_token_s_median"]]
    left.bar(labels, values, color=["#999", "#777", "#2a7"])
    left.set_ylabel("seconds to first token")
    left.set_title(record["model"].split(" ")[0])
    phases = {k: v for k, v in record["phases"].items() if not k.startswith("engine ")}
    bottom = 0.0
    for name, value in phases.items():
        right.bar(["restore"], [value], bottom=bottom, label=name)
        bottom += value
    right.axhline(record["floor_s"], color="k", linestyle="--", label="floor")
    right.set_ylabel("seconds")
    right.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1, 1))
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110)
    plt.close(fig)
    return buffer.getvalue()

