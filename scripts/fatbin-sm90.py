#!/usr/bin/env python3
"""Zero the CUDA fatbin payloads that an sm_90 GPU (H100/H200) can never load.

Usage: fatbin-sm90.py [--dry-run] [--arch 90] FILE.so ...

The rule both carries apply (scripts/make-vllm-carry.sh with SM90_ONLY=1 for vLLM 0.26's _C and
_moe_C; scripts/make-vllm033-carry.sh for torch 2.14, NCCL and vLLM 0.33's kernels): per fatbin region (one per compilation
unit), keep every entry built for arch 90 (cubin or PTX, 90a too); if the region has no
arch-90 cubin, also keep its highest PTX below 90 (the driver JIT-compiles it); zero the
payload of every other entry (cubins for sm_75/80/86/89/100/103/110/120, PTX shadowed by a
sm_90 cubin). Headers, sizes and offsets stay as they are, so the file keeps its layout and
every symbol; zeroed runs compress to nothing. Sections named .nv_fatbin (nvcc's default) and
__nv_relfatbin (relocatable device code kept by -rdc builds, e.g. NCCL's 127 MB) are touched,
each region by the same rule; a file without either is left alone.

Prints one line per file: bytes zeroed, and the bytes per arch before (for the notes).
"""
import argparse
import collections
import re
import struct
import subprocess
import sys

MAGIC = 0xBA55ED50


def fatbin_span(path):
    out = subprocess.run(["readelf", "-SW", path], capture_output=True, text=True, check=True).stdout
    spans = []
    for line in out.splitlines():
        m = re.match(r"\s*\[\s*\d+\]\s+(\S+)\s+\S+\s+[0-9a-f]+\s+([0-9a-f]+)\s+([0-9a-f]+)", line)
        if m and m.group(1) in (".nv_fatbin", "__nv_relfatbin"):
            spans.append((int(m.group(2), 16), int(m.group(3), 16)))
    return spans


def prune(path, keep_arch=90, dry_run=False):
    spans = fatbin_span(path)
    if not spans:
        return 0, {}
    buf = bytearray(open(path, "rb").read())
    zeroed = 0
    per_arch = collections.Counter()
    for off, size in spans:
        data = memoryview(buf)[off:off + size]
        pos = 0
        while pos + 16 <= size:
            magic, _ver, hsize, fsize = struct.unpack_from("<IHHQ", data, pos)
            if magic != MAGIC:
                pos += 8
                continue
            ents, epos, end = [], pos + hsize, pos + hsize + fsize
            while epos < end:
                kind, _u, ehsize, psize = struct.unpack_from("<HHIQ", data, epos)
                arch = struct.unpack_from("<I", data, epos + 28)[0]
                ents.append((kind, arch, epos + ehsize, psize))
                epos += ehsize + psize
            has_elf = any(k == 2 and a == keep_arch for k, a, _, _ in ents)
            ptx_lo = [a for k, a, _, _ in ents if k == 1 and a < keep_arch]
            best_ptx = max(ptx_lo) if (ptx_lo and not has_elf) else None
            for kind, arch, p, n in ents:
                per_arch[("ptx" if kind == 1 else "sm") + str(arch)] += n
                if not (arch == keep_arch or (kind == 1 and arch == best_ptx)):
                    if not dry_run:
                        data[p:p + n] = bytes(n)
                    zeroed += n
            pos = end
        del data
    if not dry_run and zeroed:
        open(path, "wb").write(buf)
    return zeroed, per_arch


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("files", nargs="+")
    a = ap.parse_args()
    total = 0
    for f in a.files:
        z, per = prune(f, a.arch, a.dry_run)
        total += z
        if per:
            top = ", ".join(f"{k} {v / 1e6:.0f}" for k, v in sorted(per.items(), key=lambda kv: -kv[1]) if v >= 1e6)
            print(f"   fatbin-sm90: zeroed {z / 1e6:7.1f} MB in {f.split('/')[-1]}  (MB per entry arch: {top})")
    print(f"   fatbin-sm90: {total / 1e6:.1f} MB zeroed in {len(a.files)} file(s)")


if __name__ == "__main__":
    sys.exit(main())
