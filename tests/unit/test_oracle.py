import pytest

from vsnap.protocol.errors import OracleMismatch
from vsnap.protocol.oracle import Oracle, OracleSample, compare_oracles


def oracle(ids: list[int], lp: float = -1.0) -> Oracle:
    return Oracle(samples=[OracleSample(prompt="p", token_ids=ids,
                                        logprobs=[{str(t): lp, "999": lp - 1} for t in ids])])


def test_identical_is_zero() -> None:
    assert compare_oracles(oracle([1, 2, 3]), oracle([1, 2, 3]), 0.0) == 0.0


def test_token_divergence_names_position() -> None:
    with pytest.raises(OracleMismatch) as info:
        compare_oracles(oracle([1, 2, 3]), oracle([1, 5, 3]), 1.0)
    assert (info.value.prompt, info.value.position) == (0, 1)
    assert info.value.exit_code == 7


def test_logprob_tolerance() -> None:
    assert compare_oracles(oracle([1]), oracle([1], -1.0005), 1e-3) == pytest.approx(5e-4)
    with pytest.raises(OracleMismatch, match="logprob"):
        compare_oracles(oracle([1]), oracle([1], -1.01), 1e-3)


def test_nan_and_missing_fail_closed() -> None:
    with pytest.raises(OracleMismatch):
        compare_oracles(oracle([1]), oracle([1], float("nan")), 1.0)
    with pytest.raises(OracleMismatch, match="samples"):
        compare_oracles(oracle([1]), Oracle(samples=[]), 1.0)
    shorter = Oracle(samples=[OracleSample(prompt="p", token_ids=[1], logprobs=[{"1": -1.0}])])
    with pytest.raises(OracleMismatch, match="absent"):
        compare_oracles(oracle([1]), shorter, 1.0)



def test_an_oracle_failure_the_tree_reports_with_odd_fields_is_still_one_line() -> None:
    """Hostile pass 10: error.json is the tree's to write; a prompt of "1e9x" raised ValueError
    (a traceback) where vsnap reads it."""
    from pathlib import Path

    from vsnap.ops.bringup import engine_failure
    from vsnap.protocol.control import ErrorReport

    report = ErrorReport(phase="recover", type="OracleMismatch", message="m",
                         detail={"prompt": "1e9x", "position": True, "expected": "a" * 10_000, "actual": 3})
    error = engine_failure(report, Path("/x/engine.log"))
    assert isinstance(error, OracleMismatch)
    assert (error.prompt, error.position) == (-1, -1) and len(error.expected) == 200 and error.actual == "3"
