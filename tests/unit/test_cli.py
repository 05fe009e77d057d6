"""The CLI's edges: --version, usage errors under --json, exit codes per class, ps at 80 columns,
spec refusals as one error document. Rendered through Typer's CliRunner and fixed-width consoles."""

from __future__ import annotations

import io
import json
import time
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

import vsnap
from vsnap.cli import EXIT_CODES_HELP, _render, app
from vsnap.cli import ps as ps_cli
from vsnap.host import instances as _instances_module
from vsnap.ops import stop as _stop_module
from vsnap.protocol.errors import NothingRunning, UnknownInstance, UnsupportedOption

runner = CliRunner()


def invoke(*args: str):
    return runner.invoke(app, list(args))


def document(result) -> dict:
    return json.loads(result.stdout)


# --- --version ---------------------------------------------------------------------------------


def test_version() -> None:
    from vsnap.image.manifest import FORMAT_VERSION
    from vsnap.protocol import control

    result = invoke("--version")
    assert result.exit_code == 0
    assert result.stdout.startswith(f"vsnap {vsnap.__version__} (")
    assert f"image format {FORMAT_VERSION}" in result.stdout
    doc = document(invoke("--version", "--json"))
    assert doc["kind"] == "version" and doc["vsnap"] == vsnap.__version__ and doc["image_format"] == FORMAT_VERSION
    if hasattr(control, "PROTOCOL_VERSION"):
        assert doc["control_protocol"] == control.PROTOCOL_VERSION
        assert f"control protocol {control.PROTOCOL_VERSION}" in result.stdout


# --- usage errors honour --json ------------------------------------------------------------------


@pytest.mark.parametrize("args,message", [
    (["ps", "--bogus"], "No such option: --bogus"),
    (["restore", "/img", "--port", "x"], "Invalid value for '--port'"),
    (["capture"], "Missing argument"),
    (["nosuch"], "No such command 'nosuch'"),
    (["validate", "a.yaml", "extra"], "unexpected extra argument"),
])
def test_usage_error_with_json_is_one_json_document(args: list[str], message: str) -> None:
    result = invoke(*args, "--json")
    assert result.exit_code == 2
    doc = document(result)  # the whole of stdout is one document
    assert doc["kind"] == "error" and doc["error"] == "UsageError" and doc["exit_code"] == 2
    assert message in doc["message"] and doc["hint"].endswith("--help shows the usage")
    assert result.stderr == ""
    plain = invoke(*args)  # without --json: Click's own message on stderr, nothing on stdout
    assert plain.exit_code == 2 and plain.stdout == "" and message.split("'")[0] in plain.stderr


def test_json_before_the_command_applies_to_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ps_cli, "_records", lambda: ([], []))
    doc = document(invoke("--json", "ps"))
    assert doc["kind"] == "ps" and doc["instances"] == []
    result = invoke("--json")
    assert result.exit_code == 2 and document(result)["error"] == "UsageError"


def test_exit_codes_help_names_every_class() -> None:
    for error in (NothingRunning, UnknownInstance, UnsupportedOption):
        assert f"{error.exit_code} " in EXIT_CODES_HELP


# --- stop: exit codes per class --------------------------------------------------------------


class FakeRecord:
    def __init__(self, id: str, image: str, pid: int = 4242) -> None:
        self.id, self.image, self.pid = id, image, pid


def test_stop_with_nothing_running_exits_9(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_instances_module, "running_instances", lambda: [])
    result = invoke("stop", "/var/lib/vsnap/images/x")
    assert result.exit_code == 9 and "no vsnap instance is running" in result.stderr
    doc = document(invoke("stop", "r-1", "--json"))
    assert doc["error"] == "NothingRunning" and doc["exit_code"] == 9


def test_stop_of_an_unknown_target_exits_10(monkeypatch: pytest.MonkeyPatch) -> None:
    stopped = []
    monkeypatch.setattr(_instances_module, "running_instances", lambda: [FakeRecord("r-1", "/img/a")])
    monkeypatch.setattr(_stop_module, "stop_server", stopped.append)
    result = invoke("stop", "/img/b")
    assert result.exit_code == 10 and "no running instance of /img/b" in result.stderr and "r-1" in result.stderr
    doc = document(invoke("stop", "r-2", "--json"))
    assert doc["error"] == "UnknownInstance" and doc["exit_code"] == 10
    assert stopped == []
    result = invoke("stop", "/img/a", "--json")
    assert result.exit_code == 0 and document(result)["stopped"] == [{"id": "r-1", "pid": 4242}]
    assert [r.id for r in stopped] == ["r-1"]


# --- ps at 80 columns ------------------------------------------------------------------------------


