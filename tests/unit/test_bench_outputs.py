"""The bench's equal-outputs check: parsing both engines' completions and comparing them."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from vsnap.ops.bench.outputs import BENCH_PROMPTS, bench_prompts, compare_outputs, parse_completion


def test_prompts_are_fixed_and_distinct() -> None:
    prompts = bench_prompts()
    assert len(prompts) == BENCH_PROMPTS >= 32 and len(set(prompts)) == len(prompts)
    assert prompts == bench_prompts()


def test_parse_vllm_token_ids_from_logprob_tokens() -> None:
    choice = {"text": "", "logprobs": {"tokens": ["token_id:17", "token_id:5"], "token_logprobs": [-0.5, -1.25]}}
    assert parse_completion(choice) == ([17, 5], [-0.5, -1.25])


def test_parse_cpu_engine_token_ids() -> None:
    choice = {"token_ids": [104, 105], "logprobs": {"tokens": ["h", "i"], "token_logprobs": [-0.1, None]}}
    ids, logprobs = parse_completion(choice)
    assert ids == [104, 105] and logprobs[0] == -0.1 and math.isnan(logprobs[1])


def test_parse_refuses_text_tokens_without_ids() -> None:
    from vsnap.protocol.errors import EngineError

    with pytest.raises(EngineError, match="no token ids"):
        parse_completion({"logprobs": {"tokens": ["hello"], "token_logprobs": [-1.0]}})


def test_equal_outputs() -> None:
    a = [([1, 2, 3], [-0.1, -0.2, -0.3]), ([4, 5], [-1.0, -2.0])]
    result = compare_outputs(a, [(list(ids), list(lps)) for ids, lps in a])
    assert result == {"prompts": 2, "tokens": 5, "mismatched_prompts": 0, "first_mismatch_position": None,
                      "max_logprob_diff": 0.0, "mismatches": []}


def test_logprobs_compared_only_before_the_first_differing_token() -> None:
    expected = [([1, 2, 3, 4], [-0.1, -0.2, -0.3, -0.4]), ([7, 8], [-1.0, -1.0])]
    actual = [([1, 2, 9, 9], [-0.1, -0.25, -5.0, -9.0]), ([7, 8], [-1.0, -1.03125])]
    result = compare_outputs(expected, actual)
    assert result["mismatched_prompts"] == 1 and result["mismatches"] == [{"prompt": 0, "position": 2}]
    assert result["first_mismatch_position"] == 2
    assert result["max_logprob_diff"] == pytest.approx(0.05)  # not 4.7 (position 2) nor 8.6 (position 3)


def test_first_position_is_the_smallest_over_prompts() -> None:
    expected = [([1, 2, 3], [0.0] * 3), ([1, 2, 3], [0.0] * 3)]
    actual = [([1, 2, 0], [0.0] * 3), ([0, 2, 3], [0.0] * 3)]
    result = compare_outputs(expected, actual)
    assert result["mismatched_prompts"] == 2 and result["first_mismatch_position"] == 0


def test_shorter_output_differs_where_it_ends() -> None:
    result = compare_outputs([([1, 2, 3], [-1.0] * 3)], [([1, 2], [-1.0] * 2)])
    assert result["mismatches"] == [{"prompt": 0, "position": 2}]


def test_nan_logprob_is_a_difference() -> None:
    result = compare_outputs([([1, 2], [-1.0, -1.0])], [([1, 2], [-1.0, float("nan")])])
    assert result["mismatches"] == [{"prompt": 0, "position": 1}] and result["max_logprob_diff"] == 0.0


def test_different_prompt_counts_are_refused() -> None:
    with pytest.raises(ValueError):
        compare_outputs([([1], [0.0])], [])


def test_an_engine_note_keeps_the_weights_split_that_comes_late_in_its_line(tmp_path: Path) -> None:
    """A weights line by reference names referenced_bytes and literal_bytes after ~420 characters:
    the record cut lines at 400, so a bench by reference lost them."""
    from vsnap.ops.bench.record import NOTE_PREFIX, engine_notes

    line = NOTE_PREFIX + " weights file written " + "x" * 420 + " referenced_bytes=16059990016 literal_bytes=577060864"
    (tmp_path / "engine.log").write_text("other line\n" + line + "\n")
    assert engine_notes(tmp_path / "engine.log") == [line]
