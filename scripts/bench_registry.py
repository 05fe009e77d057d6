"""Push and pull throughput through a real registry on loopback, and zstd on real CRIU pages.

    python scripts/bench_registry.py --image IMAGE [--pad-gb 3] [--work DIR] [--out docs/benchmarks/NAME]

IMAGE is a captured CPU image (`vsnap capture examples/cpu.yaml`). The script copies it into
WORK (root's, private) and pads the copy with a weights file of PAD_GB random bytes
(`weights/rank0.bin`, listed in its manifest.json as a capture lists it; the cpu engine never
reads it, so the copy still restores): a vLLM image is a weights file plus CRIU pages. It starts
Debian's docker-registry on 127.0.0.1 (filesystem storage in WORK) and times, through the CLI:
a cold push, a second push (every blob already there), a cold pull, and a pull by digest into
another path. It also measures zstd levels 1, 3 and 6 on the image's CRIU pages (ratio,
compression and decompression speed, one thread and two) and level 3 on bf16 weights drawn
from N(0, 0.02) (what weights look like; random bytes do not compress at all). Everything runs
with the files in the page cache (the script never drops caches: other work shares the machine).
Writes OUT.json and OUT.md; removes WORK unless --keep.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "src"))

from tests.integration.registry_server import LocalRegistry  # noqa: E402
from vsnap.image.store import (
    digest_scheme,  # noqa: E402
    piece_hashes,  # noqa: E402
)
from vsnap.protocol.control import write_atomic  # noqa: E402

VSNAP = [sys.executable, "-m", "vsnap"]


def padded_copy(image: Path, work: Path, pad_bytes: int) -> Path:
    target = work / "images" / "padded"
    target.parent.mkdir(parents=True, mode=0o700)
    shutil.copytree(image, target)
    (target / "weights").mkdir(mode=0o700)
    weights = target / "weights" / "rank0.bin"
    with open(weights, "wb") as f:
        left = pad_bytes
        while left:
            chunk = os.urandom(min(64 << 20, left))
            f.write(chunk)
            left -= len(chunk)
    for path in [target, *target.rglob("*")]:
        os.chmod(path, 0o700 if path.is_dir() else 0o600)
    manifest = json.loads((target / "manifest.json").read_text())
    digest = piece_hashes(target, {"weights/rank0.bin": pad_bytes})["weights/rank0.bin"]
    manifest["files"]["weights/rank0.bin"] = {"size": pad_bytes, "digest": digest, "scheme": digest_scheme(pad_bytes)}
    manifest["sizes"]["image_bytes"] = sum(entry["size"] for entry in manifest["files"].values())
    write_atomic(target, "manifest.json", json.dumps(manifest, indent=2).encode())
    return target


def timed(*args: str) -> tuple[dict, float]:
    start = time.perf_counter()
    result = subprocess.run([*VSNAP, *args, "--json"], capture_output=True, text=True, cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    seconds = time.perf_counter() - start
    if result.returncode != 0:
        raise SystemExit(f"vsnap {' '.join(args)} failed:\n{result.stdout}\n{result.stderr}")
    return json.loads(result.stdout), seconds


def floors(work: Path, registry_address: str, size: int = 1 << 30) -> dict:
    """What bounds the transfers on this host, measured with the same 1 GiB of random bytes: the
    page-cache write rate (os.write of 4 MiB chunks, as a pull writes), sha256 on one core, and
    the registry's own ingest and serve rates (one raw blob up, then down to nowhere)."""
    from vsnap.registry.blobio import HashingIterator, file_chunks
    from vsnap.registry.client import RegistryClient
    from vsnap.registry.oci import parse_reference

    data = os.urandom(size)
    path = work / "floor.bin"
    start = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    for offset in range(0, size, 4 << 20):
        os.write(fd, data[offset:offset + (4 << 20)])
    os.close(fd)
    write_s = time.perf_counter() - start
    import hashlib

    start = time.perf_counter()
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    sha_s = time.perf_counter() - start
    client = RegistryClient(parse_reference(f"{registry_address}/vsnap/floor:v1"))
    start = time.perf_counter()
    client.upload_stream(HashingIterator(file_chunks(path), digest=digest), lambda: digest)
    up_s = time.perf_counter() - start
    start = time.perf_counter()
    received = sum(len(chunk) for chunk in client.blob_chunks(digest))
    down_s = time.perf_counter() - start
    assert received == size
    path.unlink()
    return {"bytes": size, "page_cache_write_MBps": size / write_s / 1e6, "sha256_MBps": size / sha_s / 1e6,
            "registry_ingest_MBps": size / up_s / 1e6, "registry_serve_MBps": size / down_s / 1e6}


