"""The fixed load a bench or a staged bench asks of a server: every request's completion tokens (as
the server reports them) over the batch's wall time; failures counted, not raised; loopback only."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Iterator

import pytest

from vsnap.ops.bench.loadgen import run_throughput


@pytest.fixture()
def server() -> Iterator[tuple[str, list[dict]]]:
    seen: list[dict] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (http.server's name)
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.append(body)
            answer = b"not json" if body["prompt"] == "broken" else json.dumps(
                {"usage": {"completion_tokens": body["max_tokens"]}}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, *args: object) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}", seen
    httpd.shutdown()


def test_every_request_generates_its_tokens_and_they_are_counted(server: tuple[str, list[dict]]) -> None:
    url, seen = server
    result = run_throughput(url, "m", ["a", "b", "c"], requests=10, concurrency=4, max_tokens=7)
    assert result.errors == 0 and result.completion_tokens == 70 and result.tokens_per_s > 0
    assert len(seen) == 10 and {b["prompt"] for b in seen} == {"a", "b", "c"}
    assert all(b["model"] == "m" and b["ignore_eos"] is True and b["temperature"] == 0 for b in seen)


def test_a_failed_request_is_counted_not_raised(server: tuple[str, list[dict]]) -> None:
    url, _ = server
    result = run_throughput(url, "m", ["broken", "fine"], requests=4, concurrency=2, max_tokens=5)
    assert result.errors == 2 and result.completion_tokens == 10 and "JSONDecodeError" in result.error_samples[0]


def test_only_loopback() -> None:
    with pytest.raises(ValueError, match="loopback"):
        run_throughput("http://10.0.0.1:8000", "m", ["a"])
