"""Compose the record of a gpu-e2e.sh run (OUT/record.json) and print a short table."""

from __future__ import annotations

import datetime as dt
import json
import sys
from pathlib import Path

from vsnap import read_manifest


def load(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def standby_record(out: Path) -> dict | None:
    """`vsnap restore --standby` then `vsnap activate` (gpu-e2e.sh's last step), if it ran."""
    standby, activated = load(out / "standby.json"), load(out / "activate.json")
    if not standby:
        return None
    check = load(out / "check-activated.json")
    try:
        t0, t1 = map(float, (out / "wall-activate.txt").read_text().split())
        wall = t1 - t0
    except (OSError, ValueError):
        wall = None
    return {"standby_phases": standby.get("timings"), "standby_total_s": standby.get("total_s"),
            "standby_host_memory_bytes": standby.get("memory_bytes"),
            "gpu_used_while_standing_by": (out / "gpu-standby.txt").read_text().strip()
            if (out / "gpu-standby.txt").exists() else None,
            "activate_phases": activated.get("timings"), "activate_total_s": activated.get("total_s"),
            "activate_engine": activated.get("recovery"), "activate_plus_oracle_over_http_s": wall,
            "oracle_over_http": {k: check.get(k) for k in ("ok", "max_abs_logprob_diff")},
            "error": None if activated else (out / "activate.err").read_text()[-500:]
            if (out / "activate.err").exists() else "activate did not run"}


def main() -> None:
    out, image, shape = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    manifest = read_manifest(image)
    capture = load(out / "capture.json")
    restores = [load(out / f"restore{n}.json") for n in (1, 2)]
    checks = [load(out / f"check{n}.json") for n in (1, 2)]
    walls = []
    for n in (1, 2):
        try:
            t0, t1 = map(float, (out / f"wall{n}.txt").read_text().split())
            walls.append(t1 - t0)
        except (OSError, ValueError):
            walls.append(None)
    h = manifest.host
    record = {
        "date": dt.date.today().isoformat(),
        "command": f"SHAPE={shape} bash scripts/gpu-e2e.sh",
        "model": f"random-weight Llama, {shape} shape",
        "gpu": h.gpus[0]["name"] if h.gpus else None,
        "driver": h.driver, "cuda": h.cuda, "kernel": h.kernel, "criu": h.criu, "python": h.python,
        "torch": h.torch, "vllm": h.vllm,
        "capture_s": sum(capture.get("timings", {}).values()),
        "capture_phases": capture.get("timings"),
        "image_bytes": manifest.sizes.get("image_bytes"),
        "cuda_processes": manifest.cuda_processes,
        "restores": [{"phases": r.get("timings"), "total_s": r.get("total_s"), "engine": r.get("recovery"),
                      "restore_plus_oracle_over_http_s": w, "oracle_over_http": {k: c.get(k) for k in
                      ("ok", "max_abs_logprob_diff", "first_request_s", "tolerance")}}
                     for r, c, w in zip(restores, checks, walls)],
        "standby": standby_record(out),
        "oracle_ok": all(c.get("ok") for c in checks),
        # what fills the image: each process's anonymous memory at the dump, and the largest files
        "processes": manifest.processes,
        "largest_files": dict(sorted(((rel, e.size) for rel, e in manifest.files.items()),
                                     key=lambda item: -item[1])[:8]),
    }
    (out / "record.json").write_text(json.dumps(record, indent=2) + "\n")
    print(f"\n{'':-<60}\nvsnap GPU e2e  {record['gpu']}  driver {h.driver}  vllm {h.vllm}  torch {h.torch}")
    print(f"{'capture (total)':<36}{record['capture_s']:9.2f} s")
    for k, v in (capture.get("timings") or {}).items():
        print(f"  {k:<34}{v:9.2f} s")
    print(f"{'image':<36}{(record['image_bytes'] or 0) / 1e9:9.2f} GB")
    for rel, size in record["largest_files"].items():
        print(f"  {rel:<34}{size / 1e9:9.2f} GB")
    for proc in manifest.processes:
        print(f"  pid {proc['pid']:<6} anon {proc['anonymous_bytes'] / 1e9:6.2f} GB  {proc['command'][:60]}")
    for n, (r, c, w) in enumerate(zip(restores, checks, walls), 1):
        print(f"{f'restore #{n} (vsnap restore total)':<36}{(r.get('total_s') or 0):9.2f} s")
        for k, v in (r.get("timings") or {}).items():
            print(f"  {k:<34}{v:9.2f} s")
        for k, v in (r.get("recovery") or {}).items():
            print(f"    engine {k:<27}{v:9.3f}")
        print(f"  {'weights from':<34}{r.get('weights_source')}")
        print(f"  {'oracle over HTTP':<34}{'ok' if c.get('ok') else 'MISMATCH':>9}  max |dlogprob| {c.get('max_abs_logprob_diff')}")
        if w:
            print(f"  {'restore + all oracle requests':<34}{w:9.2f} s")
    sb = record["standby"]
    if sb:
        print(f"{'standby (vsnap restore --standby)':<36}{(sb['standby_total_s'] or 0):9.2f} s  "
              f"host memory {(sb['standby_host_memory_bytes'] or 0) / 1e9:.2f} GB, GPU used {sb['gpu_used_while_standing_by']}")
        print(f"{'activate (vsnap activate total)':<36}{(sb['activate_total_s'] or 0):9.2f} s")
        for k, v in (sb.get("activate_phases") or {}).items():
            print(f"  {k:<34}{v:9.2f} s")
        for k, v in (sb.get("activate_engine") or {}).items():
            print(f"    engine {k:<27}{v:9.3f}")
        ok = (sb.get("oracle_over_http") or {}).get("ok")
        print(f"  {'oracle over HTTP':<34}{'ok' if ok else 'MISMATCH':>9}")
        if sb.get("error"):
            print(f"  activate error: {sb['error']}")
    print(f"{'':-<60}\nrecord: {out / 'record.json'}")


if __name__ == "__main__":
    main()
