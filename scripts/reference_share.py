"""How much of a model's loaded weights weights-by-reference finds in the model's own files.

    python scripts/reference_share.py MODEL_DIR [--quantization fp8] [--layers-of N] [--label L]
                                      [--json OUT.json]
    python scripts/reference_share.py --brief OUT.json...   # one line per record

Loads MODEL_DIR in real vLLM (whatever backend this vLLM has: the CPU build here, CUDA on the GPU
machine), lets it process its weights as it does before serving (fused projections, FP8 scales,
quantizing at load), and runs vsnap's reference matcher (engine/adapters/vllm/weights/references.py,
the capture's own code) over every parameter's storage against MODEL_DIR's safetensors. Prints, per
kind of tensor, the bytes vLLM holds and the share the matcher references, and writes them as JSON.
Exit 3 (and no share) where a parameter holds no bytes: the backend keeps that weight outside torch
(vLLM's CPU build packs bf16 linear weights for oneDNN), so what the matcher saw is not the model.

The capture matches the whole weights pool, which on a GPU also holds unnamed tensors made at load
(the V2 runner's scratch, ~0.58 GB for the 8B: always literal); this script matches the model's
parameters only, so it says what the checkpoint format and vLLM's processing decide. Every layer of
a make_test_model.py shape is alike: a model made with ``--layers 2`` says per layer what the full
shape holds, and ``--layers-of N`` extrapolates to N layers (the layers' tensors times N / their
count, plus the rest once). Issue 28 item 1 asks for the share per checkpoint format
(docs/benchmarks/NOTES.md, session 16).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from collections import defaultdict
from typing import Any

LAYER = re.compile(r"^(.*?layers)\.([0-9]+)\.(.+)$")


def _match(worker: Any, model_dir: str) -> dict[str, Any]:
    """In the worker: each parameter storage (in address order, once) and what the matcher found."""
    import torch

    from vsnap.engine.adapters.vllm.weights.references import IMAGE, write_by_reference

    model = worker.model_runner.get_model()
    seen: dict[int, tuple[str, Any]] = {}  # storage address -> (name, parameter); a tied weight once
    empty: list[str] = []
    for name, p in model.named_parameters():
        ptr = p.untyped_storage().data_ptr()
        if not p.untyped_storage().nbytes():
            empty.append(name)  # a placeholder: the backend moved the weight out of torch (CPU's oneDNN packing)
            continue
        if ptr not in seen or p.untyped_storage().nbytes() > seen[ptr][1].untyped_storage().nbytes():
            seen[ptr] = (name, p)
    named = [(name, str(p.dtype).removeprefix("torch."),
              torch.empty(0, dtype=torch.uint8, device=p.device).set_(p.untyped_storage()))
             for name, p in (seen[k] for k in sorted(seen))]
    start = time.monotonic()
    with open(os.devnull, "wb") as sink:
        plan = write_by_reference(sink, (t.cpu().numpy() for _, _, t in named), model_dir)
    took = time.monotonic() - start
    tensors, at = [], 0
    for name, dtype, t in named:
        end = at + t.numel()
        referenced = sum(min(e.pool_offset + e.nbytes, end) - max(e.pool_offset, at) for e in plan.extents
                         if e.source != IMAGE and e.pool_offset < end and e.pool_offset + e.nbytes > at)
        tensors.append({"name": name, "dtype": dtype, "bytes": t.numel(), "referenced": referenced})
        at = end
    return {"tensors": tensors, "match_s": took, "files": [f.path for f in plan.files],
            "skipped": [list(s) for s in plan.skipped], "empty_parameters": empty}


def summarize(tensors: list[dict[str, Any]], layers_of: int | None, measured: bool = True) -> dict[str, Any]:
    """Bytes and referenced bytes per kind of tensor (a layer's tensors by their name inside the
    layer, the rest by name), and the totals, extrapolated to ``layers_of`` layers if given. No
    share unless ``measured`` (every parameter held its bytes in torch): a share of what could be
    seen would read as the model's."""
    kinds: dict[str, dict[str, int]] = defaultdict(lambda: {"bytes": 0, "referenced": 0, "count": 0})
    layers: set[str] = set()
    layer_bytes = layer_referenced = 0
    for t in tensors:
        m = LAYER.match(t["name"])
        kind = f"layer: {m.group(3)}" if m else t["name"]
        if m:
            layers.add(m.group(2))
            layer_bytes += t["bytes"]
            layer_referenced += t["referenced"]
        k = kinds[f"{kind} ({t['dtype']})"]
        k["bytes"] += t["bytes"]
        k["referenced"] += t["referenced"]
        k["count"] += 1
    total = sum(t["bytes"] for t in tensors)
    referenced = sum(t["referenced"] for t in tensors)
    out: dict[str, Any] = {"kinds": dict(sorted(kinds.items())), "layers": len(layers), "bytes": total,
                           "referenced": referenced, "share": referenced / total if total and measured else None}
    if layers_of and layers:
        scale = layers_of / len(layers)
        full = total - layer_bytes + layer_bytes * scale
        full_referenced = referenced - layer_referenced + layer_referenced * scale
        out.update({"layers_of": layers_of, "full_bytes": full, "full_referenced": full_referenced,
                    "full_share": full_referenced / full if measured else None})
    return out