def records() -> list:
    from vsnap.host.instances import InstanceRecord

    now = time.time()
    identity = {"owner": {"pid": 4242, "start_time": 1, "boot_id": "b"},
                "tree": {"pid": 1234567, "start_time": 2, "boot_id": "b"}, "state": "serving"}
    long = InstanceRecord(id="r-1a2b3c4d", name="llama", url="http://[2001:db8::1234:5678]:65535", port=65535,
                          image="/var/lib/vsnap/images/meta-llama-3.1-8b-instruct-bf16-h200-with-a-long-name",
                          gpu="GPU-4ad1c6d3-1b5e-7f8a-9b0c-123456789abc", instance_dir="/run/x.instances/r-1a2b3c4d",
                          started_at=now - 3 * 86400 - 4 * 3600, **identity)
    short = InstanceRecord(id="r-dd32cc98", name="cpu-tiny", url="http://127.0.0.1:8000", port=8000,
                           image="/var/lib/vsnap/images/cpu-tiny", instance_dir="/run/y.instances/r-dd32cc98", started_at=now - 305,
                           **identity)
    return [long, short]


def test_ps_fits_80_columns(monkeypatch: pytest.MonkeyPatch) -> None:
    out = io.StringIO()
    monkeypatch.setattr(_render, "stdout", Console(file=out, width=80, color_system=None, highlight=False,
                                                   soft_wrap=True, emoji=False))
    long, short = records()
    monkeypatch.setattr(ps_cli, "_records", lambda: ([long, short], []))
    assert invoke("ps").exit_code == 0
    lines = out.getvalue().splitlines()
    assert lines and max(len(line) for line in lines) <= 80
    text = out.getvalue()
    # every column is there; the long image path wraps in its column instead of being cut
    for expected in ("r-1a2b3c4d", "r-dd32cc98", "4ad1c6d3", "127.0.0.1:8000", "1234567", "3d04h", "5m05s"):
        assert expected in text
    column = lines[0].index("image")
    wrapped = "".join(line[column:].split(" ")[0] for line in lines[2:] if len(line) > column)
    assert long.image in wrapped and short.image in wrapped
    assert ":1234:" in text  # never an emoji code


def test_ps_shows_restoring_and_gone_instances(monkeypatch: pytest.MonkeyPatch) -> None:
    out = io.StringIO()
    monkeypatch.setattr(_render, "stdout", Console(file=out, width=80, color_system=None, soft_wrap=True))
    long, short = records()
    restoring = short.model_copy(update={"id": "r-0e570e01", "instance_dir": "/run/y.instances/r-0e570e01",
                                         "state": "restoring", "tree": None, "url": ""})
    monkeypatch.setattr(ps_cli, "_records", lambda: ([restoring], [long]))
    assert invoke("ps").exit_code == 0
    rows = {line.split()[0]: line for line in out.getvalue().splitlines() if line.startswith(("r-", "restore-"))}
    assert rows["r-0e570e01"].rstrip().endswith("restoring") and rows["r-1a2b3c4d"].rstrip().endswith("gone")
    doc = document(invoke("ps", "--json"))
    assert [r["id"] for r in doc["instances"]] == ["r-0e570e01"] and [r["id"] for r in doc["gone"]] == [long.id]


def test_ps_json_keeps_the_full_record(monkeypatch: pytest.MonkeyPatch) -> None:
    long, _ = records()
    monkeypatch.setattr(ps_cli, "_records", lambda: ([long], []))
    doc = document(invoke("ps", "--json"))
    assert doc["instances"][0]["url"] == long.url and doc["instances"][0]["gpu"] == long.gpu
    assert doc["instances"][0]["uptime_s"] > 3 * 86400


def test_compact_duration() -> None:
    assert [ps_cli.compact_duration(s) for s in (0, 42, 303, 7500, 3 * 86400 + 4 * 3600 + 5)] == [
        "0s", "42s", "5m03s", "2h05m", "3d04h"]


# --- spec refusals through the CLI ---------------------------------------------------------------

LAUGHS = "name: &a lol\nengine: cpu\nserve:\n" + "".join(
    f"  {c}: &{c} [{', '.join(['*' + p] * 9)}]\n" for p, c in zip("abcdefghi", "bcdefghij"))


def test_validate_billion_laughs_exits_2_at_once_with_one_line(tmp_path: Path) -> None:
    spec = tmp_path / "laughs.yaml"
    spec.write_text(LAUGHS)
    assert len(LAUGHS.splitlines()) == 12
    start = time.monotonic()
    result = invoke("validate", str(spec))
    assert time.monotonic() - start < 5
    assert result.exit_code == 2
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert errors == [f"error: {spec}:1:7 YAML anchors (&a) are not allowed in a model.yaml; "
                      "write the value out where it is used"]
    assert "Traceback" not in result.stdout + result.stderr


