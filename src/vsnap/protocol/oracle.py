"""The oracle: what the engine computed before capture, and the comparison after restore.

A leaf (protocol.records and protocol.errors only): the engine tree, the manifest and the tests share it.
"""

from __future__ import annotations

import math

from .errors import OracleMismatch
from .records import Record, field


class OracleSample(Record):
    """Greedy output for one prompt: the token ids and, per position, the top-k log probabilities."""

    prompt: str
    # the served name to ask over HTTP: a LoRA adapter's, or None for the model itself
    model: str | None = None
    token_ids: list[int]
    text: str = ""
    # one dict per generated position: token id (as a string, JSON keys are strings) -> logprob
    # (NaN or -inf taken: compare_oracles fails them, as a mismatch)
    logprobs: list[dict[str, float]] = field(finite=False)


class Oracle(Record):
    samples: list[OracleSample]


def compare_oracles(expected: Oracle, actual: Oracle, tolerance: float) -> float:
    """Return the largest logprob difference; raise OracleMismatch at the first divergence.

    Token ids must match exactly; every logprob of the expected top-k must be present
    in the actual top-k and within ``tolerance``. Fails closed: a missing sample,
    position or token is a mismatch, and NaN never compares equal.
    """
    if len(expected.samples) != len(actual.samples):
        raise OracleMismatch(-1, -1, f"{len(expected.samples)} samples", f"{len(actual.samples)} samples")
    worst = 0.0
    for index, (want, got) in enumerate(zip(expected.samples, actual.samples)):
        through = f" (through {want.model})" if want.model else ""
        if want.model != got.model:
            raise OracleMismatch(index, -1, f"a sample through {want.model or 'the model'}",
                                 f"one through {got.model or 'the model'}")
        if want.token_ids != got.token_ids:
            position = next(
                (i for i, (a, b) in enumerate(zip(want.token_ids, got.token_ids)) if a != b),
                min(len(want.token_ids), len(got.token_ids)),
            )
            exp = want.token_ids[position] if position < len(want.token_ids) else "end"
            act = got.token_ids[position] if position < len(got.token_ids) else "end"
            raise OracleMismatch(index, position, f"token {exp}{through}", f"token {act}")
        if len(want.logprobs) != len(got.logprobs):
            raise OracleMismatch(index, -1, f"{len(want.logprobs)} positions", f"{len(got.logprobs)} positions")
        for position, (top_want, top_got) in enumerate(zip(want.logprobs, got.logprobs)):
            for token, value in top_want.items():
                other = top_got.get(token)
                if other is None:
                    raise OracleMismatch(index, position, f"token {token} in top-k{through}", "absent")
                diff = abs(value - other)
                if math.isnan(diff) or diff > tolerance:
                    raise OracleMismatch(index, position, f"logprob {value!r} for {token}{through}", repr(other))
                worst = max(worst, diff)
    return worst
