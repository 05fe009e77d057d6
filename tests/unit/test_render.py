"""What the CLI prints cannot drive the terminal: control characters from outside (a manifest's
name, a hostname, a process command) are written as \\xNN, while rich's own styling still works."""

from __future__ import annotations

import io

from rich.table import Table

from vsnap.cli._render import CleanConsole, clean


def test_control_characters_are_shown_not_sent() -> None:
    assert clean("a\x1b]0;PWNED\x07b\x9b31m\tc\n") == "a\\x1b]0;PWNED\\x07b\\x9b31m\tc\n"
    buffer = io.StringIO()
    console = CleanConsole(file=buffer, width=120, force_terminal=True, color_system="standard", highlight=False)
    table = Table()
    table.add_column("name")
    table.add_row("img\x1b[2J\x9b31m")
    console.print(table)
    console.print("[red]error:[/] bad\x1b]0;title\x07")
    out = buffer.getvalue()
    assert "\x1b[2J" not in out and "\x9b" not in out and "\x07" not in out and "\x1b]0" not in out
    assert "img\\x1b" in out and "bad\\x1b]0;title" in out
    assert "\x1b[31merror:" in out  # rich's own colour still reaches the terminal


def test_inspect_renders_any_process_entry_a_manifest_holds() -> None:
    from vsnap.cli.inspect import process_line

    assert process_line({"command": 5, "anonymous_bytes": "x", "largest_mappings": [{"bytes": "y"}, 3]}) \
        == "5: 0 MB anonymous (largest: ? 0 MB)"
    assert process_line({}) == "?: 0 MB anonymous"


def test_a_full_disk_is_one_error_line_not_a_traceback(capsys) -> None:
    import errno

    import pytest as _pytest
    import typer

    from vsnap.cli import error_boundary

    @error_boundary
    def command(as_json: bool = False) -> None:
        raise OSError(errno.ENOSPC, "No space left on device", "/run/vsnap/instances/x.json")

    with _pytest.raises(typer.Exit) as exit_info:
        command()
    assert exit_info.value.exit_code == 1
    assert "No space left on device writing /run/vsnap/instances/x.json" in capsys.readouterr().err

    @error_boundary
    def buggy(as_json: bool = False) -> None:
        raise OSError(errno.EBADF, "Bad file descriptor")

    with _pytest.raises(OSError):  # anything else is a bug and keeps its traceback
        buggy()