def test_validate_json_lists_every_issue(tmp_path: Path) -> None:
    spec = tmp_path / "bad.yaml"
    spec.write_text("name: a\nengine: cpu\nimage: /etc\nserve:\n  foo: 1\noracle:\n  top_k: 99\n")
    result = invoke("validate", str(spec), "--json")
    assert result.exit_code == 2
    [check] = document(result)["checks"]
    assert [(i["line"], i["field"]) for i in check["error"]["issues"]] == [(3, "image"), (5, "serve.foo"),
                                                                          (7, "oracle.top_k")]
    plain = invoke("validate", str(spec))
    assert "3 problems, each listed below" in plain.stdout
    assert f"{spec}:5:3 serve.foo:" in plain.stderr and f"{spec}:7:3 oracle.top_k:" in plain.stderr


def test_markup_in_spec_keys_is_printed_not_interpreted(tmp_path: Path) -> None:
    spec = tmp_path / "markup.yaml"
    spec.write_text('name: a\nengine: cpu\n"[/]": 1\n"x:thumbs_up:": 2\n')
    result = invoke("validate", str(spec))
    assert result.exit_code == 2  # rich raised MarkupError here
    assert f"{spec}:3:1 [/]: unknown key" in result.stderr and "x:thumbs_up:: unknown key" in result.stderr


def test_capture_refuses_a_system_directory_given_with_image(tmp_path: Path) -> None:
    spec = tmp_path / "ok.yaml"
    spec.write_text("name: a\nengine: cpu\n")
    result = invoke("capture", str(spec), "--image", "/etc", "--json")
    assert result.exit_code == 2
    doc = document(result)
    assert doc["error"] == "SpecError" and doc["issues"][0]["field"] == "image"
    assert doc["issues"][0]["message"].startswith("/etc is a system directory")


def test_a_path_that_cannot_be_looked_at_is_an_error_line(tmp_path: Path) -> None:
    result = invoke("validate", "a" * 5000)  # is_dir() raised ENAMETOOLONG: a traceback
    assert result.exit_code == 2 and "cannot be read: File name too long" in result.stderr
    assert "Traceback" not in result.stderr



def test_a_hostile_record_is_one_row_of_ps(monkeypatch: pytest.MonkeyPatch) -> None:
    """Hostile pass 19: a record's image holding newlines (and its url and gpu, which were not
    checked at all) forged rows of `vsnap ps`. The url and gpu are checked as a record is read;
    the image is shown on its line."""
    from vsnap.protocol.records import RecordError

    out = io.StringIO()
    monkeypatch.setattr(_render, "stdout", Console(file=out, width=200, color_system=None, soft_wrap=True))
    long, _ = records()
    forged = long.model_copy(update={"image": "/img/a\nr-00000bad /opt/trusted/prod   -   0.0.0.0:80"})
    monkeypatch.setattr(ps_cli, "_records", lambda: ([forged], []))
    assert invoke("ps").exit_code == 0
    rows = [line for line in out.getvalue().splitlines() if line.strip() and not set(line.strip()) <= {"─", " "}]
    assert len(rows) == 2 and "/img/a\\nr-00000bad" in rows[1]  # the header, then one row
    for update, needle in (({"url": "http://127.0.0.1:8000\nr-deadbeef /fake"}, "url must be"),
                           ({"url": "file:///etc/passwd"}, "url must be"),
                           ({"gpu": "GPU-\x1b[31m\nXX"}, "gpu must be GPU UUIDs")):
        with pytest.raises(RecordError, match=needle):
            type(long)(**{**long.model_dump(), **update})


def test_restore_json_in_the_foreground_stays_one_document_when_the_server_exits(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Hostile pass 19: `vsnap restore --json` printed the serving document, then, when the server
    exited, a second document (the EngineError) on stdout: a reader of stdout got `Extra data`.
    The exit is said on stderr, with its exit code."""
    from types import SimpleNamespace

    from vsnap.cli import restore as restore_cli
    from vsnap.ops import restore as restore_ops

    server = SimpleNamespace(pid=4242, url="http://127.0.0.1:8000", host="127.0.0.1", port=8000, instance_id="r-1a2b3c4d",
                             instance_dir=tmp_path, gpu=None, image_dir=tmp_path, timings={}, recovery={},
                             host_warnings=[], hashed_files=0, restore_log=tmp_path / "restore.log",
                             engine_log=tmp_path / "engine.log", standby=False)
    monkeypatch.setattr(restore_ops, "restore_image", lambda *a, **k: server)
    monkeypatch.setattr(restore_ops, "wait_server", lambda pid: None)
    monkeypatch.setattr(restore_cli, "serving_document", lambda server, started_s: {"url": server.url})
    result = invoke("restore", str(tmp_path), "--json")
    assert result.exit_code == 6, result.stderr
    assert document(result)["url"] == "http://127.0.0.1:8000"  # the one document
    assert "EngineExited: the server exited" in result.stderr and result.stderr.startswith("error: ")
