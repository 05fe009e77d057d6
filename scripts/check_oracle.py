"""Ask a restored server for every oracle prompt over HTTP and compare with the image's oracle.

    python scripts/check_oracle.py IMAGE URL [--tolerance T]

Works for both engines (OpenAI /v1/completions, greedy, logprobs, token ids). Token ids must be
equal; each chosen token's logprob within the tolerance (default: the spec's). Prints one JSON
document; exit 0 when everything matches, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.request
from pathlib import Path

from vsnap import read_manifest


def complete(url: str, model: str, prompt: str, max_tokens: int, logprobs: int) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "logprobs": logprobs,
            "return_token_ids": True, "ignore_eos": True, "min_tokens": max_tokens}
    request = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.load(response)["choices"][0]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("image", type=Path)
    parser.add_argument("url")
    parser.add_argument("--tolerance", type=float)
    parser.add_argument("--summary", action="store_true", help="one line for people instead of JSON")
    args = parser.parse_args()
    manifest = read_manifest(args.image)
    tolerance = manifest.launch.oracle_tolerance if args.tolerance is None else args.tolerance
    results, worst, ok = [], 0.0, True
    start = time.monotonic()
    for sample in manifest.oracle.samples:
        sent = time.monotonic()
        choice = complete(args.url, sample.model or manifest.launch.served_model_name, sample.prompt, len(sample.token_ids),
                          manifest.launch.oracle_top_k)
        got_ids = choice.get("token_ids")
        got_lp = choice["logprobs"]["token_logprobs"]
        want_lp = [top[str(t)] for t, top in zip(sample.token_ids, sample.logprobs)]
        diffs = [abs(a - b) for a, b in zip(got_lp, want_lp)]
        same_ids = got_ids == sample.token_ids
        sample_ok = same_ids and len(got_lp) == len(want_lp) and all(d <= tolerance for d in diffs)
        worst = max([worst, *diffs])
        ok = ok and sample_ok
        results.append({"prompt": sample.prompt, "ok": sample_ok, "token_ids_equal": same_ids,
                        "max_abs_logprob_diff": max(diffs, default=0.0), "seconds": time.monotonic() - sent,
                        "text": choice["text"]})
    if args.summary:
        print(f"{len(results)} oracle prompts over HTTP: token ids and logprobs equal to the oracle recorded "
              f"before the checkpoint: {'yes' if ok else 'NO'} (max |logprob difference| {worst})")
    else:
        print(json.dumps({"ok": ok, "tolerance": tolerance, "max_abs_logprob_diff": worst,
                          "first_request_s": results[0]["seconds"], "all_requests_s": time.monotonic() - start,
                          "samples": results}, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
