"""Lines `vsnap serve` (and the commands beside it) print or act on: each reads as a sentence and
means what it says (hostile pass 14)."""

from __future__ import annotations

import http.server
import json
import os
import threading
from pathlib import Path
from typing import Iterator

import pytest

from vsnap.host import executables
from vsnap.host.executables import require_root_owned_executable
from vsnap.ops.bench.outputs import first_token
from vsnap.protocol.errors import EngineError, HostNotReady


@pytest.mark.parametrize("setup, problem", [
    ("missing", "cannot be read (No such file or directory)"),
    ("group-writable", "mode 0775: group or others can write it"),
    ("not executable", "not an executable file"),
])
def test_a_refused_program_is_named_with_its_problem(tmp_path: Path, setup: str, problem: str) -> None:
    """The refusal read "as root: it is cannot be read (...)"."""
    executables.forget_resolved()
    directory = tmp_path / "bin"
    directory.mkdir(mode=0o755)
    program = directory / "criu"
    if setup != "missing":
        program.write_text("#!/bin/sh\n")
        program.chmod(0o775 if setup == "group-writable" else 0o644)
    with pytest.raises(HostNotReady) as refused:
        require_root_owned_executable(program, "criu", source="VSNAP_CRIU")
    if os.geteuid() == 0 or setup == "missing":
        assert refused.value.message == f"refusing to run {program} (VSNAP_CRIU) as root: {problem}"
    assert "it is" not in refused.value.message


class _Server(http.server.BaseHTTPRequestHandler):
    answer = b"{}"

    def do_POST(self) -> None:  # noqa: N802 (the http.server name)
        self.rfile.read(int(self.headers["content-length"]))
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.end_headers()
        self.wfile.write(self.answer)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def server() -> Iterator[http.server.HTTPServer]:
    httpd = http.server.HTTPServer(("127.0.0.1", 0), _Server)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield httpd
    httpd.shutdown()
    httpd.server_close()


@pytest.mark.parametrize("answer", [b"{}", b'{"choices": []}', b"[]"])
def test_the_first_completion_answering_no_choice_fails_as_one_engine_error(
        server: http.server.HTTPServer, answer: bytes) -> None:
    """One first completion for `vsnap serve` and the bench (it was two: the bench's raised a
    KeyError or an IndexError on an answer without a choice, a traceback instead of a line)."""
    _Server.answer = answer
    url = f"http://127.0.0.1:{server.server_address[1]}"
    with pytest.raises(EngineError) as failed:
        first_token(url, "m", timeout_s=10, phase="serve")
    assert failed.value.phase == "serve" and failed.value.type == "FirstCompletionFailed"
    assert url in failed.value.message and "\n" not in failed.value.message
    _Server.answer = json.dumps({"choices": [{"text": "!"}]}).encode()
    first_token(url, "m", timeout_s=10, phase="serve")
