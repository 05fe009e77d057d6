"""A restore started with a low soft open-files limit (hostile pass 14: `ulimit -S -n 48` made
CRIU fail choosing its service descriptors, with the hint "CRIU needs root"): vsnap raises its soft
limit to the hard one before CRIU runs, so it restores; with the hard limit that low too, the
failure names the limit."""

from __future__ import annotations

import resource
import subprocess

import pytest

from tests.conftest import VSNAP
from tests.integration.conftest import CapturedImage, run_vsnap

pytestmark = pytest.mark.criu


def restore_with_limits(image: str, soft: int, hard: int) -> subprocess.CompletedProcess[str]:
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    return subprocess.run([VSNAP, "restore", image, "--detach", "--port", "0"], capture_output=True, text=True,
                          timeout=120, preexec_fn=limit)


def test_a_low_soft_limit_is_raised_and_the_restore_serves(captured: CapturedImage) -> None:
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    result = restore_with_limits(str(captured.image), 48, hard)
    try:
        assert result.returncode == 0, result.stderr
    finally:
        run_vsnap("stop", str(captured.image))


def test_a_low_hard_limit_is_named(captured: CapturedImage) -> None:
    result = restore_with_limits(str(captured.image), 48, 48)
    assert result.returncode == 5, result.stderr
    assert "hint: the open-files limit is too low for CRIU" in result.stderr
    assert "CRIU needs root" not in result.stderr