def test_progress_on_a_file_is_what_rich_wrote_there_without_rich(monkeypatch) -> None:
    """A command whose stderr is no terminal (`vsnap restore --json` under the bench) writes its
    progress lines itself, byte for byte as the rich console did, and only then skips importing rich."""
    import sys

    from vsnap.cli import _render
    from vsnap.host.events import PhaseEvent

    for name in ("FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delitem(_render.__dict__, "stderr", raising=False)
    events = [PhaseEvent("verify image", "start"), PhaseEvent("verify image", "done", 0.0412),
              PhaseEvent("criu [restore]\x1b", "start"), PhaseEvent("criu [restore]\x1b", "failed", 12.5),
              PhaseEvent("a phase longer than sixteen", "done", None)]
    plain = io.StringIO()
    monkeypatch.setattr(sys, "stderr", plain)
    progress = _render.PhaseProgress()
    assert progress._plain
    for event in events:
        progress(event)
    progress.close()
    monkeypatch.undo()

    drawn = io.StringIO()
    rich_progress = _render.PhaseProgress(CleanConsole(file=drawn, stderr=True, highlight=False, soft_wrap=True,
                                                       emoji=False))
    assert not rich_progress._plain
    for event in events:
        rich_progress(event)
    assert plain.getvalue() == drawn.getvalue()
    assert plain.getvalue().splitlines()[0] == "✓ verify image        0.04 s"


def test_progress_goes_through_rich_when_rich_would_draw(monkeypatch) -> None:
    import sys

    from vsnap.cli import _render

    monkeypatch.delitem(_render.__dict__, "stderr", raising=False)
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    monkeypatch.setenv("FORCE_COLOR", "1")  # rich treats the file as a terminal: colours, a spinner
    assert not _render.PhaseProgress()._plain
    monkeypatch.delenv("FORCE_COLOR")
    assert _render.PhaseProgress()._plain
    _render.stderr  # noqa: B018 (a console made, or put in place by a test: it is used)
    assert not _render.PhaseProgress()._plain


def test_a_long_transfer_reports_its_bytes_at_most_twice_a_second_from_any_thread(monkeypatch) -> None:
    import threading

    from vsnap.host import events

    clock = [100.0]
    monkeypatch.setattr(events.time, "monotonic", lambda: clock[0])
    seen: list = []
    progress = events.Timings(seen.append).progress("download blobs", 4 << 30)
    workers = [threading.Thread(target=lambda: [progress.add(1 << 20) for _ in range(1024)]) for _ in range(4)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    assert seen == [] and progress.done_bytes == 4 << 30  # no time passed: counted, not reported
    clock[0] += events.ByteProgress.EVERY_S
    progress.add(1)
    assert seen == [events.PhaseEvent("download blobs", "progress", None, (4 << 30) + 1, 4 << 30)]


def test_a_transfers_progress_is_one_line_every_ten_seconds_in_a_log(monkeypatch) -> None:
    import sys

    from vsnap.cli import _render
    from vsnap.host.events import PhaseEvent

    clock = [1000.0]
    monkeypatch.setattr(_render.time, "monotonic", lambda: clock[0])
    for name in ("FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delitem(_render.__dict__, "stderr", raising=False)
    log = io.StringIO()
    monkeypatch.setattr(sys, "stderr", log)
    progress = _render.PhaseProgress()
    progress(PhaseEvent("download blobs", "start"))
    for second in range(1, 26):
        clock[0] += 1
        progress(PhaseEvent("download blobs", "progress", None, second * 2_000_000_000, 50_000_000_000))
    progress(PhaseEvent("download blobs", "done", 25.0))
    lines = log.getvalue().splitlines()
    assert lines == ["  download blobs 20.00 of 50.00 GB, 2.00 GB/s", "  download blobs 40.00 of 50.00 GB, 2.00 GB/s",
                     "✓ download blobs     25.00 s"]


def test_invisible_and_reversing_characters_are_shown_not_sent() -> None:
    """Hostile pass 19: bidi overrides (U+202E shows `x<RLO>gnp.exe` as `xexe.png`) and zero-width
    characters (`prod` and `prod<ZWSP>` look alike) from manifests, records and registry error
    bodies reached the terminal as they were. Every character str.isprintable() refuses is escaped
    but tab and newline; one_line escapes those too."""
    from vsnap.cli._render import one_line

    assert clean("x\u202egnp.exe prod\u200b \ufeff\u2028\xa0 é 中") == "x\\u202egnp.exe prod\\u200b \\ufeff\\u2028\\xa0 é 中"
    assert clean("a\ud800b\U000e0001") == "a\\ud800b\\U000e0001"
    assert one_line("ok\nhint: fine\tx\u202e") == "ok\\nhint: fine\\tx\\u202e"
    buffer = io.StringIO()
    CleanConsole(file=buffer, width=120, color_system=None).print("name prod\u200b and x\u202egnp.exe")
    assert "\u200b" not in buffer.getvalue() and "\u202e" not in buffer.getvalue()


def test_an_error_message_is_one_line_whatever_it_quotes(capsys) -> None:
    """Hostile pass 19: a newline in a name an error quotes (a manifest's vsnap_version, a dependency's
    path, a file planted in an image) forged `error:` and `hint:` lines. A message's own lines (a
    host mismatch's facts, an engine's error) follow indented, each one line whatever it holds."""
    from vsnap.cli._render import print_error
    from vsnap.protocol.errors import ImageHostMismatch, ImageTampered

    print_error(ImageTampered("logs/x\nhint: all good\u202e", "sha256 0", "an unlisted file"), as_json=False)
    lines = capsys.readouterr().err.splitlines()
    assert [line[:6] for line in lines] == ["error:", "  hint", "hint: "]  # the forged hint stays indented
    assert lines[1] == "  hint: all good\\u202e does not match the manifest (expected sha256 0, found an unlisted file)"
    mismatch = ImageHostMismatch([("file /nonexistent\nerror: none", "1 bytes", "missing"), ("python", "3.11", "3.12")])
    print_error(mismatch, as_json=False)
    lines = capsys.readouterr().err.splitlines()
    assert [line.split(":")[0] for line in lines] == ["error", "  file /nonexistent\\nerror", "  python", "hint"]
    print_error(ImageTampered("x", "a", "b"), as_json=False)  # (no line of its own: nothing after the hint)
    assert capsys.readouterr().err.count("\n") == 2


def test_inspect_shows_a_hostile_process_entry_as_text(tmp_path, monkeypatch) -> None:
    """Hostile pass 19's review: a process entry's pid of "[/]" made `vsnap inspect` end in rich's
    MarkupError, and one holding a newline forged a row of the table."""
    from rich.console import Console
    from typer.testing import CliRunner

    from tests.unit.fake_image import make_image
    from vsnap.cli import _render, app

    image = make_image(tmp_path / "img", processes=[{"pid": "[/]", "command": "x"}, {"pid": "1\nforged row  fake"}])
    out = io.StringIO()
    monkeypatch.setattr(_render, "stdout", Console(file=out, width=200, color_system=None, soft_wrap=True))
    result = CliRunner().invoke(app, ["inspect", str(image)])
    assert result.exit_code == 0, result.output
    text = out.getvalue()
    assert "process [/]" in text and "process 1\\nforged row  fake" in text
    assert not [line for line in text.splitlines() if line.lstrip().startswith("forged row")]
