"""What a restore's command loads before its first phase, and what it does at its end.

`vsnap restore` and `vsnap activate` are timed from the command's start (docs/benchmarks/NOTES.md,
session 5): these tests keep the modules it no longer needs out of its path, check the health
check that replaced urllib says what urllib said, and that the CLI freezes its objects before the
interpreter's exit. No test here measures time.
"""

from __future__ import annotations

import gc
import http.server
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Iterator

import pytest

from vsnap.host import http as _http
from vsnap.protocol.errors import EngineError


class _Health(http.server.BaseHTTPRequestHandler):
    status = 200

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self.send_response(self.status)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def server() -> Iterator[http.server.HTTPServer]:
    httpd = http.server.HTTPServer(("127.0.0.1", 0), type("Handler", (_Health,), {}))
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield httpd
    httpd.shutdown()
    httpd.server_close()


def _url(httpd: http.server.HTTPServer) -> str:
    return _http.server_url("127.0.0.1", httpd.server_address[1])


def _urllib_says(url: str) -> str | None:
    """What the health check said with urllib (the code before this change)."""
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
            return None if response.status == 200 else f"HTTP {response.status}"
    except (urllib.error.URLError, OSError) as exc:
        return str(exc)


def test_health_check_passes_on_200(server: http.server.HTTPServer) -> None:
    _http.health_check(_url(server), timeout_s=5)


@pytest.mark.parametrize("status", [503, 404, 204])
def test_health_check_reports_other_answers_as_urllib_did(server: http.server.HTTPServer, status: int) -> None:
    server.RequestHandlerClass.status = status  # type: ignore[attr-defined]
    url = _url(server)
    port = server.server_address[1]
    assert _http._get_health("127.0.0.1", port, deadline=time.monotonic() + 5) == _urllib_says(url)
    with pytest.raises(EngineError, match="did not answer 200") as raised:
        _http.health_check(url, timeout_s=0.1)
    assert f"({_urllib_says(url)})" in raised.value.message


def test_health_check_reports_a_refused_connection_as_urllib_did() -> None:
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    url = _http.server_url("127.0.0.1", port)
    assert _http._get_health("127.0.0.1", port, deadline=time.monotonic() + 5) == _urllib_says(url)
    assert _urllib_says(url) == "<urlopen error [Errno 111] Connection refused>"


def test_a_server_that_answers_one_byte_at_a_time_cannot_stretch_the_deadline() -> None:
    """Hostile pass 11: the 5 s timeout held per read, so a server (the restored tree, or whoever
    held the port) sending a byte every 4 s kept `vsnap restore` waiting for ever."""
    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def trickle() -> None:
        conn, _ = listener.accept()
        with conn:
            while not stop.wait(0.2):
                try:
                    conn.sendall(b"H")
                except OSError:
                    return

    thread = threading.Thread(target=trickle, daemon=True)
    thread.start()
    started = time.monotonic()
    with pytest.raises(EngineError, match="did not answer 200 .*timed out"):
        _http.health_check(f"http://127.0.0.1:{listener.getsockname()[1]}", timeout_s=1)
    assert time.monotonic() - started < 3  # one deadline, not one per byte
    stop.set()
    listener.close()


def test_the_health_check_gives_up_when_the_tree_is_gone() -> None:
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]
    gone = EngineError("serve", "EngineExited", "the restored engine exited before /health answered")
    with pytest.raises(EngineError, match="exited before /health answered"):
        _http.health_check(f"http://127.0.0.1:{port}", timeout_s=30, stop=lambda: gone)


def test_main_freezes_the_objects_before_the_exit(monkeypatch: pytest.MonkeyPatch) -> None:
    import vsnap.cli

    def exits() -> None:
        raise SystemExit(0)

    monkeypatch.setattr(vsnap.cli, "load_commands", lambda only=None: None)
    monkeypatch.setattr(vsnap.cli, "_app", exits)
    gc.unfreeze()
    try:
        with pytest.raises(SystemExit):
            vsnap.cli.main()
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()


# Imported by a restore's command before its first phase no longer (each was measured: NOTES.md)
NOT_ON_THE_RESTORE_PATH = ("yaml", "vsnap.spec.schema", "psutil", "urllib.request", "http.client", "rich", "vsnap.cli.images",
                           "vsnap.cli.validate", "vsnap.cli.ps", "vsnap.cli.bench")


@pytest.mark.parametrize("command", [["restore", "/nonexistent"], ["activate", "nosuch"]])
def test_the_restore_path_does_not_import(command: list[str], tmp_path: Path) -> None:
    """`vsnap restore|activate ... --json` up to its first phase (which fails here) imports none of them."""
    code = ("import sys, runpy\n"
            f"sys.argv = ['vsnap', *{command!r}, '--json']\n"
            "try:\n    runpy.run_module('vsnap', run_name='__main__')\n"
            "except SystemExit:\n    pass\n"
            f"print(sorted(m for m in {NOT_ON_THE_RESTORE_PATH!r} if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": ":".join(sys.path),
                              "VSNAP_RUNTIME_DIR": str(tmp_path / "run")})
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout + out.stderr


def test_app_has_every_command_in_order() -> None:
    """`from vsnap.cli import app` (tests, library users) loads every command; `vsnap --help` lists
    them in COMMANDS' order whichever module was imported first."""
    import typer.main

    import vsnap.cli
    from vsnap.cli import ps  # noqa: F401 (imported before `app`, on purpose)

    group = typer.main.get_command(vsnap.cli.app)
    assert group.list_commands(None) == list(vsnap.cli.COMMANDS)  # type: ignore[attr-defined]