def zstd_pages(image: Path) -> list[dict]:
    import zstandard

    data = b"".join(p.read_bytes() for p in sorted((image / "criu").glob("pages-*.img")))
    rows = []
    for level in (1, 3, 6):
        for threads in (1, 2):
            compressor = zstandard.ZstdCompressor(level=level, threads=threads)
            start = time.perf_counter()
            out = compressor.compress(data)
            compress_s = time.perf_counter() - start
            start = time.perf_counter()
            back = zstandard.ZstdDecompressor().decompress(out, max_output_size=len(data))
            decompress_s = time.perf_counter() - start
            assert back == data
            rows.append({"level": level, "threads": threads, "bytes": len(data), "compressed": len(out),
                         "ratio": len(out) / len(data), "compress_MBps": len(data) / compress_s / 1e6,
                         "decompress_MBps": len(data) / decompress_s / 1e6})
    return rows


def zstd_weights(sample_bytes: int = 256 << 20) -> dict:
    import numpy as np
    import zstandard

    values = np.random.default_rng(0).normal(0, 0.02, sample_bytes // 2).astype(np.float32)
    bf16 = (values.view(np.uint32) >> 16).astype(np.uint16).tobytes()  # bf16: float32's top half
    start = time.perf_counter()
    out = zstandard.ZstdCompressor(level=3, threads=2).compress(bf16)
    seconds = time.perf_counter() - start
    return {"bytes": len(bf16), "compressed": len(out), "ratio": len(out) / len(bf16),
            "compress_MBps": len(bf16) / seconds / 1e6}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--image", type=Path, required=True)
    parser.add_argument("--pad-gb", type=float, default=3.0)
    parser.add_argument("--work", type=Path, default=Path("/var/tmp/vsnap-bench-registry"))
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--keep", action="store_true")
    args = parser.parse_args()
    if args.work.exists():
        raise SystemExit(f"{args.work} exists; remove it or pass another --work")
    args.work.mkdir(mode=0o700, parents=True)
    try:
        image = padded_copy(args.image.absolute(), args.work, int(args.pad_gb * (1 << 30)))
        image_bytes = sum(p.stat().st_size for p in image.rglob("*") if p.is_file())
        load_before = os.getloadavg()
        with LocalRegistry(args.work / "registry") as registry:
            bounds = floors(args.work, registry.address)
            ref = f"{registry.address}/vsnap/padded:v1"
            push, push_s = timed("push", str(image), ref)
            again, again_s = timed("push", str(image), ref)
            pull, pull_s = timed("pull", ref, "--to", str(args.work / "pulled" / "padded"))
            pinned = ref.rsplit(":", 1)[0] + "@" + push["digest"]
            pull2, pull2_s = timed("pull", pinned, "--to", str(args.work / "pulled" / "again"))
            stored = sum(p.stat().st_size for p in registry.storage.rglob("*") if p.is_file()) - bounds["bytes"]
        record = {
            "kind": "registry-loopback", "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                     cwd=ROOT).stdout.strip(),
            "command": "python scripts/bench_registry.py " + " ".join(sys.argv[1:]),
            "host": {"cpus": os.cpu_count(), "cpu": _cpu_model(), "kernel": platform.release(),
                     "python": platform.python_version(), "registry": _registry_version(),
                     "load_average_before": load_before, "load_average_after": os.getloadavg()},
            "floors": bounds,
            "image_bytes": image_bytes, "weights_bytes": int(args.pad_gb * (1 << 30)), "registry_bytes": stored,
            "push": {"wall_s": push_s, **push}, "push_again": {"wall_s": again_s, **again},
            "pull": {"wall_s": pull_s, **pull}, "pull_by_digest": {"wall_s": pull2_s, **pull2},
            "zstd_pages": zstd_pages(args.image.absolute()), "zstd_bf16_weights": zstd_weights(),
        }
    finally:
        if not args.keep:
            shutil.rmtree(args.work, ignore_errors=True)
    out = args.out or ROOT / "docs" / "benchmarks" / f"registry-loopback-{dt.date.today().isoformat()}"
    out.with_suffix(".json").write_text(json.dumps(record, indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown(record))
    print(markdown(record))


def _cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def _registry_version() -> str:
    result = subprocess.run(["docker-registry", "--version"], capture_output=True, text=True)
    return result.stdout.strip()


def _load(values: list[float]) -> str:
    return ", ".join(f"{v:.2f}" for v in values)


def markdown(r: dict) -> str:
    gb = r["image_bytes"] / 1e9

    def rate(seconds: float) -> str:
        return f"{r['image_bytes'] / seconds / 1e9:.2f} GB/s"

    rows = [
        ("push (cold)", r["push"]["wall_s"], r["push"]["timings"], f"{r['push']['uploaded']} sent, "
         f"{r['push']['bytes_sent'] / 1e9:.2f} GB on the wire"),
        ("push again", r["push_again"]["wall_s"], r["push_again"]["timings"],
         f"{r['push_again']['skipped']} of {r['push_again']['blobs']} blobs already there"),
        ("pull (cold)", r["pull"]["wall_s"], r["pull"]["timings"], f"{r['pull']['bytes_received'] / 1e9:.2f} GB "
         "received"),
        ("pull by digest", r["pull_by_digest"]["wall_s"], r["pull_by_digest"]["timings"], "another path"),
    ]
    lines = [f"# Push and pull through a registry on loopback ({r['date'][:10]}, {r['commit']})", "",
             f"`{r['command']}`", "",
             f"Host: {r['host']['cpus']} CPUs ({r['host']['cpu']}), kernel {r['host']['kernel']}, Python "
             f"{r['host']['python']}, {r['host']['registry']} on 127.0.0.1 with filesystem storage. Image: a CPU "
             f"capture padded with a {r['weights_bytes'] / 2**30:.1f} GiB random weights file, {gb:.2f} GB in all; "
             f"the registry stored {r['registry_bytes'] / 1e9:.2f} GB. Page cache warm.", "",
             f"Load average (1, 5, 15 min) before {_load(r['host']['load_average_before'])}, after "
             f"{_load(r['host']['load_average_after'])}: other work shared the 2 cores.", "",
             "What bounds it here, each measured on 1 GiB of random bytes: page-cache writes "
             f"{r['floors']['page_cache_write_MBps']:.0f} MB/s, sha256 {r['floors']['sha256_MBps']:.0f} MB/s on one "
             f"core, the registry's ingest of one raw blob {r['floors']['registry_ingest_MBps']:.0f} MB/s and its "
             f"serving {r['floors']['registry_serve_MBps']:.0f} MB/s.", "",
             "| step | wall (CLI) | rate (image bytes / wall) | phases (s) | |", "|---|---|---|---|---|"]
    for name, wall, timings, note in rows:
        phases = ", ".join(f"{k} {v:.2f}" for k, v in timings.items())
        lines.append(f"| {name} | {wall:.2f} s | {rate(wall)} | {phases} | {note} |")
    lines += ["", "zstd on this image's CRIU pages "
              f"({r['zstd_pages'][0]['bytes'] / 1e6:.0f} MB):", "",
              "| level | threads | ratio | compress | decompress |", "|---|---|---|---|---|"]
    for z in r["zstd_pages"]:
        lines.append(f"| {z['level']} | {z['threads']} | {z['ratio']:.3f} | {z['compress_MBps']:.0f} MB/s | "
                     f"{z['decompress_MBps']:.0f} MB/s |")
    w = r["zstd_bf16_weights"]
    lines += ["", f"zstd level 3 on {w['bytes'] / 1e6:.0f} MB of bf16 weights drawn from N(0, 0.02): ratio "
              f"{w['ratio']:.3f} at {w['compress_MBps']:.0f} MB/s.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