def table(result: dict[str, Any]) -> str:
    s = result["summary"]
    rows = [(f"{result['label']}: {s['bytes'] / 1e9:.3f} GB held, {s['referenced'] / 1e9:.3f} GB referenced "
             f"({_percent(s['share'])}), {s['layers']} layers; matched in {result['match_s']:.1f} s")]
    if s.get("full_share") is not None:
        rows.append(f"  with {s['layers_of']} layers: {s['full_bytes'] / 1e9:.2f} GB, {s['full_referenced'] / 1e9:.2f} GB "
                    f"referenced ({_percent(s['full_share'])}), {(s['full_bytes'] - s['full_referenced']) / 1e9:.3f} GB literal")
    if result["empty_parameters"]:
        rows.append(f"  NOT MEASURED: {len(result['empty_parameters'])} parameters hold no bytes (e.g. "
                    f"{result['empty_parameters'][0]}): this backend keeps those weights outside torch, "
                    "repacked; a GPU keeps them as tensors")
    rows.append(f"  {'kind':<52} {'count':>5} {'MB':>10} {'referenced':>10}")
    for kind, k in s["kinds"].items():
        rows.append(f"  {kind[:52]:<52} {k['count']:>5} {k['bytes'] / 1e6:>10.2f} {100 * k['referenced'] / k['bytes']:>9.1f}%")
    return "\n".join(rows)


def _percent(share: float | None) -> str:
    return "not measured" if share is None else f"{100 * share:.2f} %"


def brief(result: dict[str, Any]) -> str:
    s = result["summary"]
    if result.get("empty_parameters"):
        return (f"{result['label']:<18} not measured: {len(result['empty_parameters'])} parameters were repacked "
                f"outside torch by this backend (vLLM {result['vllm']})")
    full, referenced = s.get("full_bytes", s["bytes"]), s.get("full_referenced", s["referenced"])
    return (f"{result['label']:<18} {s.get('layers_of', s['layers']):>3} layers: {full / 1e9:7.2f} GB, "
            f"referenced {100 * referenced / full:6.2f} %, literal {(full - referenced) / 1e9:6.3f} GB (vLLM {result['vllm']})")


def main() -> int:
    if sys.argv[1:2] == ["--brief"]:
        for path in sys.argv[2:]:
            with open(path) as f:
                print(brief(json.load(f)))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="a model directory of safetensors")
    parser.add_argument("--quantization", default=None, help="vLLM's --quantization (fp8: quantize a bf16 checkpoint at load)")
    parser.add_argument("--layers-of", type=int, default=None, help="extrapolate the layers' tensors to this many layers")
    parser.add_argument("--label", default=None)
    parser.add_argument("--json", default=None, help="write the result here")
    args = parser.parse_args()
    model = os.path.realpath(args.model)
    if not os.path.isfile(os.path.join(model, "config.json")):
        print(f"reference_share: {model} holds no config.json; give a model directory", file=sys.stderr)
        return 2
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc of a function
    from vllm import LLM, __version__

    start = time.monotonic()
    llm = LLM(model=model, quantization=args.quantization, max_model_len=256, enforce_eager=True,
              kv_cache_memory_bytes=64 << 20)  # the weights are the point; a KV cache as small as it goes
    load_s = time.monotonic() - start
    found = llm.collective_rpc(_match, args=(model,))[0]
    result = {"label": args.label or os.path.basename(model), "model": model, "quantization": args.quantization,
              "vllm": __version__, "load_s": load_s, "match_s": found["match_s"], "files": found["files"],
              "skipped": found["skipped"], "empty_parameters": found["empty_parameters"],
              "summary": summarize(found["tensors"], args.layers_of, measured=not found["empty_parameters"]),
              "tensors": found["tensors"]}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    print(table(result))
    return 3 if found["empty_parameters"] else 0  # no share: some weights were not where it could see them


if __name__ == "__main__":
    sys.exit(main())
