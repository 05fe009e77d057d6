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
