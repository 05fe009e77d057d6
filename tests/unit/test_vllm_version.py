"""The installed vLLM against the versions vsnap is tested with (compat.TESTED_VLLM): `vsnap validate`
names them in a row of its own and warns in one line on any other; a capture's preflight (through
require_supported_args) says the same line on stderr. A warning, never a refusal. No vLLM needed:
the version is faked."""

from __future__ import annotations

from pathlib import Path

import pytest

from vsnap.engine.adapters.vllm.compat import TESTED_VLLM
from vsnap.ops import validate as ops_validate
from vsnap.spec import vllm_check


def test_the_tested_versions_are_the_releases_ci_checks() -> None:
    assert TESTED_VLLM == ("0.26.0", "0.32.0", "0.33.0")
    assert all(vllm_check.tested_vllm(v) for v in (*TESTED_VLLM, "0.26.0+cu130", "0.32.0+cpu"))
    assert not any(vllm_check.tested_vllm(v) for v in ("0.33.1", "0.34.0", "0.33.0rc1", "0.25.1", "0.30.0"))


def test_a_tested_vllm_is_named_without_a_warning() -> None:
    check = vllm_check.vllm_version_check("0.33.0")
    assert check is not None and check.ok and not check.warning
    assert check.detail == "vllm 0.33.0, one of the versions vsnap is tested with (0.26.0, 0.32.0, 0.33.0)"


def test_an_untested_vllm_is_a_one_line_warning_not_a_refusal() -> None:
    check = vllm_check.vllm_version_check("0.34.0")
    assert check is not None and check.ok and check.warning and check.error is None
    assert check.name == "vllm version" and "\n" not in check.detail
    assert check.detail == ("vllm 0.34.0 is not a version vsnap is tested with (0.26.0, 0.32.0, 0.33.0): the snapshot "
                            "rules and the engine adapter may not fit it")


def test_no_vllm_no_version_row(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vllm_check, "vllm_version", lambda: None)
    assert vllm_check.vllm_version_check() is None


def _fake_vllm(monkeypatch: pytest.MonkeyPatch, version: str) -> list[str]:
    """The installed vLLM reads as ``version``; the rules themselves are not run (they need vLLM)."""
    monkeypatch.setattr(vllm_check, "vllm_version", lambda: version)
    monkeypatch.setattr(vllm_check, "_require_supported_args", lambda spec, source: "arguments accepted")
    return []


def test_a_capture_preflight_warns_once_on_stderr(monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    _fake_vllm(monkeypatch, "0.34.0")
    assert vllm_check.require_supported_args(object()) == "arguments accepted"  # type: ignore[arg-type]
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("warning: vllm 0.34.0 is not a version vsnap is tested with")
    _fake_vllm(monkeypatch, "0.26.0")
    vllm_check.require_supported_args(object())  # type: ignore[arg-type]
    assert capsys.readouterr().err == ""


def test_require_supported_args_says_it_to_the_caller_or_not_at_all(monkeypatch: pytest.MonkeyPatch,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    said = _fake_vllm(monkeypatch, "0.30.0")
    vllm_check.require_supported_args(object(), warn=said.append)  # type: ignore[arg-type]
    vllm_check.require_supported_args(object(), warn=None)  # type: ignore[arg-type]
    assert len(said) == 1 and said[0].startswith("vllm 0.30.0 is not")
    assert capsys.readouterr().err == ""


def test_validate_names_the_version_in_its_own_row(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    spec = tmp_path / "model.yaml"
    spec.write_text(f"name: a\nengine: vllm\nmodel: {model}\n")
    monkeypatch.setattr(ops_validate, "preflight", lambda engine: [])
    for version, warned in (("0.34.0", True), ("0.32.0", False)):
        _fake_vllm(monkeypatch, version)
        report = ops_validate.validate_target(spec)
        rows = {check.name: check for check in report.checks}
        assert rows["vllm version"].warning is warned and rows["vllm version"].ok
        assert rows["vllm version"].detail.startswith(f"vllm {version}")
        assert rows["vllm arguments"].detail == "arguments accepted"
        assert [c.name for c in report.checks].index("vllm version") < [c.name for c in report.checks].index(
            "vllm arguments")
