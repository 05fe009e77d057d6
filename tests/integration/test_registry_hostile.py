"""A registry that lies (issue 26, items 1 and 2): a small http.server on 127.0.0.1 answers
`vsnap pull`/`vsnap push` with a gzip bomb, an endless body, a dripped body or dripped headers, a
401 naming a token service on another origin, an upload Location on another origin. Each is
refused in one line with its exit code, in bounded memory (the child's peak RSS) and bounded time
(VSNAP_REGISTRY_DEADLINE_S lowered to 2 s), and no credential reaches another origin. A pull of
many one-byte layers writes its verified record a bounded number of times; a pull that failed on a
full disk says what it kept and resumes once space is free. No CRIU, no docker-registry."""

from __future__ import annotations

import base64
import gzip
import hashlib
import json
import os
import subprocess
import sys
import threading
import time
import zlib
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Iterator

import pytest

from tests.conftest import VSNAP
from tests.unit.fake_image import make_image, manifest
from vsnap.registry.oci import FILE_MEDIA_TYPE, Layer, build_manifest, sha256_digest

DEADLINE_S = 2.0
RSS_BOUND_KB = 400 << 10  # vsnap pull itself peaks near 100 MB; a decoded bomb is 2 GB
# 2 MB of gzip on the wire that decodes to 2 GiB: 32 gzip members of 64 MiB of zeros each
BOMB = gzip.compress(bytes(64 << 20), compresslevel=9) * 32
AUTH = base64.b64encode(b"alice:wonder").decode()

Handler = Callable[["Hostile"], None]


def with_basic_auth(fn: Handler) -> Handler:
    """``fn`` behind the docker config's Basic login (AUTH): a 401 asking for it without."""
    def check(h: "Hostile") -> None:
        if h.headers.get("Authorization") != f"Basic {AUTH}":
            h.reply(401, b"", {"Www-Authenticate": 'Basic realm="r"'})
        else:
            fn(h)
    return check


@dataclass
class Seen:
    method: str
    path: str
    authorization: str | None


@dataclass
class Server:
    """Routes (METHOD, path prefix, or an exact path ending in $) -> handler; every request is
    recorded in ``seen``."""

    routes: dict[tuple[str, str], Handler] = field(default_factory=dict)
    seen: list[Seen] = field(default_factory=list)
    httpd: ThreadingHTTPServer | None = None

    @property
    def address(self) -> str:
        assert self.httpd is not None
        return f"127.0.0.1:{self.httpd.server_address[1]}"

    def route(self, method: str, prefix: str) -> Callable[[Handler], Handler]:
        def add(fn: Handler) -> Handler:
            self.routes[(method, prefix)] = fn
            return fn
        return add


class Quiet(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a client that gave up (as vsnap must) resets the connection


class Hostile(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_state: Server

    def log_message(self, *args: Any) -> None:
        pass

    def _dispatch(self) -> None:
        state = self.server.state  # type: ignore[attr-defined]
        state.seen.append(Seen(self.command, self.path, self.headers.get("Authorization")))
        matches = [(p, fn) for (m, p), fn in state.routes.items() if m == self.command and
                   (self.path == p[:-1] if p.endswith("$") else self.path.startswith(p))]
        try:
            if not matches:
                self.reply(404, b'{"errors":[{"code":"NOT_FOUND","message":"no"}]}')
                return
            max(matches, key=lambda pair: len(pair[0]))[1](self)
        except (BrokenPipeError, ConnectionResetError):
            pass

    do_GET = do_HEAD = do_POST = do_PUT = do_PATCH = _dispatch

    def reply(self, code: int, body: bytes = b"", headers: dict[str, str] | None = None) -> None:
        self.send_response(code)
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def drain(self) -> bytes:
        """The request body (Content-Length or chunked)."""
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            data = b""
            while (size := int(self.rfile.readline().strip() or b"0", 16)) > 0:
                data += self.rfile.read(size)
                self.rfile.readline()
            self.rfile.readline()
            return data
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))


@pytest.fixture
def serve() -> Iterator[Callable[[], Server]]:
    servers: list[ThreadingHTTPServer] = []

    def start() -> Server:
        state = Server()
        httpd = Quiet(("127.0.0.1", 0), Hostile)
        httpd.state = state  # type: ignore[attr-defined]
        state.httpd = httpd
        state.route("GET", "/v2/$")(lambda h: h.reply(200, b"{}"))
        threading.Thread(target=httpd.serve_forever, daemon=True).start()
        servers.append(httpd)
        return state

    yield start
    for httpd in servers:
        httpd.shutdown()
        httpd.server_close()


RUNNER = ("import resource, subprocess, sys; r = subprocess.run(sys.argv[1:]); "
          "print('maxrss_kb', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr); "
          "sys.exit(r.returncode)")


@dataclass(frozen=True)
class Run:
    rc: int
    doc: dict
    stderr: str
    rss_kb: int
    seconds: float


def vsnap(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> Run:
    """``vsnap ARGS --json`` in a child, with its peak RSS and wall time."""
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-c", RUNNER, VSNAP, *args, "--json"], capture_output=True, text=True,
                            timeout=timeout, env={**os.environ, "VSNAP_REGISTRY_DEADLINE_S": str(DEADLINE_S),
                                                  **(env or {})})
    seconds = time.monotonic() - started
    rss = int(result.stderr.rsplit("maxrss_kb", 1)[1].split()[0])
    doc = json.loads(result.stdout) if result.stdout.strip() else {}
    return Run(result.returncode, doc, result.stderr, rss, seconds)


def refused_in_one_line(run: Run, rc: int, *needles: str) -> None:
    assert run.rc == rc, f"exit {run.rc}\n{run.doc}\n{run.stderr}"
    message = run.doc.get("message", "")
    assert "\n" not in message and all(n in message for n in needles), run.doc
    assert run.rss_kb < RSS_BOUND_KB, f"peak RSS {run.rss_kb} kB"


def target(tmp_path: Path) -> str:
    images = tmp_path / "images"
    images.mkdir(mode=0o700, exist_ok=True)
    return str(images / "x")


def gzipped(body: bytes) -> Handler:
    return lambda h: h.reply(200, body, {"Content-Encoding": "gzip", "Content-Type": "application/json"})


def endless(h: Hostile) -> None:
    h.send_response(200)
    h.send_header("Connection", "close")
    h.end_headers()
    chunk = bytes(1 << 20)
    while True:
        h.wfile.write(chunk)


def dripped_body(h: Hostile) -> None:
    h.send_response(200)
    h.send_header("Content-Length", "100000")
    h.end_headers()
    for _ in range(100000):
        h.wfile.write(b" ")
        h.wfile.flush()
        time.sleep(0.5)


def dripped_headers(h: Hostile) -> None:
    """One header line, a byte at a time (under http.client's 64 KiB line and 100 header limits)."""
    h.wfile.write(b"HTTP/1.1 200 OK\r\nX-Drip: ")
    for _ in range(60000):
        h.wfile.write(b"x")
        h.wfile.flush()
        time.sleep(0.5)


def challenge_all(registry: Server, challenge: str) -> None:
    """Every GET under /v2/ answers 401 naming ``challenge``."""
    for path in ("/v2/$", "/v2/"):
        registry.route("GET", path)(lambda h: h.reply(401, b"", {"Www-Authenticate": challenge}))


# --- item 1: every byte bounded, every wait under a deadline -----------------------------------------------------

@pytest.mark.parametrize("where", ["/v2/ answer", "redirect body", "error body", "manifest body", "token answer"])
def test_a_gzip_bomb_is_never_decoded_past_a_bound(where: str, serve: Callable[[], Server], tmp_path: Path) -> None:
    registry = serve()
    if where == "/v2/ answer":
        registry.route("GET", "/v2/$")(gzipped(BOMB))
    elif where == "redirect body":
        registry.route("GET", "/v2/vsnap/x/manifests/")(
            lambda h: h.reply(302, BOMB, {"Location": "/gone", "Content-Encoding": "gzip"}))
    elif where == "error body":
        registry.route("GET", "/v2/vsnap/x/manifests/")(
            lambda h: h.reply(404, BOMB, {"Content-Encoding": "gzip"}))
    elif where == "manifest body":
        registry.route("GET", "/v2/vsnap/x/manifests/")(gzipped(BOMB))
    else:
        challenge_all(registry, f'Bearer realm="http://{registry.address}/token",service="r"')
        registry.route("GET", "/token")(gzipped(BOMB))
    run = vsnap("pull", f"{registry.address}/vsnap/x:v1", "--to", target(tmp_path))
    if where == "manifest body":
        refused_in_one_line(run, 4, "manifest runs past 4 MiB")
    elif where == "token answer":
        refused_in_one_line(run, 3, "answered a token with a body over")
    else:
        refused_in_one_line(run, 4, "does not exist in the registry")


@pytest.mark.parametrize("where", ["manifest", "token"])
def test_an_endless_body_is_cut_at_its_bound(where: str, serve: Callable[[], Server], tmp_path: Path) -> None:
    registry = serve()
    if where == "manifest":
        registry.route("GET", "/v2/vsnap/x/manifests/")(endless)
    else:
        challenge_all(registry, f'Bearer realm="http://{registry.address}/token"')
        registry.route("GET", "/token")(endless)
    run = vsnap("pull", f"{registry.address}/vsnap/x:v1", "--to", target(tmp_path))
    if where == "manifest":
        refused_in_one_line(run, 4, "manifest runs past 4 MiB")
    else:
        refused_in_one_line(run, 3, "with a body over")


@pytest.mark.parametrize("where", ["manifest body", "/v2/ body", "/v2/ headers", "blob body"])
def test_a_drip_is_given_up_at_the_deadline(where: str, serve: Callable[[], Server], tmp_path: Path) -> None:
    registry = serve()
    if where == "manifest body":
        registry.route("GET", "/v2/vsnap/x/manifests/")(dripped_body)
    elif where == "/v2/ body":
        registry.route("GET", "/v2/$")(dripped_body)
    elif where == "/v2/ headers":
        registry.route("GET", "/v2/$")(dripped_headers)
    else:
        serve_image(registry, {"criu/pages-1.img": b"p" * 1000})
        registry.route("GET", "/v2/vsnap/x/blobs/" + sha256_digest(b"p" * 1000))(dripped_body)
    run = vsnap("pull", f"{registry.address}/vsnap/x:v1", "--to", target(tmp_path))
    if where in ("manifest body", "blob body"):
        refused_in_one_line(run, 3, "did not finish GET", "in time", f"after {DEADLINE_S:g} s below 64 KiB/s")
    elif where == "/v2/ body":
        refused_in_one_line(run, 4, "does not exist in the registry")  # the challenge's body is never read
    else:
        assert run.rc == 3 and "in time" in run.doc["message"] and "\n" not in run.doc["message"], run.doc
    assert run.seconds < DEADLINE_S + 8, run.seconds  # vsnap's start, the deadline, and no more


def serve_image(registry: Server, files: dict[str, bytes], tag: str = "v1") -> bytes:
    """The registry serves a vsnap artifact of ``files`` (raw layers) under ``tag``; its manifest."""
    config = manifest(files).model_dump_json().encode()
    layers = [Layer(rel, "raw", sha256_digest(data), len(data)) for rel, data in files.items()]
    document = build_manifest(config, layers, manifest(files))
    blobs = {sha256_digest(data): data for data in [config, *files.values()]}
    media = {"Content-Type": "application/vnd.oci.image.manifest.v1+json"}
    registry.route("GET", f"/v2/vsnap/x/manifests/{tag}")(lambda h: h.reply(200, document, media))

    def blob(h: Hostile) -> None:
        data = blobs.get(h.path.rsplit("/", 1)[-1])
        h.reply(200, data) if data is not None else h.reply(404)
    registry.route("GET", "/v2/vsnap/x/blobs/")(blob)
    assert FILE_MEDIA_TYPE.encode() in document
    return document


def test_a_pull_of_many_layers_writes_its_record_a_bounded_number_of_times(
        serve: Callable[[], Server], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Linear in the layer count: the verified record is not rewritten after every blob."""
    from vsnap.host import verified
    from vsnap.registry.pull import pull_image

    registry = serve()
    files = {f"criu/f{i:04d}.img": bytes([i % 251]) for i in range(400)}
    serve_image(registry, files)
    writes: list[int] = []
    real = verified.remember

    def counting(image_dir: Path, digests: dict, *args: Any, **kwargs: Any) -> None:
        writes.append(len(digests))
        real(image_dir, digests, *args, **kwargs)
    monkeypatch.setattr(verified, "remember", counting)
    result = pull_image(f"{registry.address}/vsnap/x:v1", to=Path(target(tmp_path)))
    assert result.downloaded == result.files == 400
    assert len(writes) < 20, f"{len(writes)} record writes for 400 layers"


def test_a_pull_that_filled_the_disk_says_what_it_kept_and_resumes(
        serve: Callable[[], Server], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The failed pull names the files it kept; the next finds room once its own partial blob is
    not counted against the disk (a disk of fixed capacity, simulated by statvfs)."""
    import errno

    from vsnap.protocol.errors import HostNotReady
    from vsnap.registry import pull as pull_module

    registry = serve()
    files = {"criu/big.img": b"b" * (1 << 20), "criu/medium.img": b"m" * (600 << 10), "logs/engine.log": b"log\n"}
    serve_image(registry, files)
    staging_root = Path(target(tmp_path)).parent
    capacity = sum(map(len, files.values())) + pull_module.SPACE_MARGIN + (128 << 10)

    def used() -> int:
        return sum(os.lstat(Path(d) / f).st_blocks * 512 for d, _, fs in os.walk(staging_root) for f in fs)
    real_statvfs = os.statvfs
    monkeypatch.setattr(os, "statvfs", lambda path: SimpleNamespace(f_bavail=capacity - used(), f_frsize=1)
                        if str(path).startswith(str(staging_root)) else real_statvfs(path))
    real_write_blob = pull_module.write_blob

    def full_disk(chunks: Any, layer: Layer, entry: Any, fd: int, *args: Any, **kwargs: Any) -> None:
        if layer.path != "criu/medium.img":
            return real_write_blob(chunks, layer, entry, fd, *args, **kwargs)
        os.write(fd, b"m" * (512 << 10))
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(pull_module, "write_blob", full_disk)
    ref, to = f"{registry.address}/vsnap/x:v1", Path(target(tmp_path))
    with pytest.raises(HostNotReady, match=r"the disk filled while pulling .*: 1 of 3 files are fetched and checked, "
                                           r"kept in .*\.x\.pull-"):
        pull_image_one_job(pull_module, ref, to)
    monkeypatch.setattr(pull_module, "write_blob", real_write_blob)
    result = pull_image_one_job(pull_module, ref, to)
    assert result.reused == 1 and result.downloaded == 2


def pull_image_one_job(pull_module: Any, ref: str, to: Path) -> Any:
    return pull_module.pull_image(ref, to=to, jobs=1)


# --- item 2: credentials only to their origin --------------------------------------------------------------------

def docker_config(tmp_path: Path, registry: str) -> dict[str, str]:
    config = tmp_path / "docker"
    config.mkdir(mode=0o700)
    (config / "config.json").write_text(json.dumps({"auths": {registry: {"auth": AUTH}}}))
    os.chmod(config / "config.json", 0o600)
    return {"DOCKER_CONFIG": str(config)}


def foreign_token_service(serve: Callable[[], Server]) -> Server:
    service = serve()
    service.route("GET", "/token")(lambda h: h.reply(200, b'{"token": "t0k3n"}'))
    return service


def bearer_registry(serve: Callable[[], Server], realm: str) -> Server:
    registry = serve()

    def guarded(h: Hostile) -> None:
        if h.headers.get("Authorization") != "Bearer t0k3n":
            h.reply(401, b"", {"Www-Authenticate": f'Bearer realm="{realm}",service="r",scope="repository:x:pull"'})
        else:
            h.reply(404, b'{"errors":[{"code":"MANIFEST_UNKNOWN","message":"no"}]}')
    registry.route("GET", "/v2/$")(guarded)
    registry.route("GET", "/v2/")(guarded)
    return registry


def test_a_token_service_on_another_origin_gets_no_credentials(serve: Callable[[], Server], tmp_path: Path) -> None:
    service = foreign_token_service(serve)
    registry = bearer_registry(serve, f"http://{service.address}/token")
    env = docker_config(tmp_path, registry.address)
    run = vsnap("pull", f"{registry.address}/vsnap/x:v1", "--to", target(tmp_path), env=env)
    refused_in_one_line(run, 3, f"asks vsnap to send its login to http://{service.address}",
                        "another origin over plain http; refused")
    # naming the host does not let a login travel over plain http
    run = vsnap("pull", f"{registry.address}/vsnap/x:v1", "--to", target(tmp_path),
                env={**env, "VSNAP_ALLOW_FOREIGN_AUTH": "127.0.0.1"})
    refused_in_one_line(run, 3, "over plain http; refused")
    assert service.seen == []
    # without credentials the token is asked for anonymously, and the pull goes on
    empty = tmp_path / "empty"
    empty.mkdir(mode=0o700)
    run = vsnap("pull", f"{registry.address}/vsnap/x:v1", "--to", target(tmp_path), env={"DOCKER_CONFIG": str(empty)})
    refused_in_one_line(run, 4, "does not exist in the registry")
    assert service.seen and all(seen.authorization is None for seen in service.seen)


def test_a_same_origin_token_service_gets_the_login(serve: Callable[[], Server], tmp_path: Path) -> None:
    registry = serve()
    realm = f"http://{registry.address}/token"
    bearer_registry_routes(registry, realm)
    env = docker_config(tmp_path, registry.address)
    run = vsnap("pull", f"{registry.address}/vsnap/x:v1", "--to", target(tmp_path), env=env)
    refused_in_one_line(run, 4, "does not exist in the registry")
    assert [seen.authorization for seen in registry.seen if seen.path.startswith("/token")] == [f"Basic {AUTH}"]


def bearer_registry_routes(registry: Server, realm: str) -> None:
    registry.route("GET", "/token")(lambda h: h.reply(200, b'{"access_token": "t0k3n"}'))

    def guarded(h: Hostile) -> None:
        if h.headers.get("Authorization") != "Bearer t0k3n":
            h.reply(401, b"", {"Www-Authenticate": f'Bearer realm="{realm}",service="r"'})
        else:
            h.reply(404, b"{}")
    registry.route("GET", "/v2/$")(guarded)
    registry.route("GET", "/v2/")(guarded)


def test_an_upload_location_on_another_origin_gets_no_credentials(
        serve: Callable[[], Server], tmp_path: Path) -> None:
    elsewhere = serve()
    registry = serve()
    registry.route("GET", "/v2/$")(with_basic_auth(lambda h: h.reply(200, b"{}")))
    registry.route("HEAD", "/v2/vsnap/x/blobs/")(with_basic_auth(lambda h: h.reply(404)))
    registry.route("POST", "/v2/vsnap/x/blobs/uploads/")(
        with_basic_auth(lambda h: h.reply(202, b"", {"Location": f"http://{elsewhere.address}/upload/1"})))
    registry.route("PUT", "/v2/vsnap/x/manifests/")(with_basic_auth(lambda h: (h.drain(), h.reply(201))[1]))
    elsewhere.route("PATCH", "/upload/")(
        lambda h: (h.drain(), h.reply(202, b"", {"Location": f"http://{elsewhere.address}/upload/1"}))[1])
    elsewhere.route("PUT", "/upload/")(lambda h: (h.drain(), h.reply(201))[1])
    image = make_image(tmp_path / "images" / "img")
    run = vsnap("push", str(image), f"{registry.address}/vsnap/x:v1", env=docker_config(tmp_path, registry.address))
    assert run.rc == 0, run.doc
    assert elsewhere.seen and all(seen.authorization is None for seen in elsewhere.seen), elsewhere.seen
    assert all(seen.authorization == f"Basic {AUTH}" for seen in registry.seen if seen.path != "/v2/")


def test_the_bomb_is_what_it_claims() -> None:
    """The fixture itself: 2 MB on the wire, 2 GiB decoded (checked a member at a time)."""
    assert len(BOMB) < 3 << 20
    assert len(zlib.decompressobj(31).decompress(BOMB[:len(BOMB) // 32])) == 64 << 20
    assert hashlib.sha256(BOMB).hexdigest()


def redirecting_registry(serve: Callable[[], Server], location: Callable[[Server, Server], str]) -> tuple[Server, Server]:
    """A registry that answers a logged-in manifest GET with a redirect to ``location(elsewhere,
    registry)``, and the server elsewhere (404 to every GET)."""
    elsewhere = serve()
    registry = serve()
    elsewhere.route("GET", "/")(lambda h: h.reply(404, b"{}"))

    def basic(h: Hostile) -> None:
        if h.headers.get("Authorization") != f"Basic {AUTH}":
            h.reply(401, b"", {"Www-Authenticate": 'Basic realm="r"'})
        else:
            h.reply(307, b"", {"Location": location(elsewhere, registry)})
    registry.route("GET", "/v2/$")(lambda h: h.reply(401, b"", {"Www-Authenticate": 'Basic realm="r"'}))
    registry.route("GET", "/v2/vsnap/")(basic)
    return registry, elsewhere


def test_a_redirect_to_another_origin_gets_no_credentials(serve: Callable[[], Server], tmp_path: Path) -> None:
    registry, elsewhere = redirecting_registry(serve, lambda elsewhere, _: f"http://{elsewhere.address}/m")
    run = vsnap("pull", f"{registry.address}/vsnap/x:v1", "--to", target(tmp_path),
                env=docker_config(tmp_path, registry.address))
    refused_in_one_line(run, 4, "does not exist in the registry")
    assert elsewhere.seen and all(seen.authorization is None for seen in elsewhere.seen), elsewhere.seen


def test_an_upload_the_registry_never_reads_is_given_up_at_the_deadline(
        serve: Callable[[], Server], tmp_path: Path) -> None:
    registry = serve()
    registry.route("HEAD", "/v2/vsnap/x/blobs/")(lambda h: h.reply(404))
    registry.route("POST", "/v2/vsnap/x/blobs/uploads/")(lambda h: h.reply(202, b"", {"Location": "/upload/1"}))
    registry.route("PATCH", "/upload/")(lambda h: time.sleep(30))
    registry.route("PUT", "/upload/")(lambda h: time.sleep(30))
    image = make_image(tmp_path / "images" / "img")
    run = vsnap("push", str(image), f"{registry.address}/vsnap/x:v1")
    assert run.rc == 3 and "in time" in run.doc["message"] and "\n" not in run.doc["message"], run.doc
    assert run.seconds < DEADLINE_S + 8, run.seconds


def test_a_steady_transfer_past_the_grace_is_not_cut(
        serve: Callable[[], Server], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The deadline moves with the bytes: 3 MiB at about 1.3 MiB/s outlasts a 1 s grace and is kept."""
    from vsnap.registry.pull import pull_image

    registry = serve()
    data = os.urandom(3 << 20)
    serve_image(registry, {"criu/pages-1.img": data})

    def steady(h: Hostile) -> None:
        h.send_response(200)
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        for offset in range(0, len(data), 64 << 10):
            h.wfile.write(data[offset:offset + (64 << 10)])
            h.wfile.flush()
            time.sleep(0.05)
    registry.route("GET", "/v2/vsnap/x/blobs/" + sha256_digest(data))(steady)
    monkeypatch.setenv("VSNAP_REGISTRY_DEADLINE_S", "1")
    started = time.monotonic()
    result = pull_image(f"{registry.address}/vsnap/x:v1", to=Path(target(tmp_path)))
    assert result.downloaded == 1 and time.monotonic() - started > 2


# --- hostile pass 14: a URL two parsers read differently -------------------------------------------------------
# urllib's urlsplit (which decides where credentials go) reads `http://A\@B/` as B; urllib3 (which
# connects) reads it as A: before the fix, credentials went to A with every such redirect, realm and
# upload location. Each is refused now, and A never hears from vsnap.

def test_a_token_realm_two_parsers_read_differently_is_refused(serve: Callable[[], Server], tmp_path: Path) -> None:
    elsewhere = foreign_token_service(serve)
    registry = serve()
    bearer_registry_routes(registry, f"http://{elsewhere.address}\\@{registry.address}/token")
    run = vsnap("pull", f"{registry.address}/vsnap/x:v1", "--to", target(tmp_path),
                env=docker_config(tmp_path, registry.address))
    refused_in_one_line(run, 3, "a URL that HTTP libraries read differently")
    assert elsewhere.seen == []


def test_a_redirect_two_parsers_read_differently_is_refused(serve: Callable[[], Server], tmp_path: Path) -> None:
    registry, elsewhere = redirecting_registry(
        serve, lambda elsewhere, registry: f"http://{elsewhere.address}\\@{registry.address}/m")
    run = vsnap("pull", f"{registry.address}/vsnap/x:v1", "--to", target(tmp_path),
                env=docker_config(tmp_path, registry.address))
    refused_in_one_line(run, 3, "a URL that HTTP libraries read differently")
    assert elsewhere.seen == []


def test_an_upload_location_two_parsers_read_differently_is_refused(
        serve: Callable[[], Server], tmp_path: Path) -> None:
    elsewhere = serve()
    registry = serve()
    elsewhere.route("PATCH", "/")(lambda h: (h.drain(), h.reply(500))[1])
    registry.route("GET", "/v2/$")(lambda h: h.reply(200, b"{}"))
    registry.route("HEAD", "/v2/vsnap/x/blobs/")(lambda h: h.reply(404))
    registry.route("POST", "/v2/vsnap/x/blobs/uploads/")(
        lambda h: h.reply(202, b"", {"Location": f"http://{elsewhere.address}\\@{registry.address}/upload/1"}))
    image = make_image(tmp_path / "images" / "img")
    run = vsnap("push", str(image), f"{registry.address}/vsnap/x:v1", env=docker_config(tmp_path, registry.address))
    refused_in_one_line(run, 3, "a URL that HTTP libraries read differently")
    assert elsewhere.seen == []


@pytest.mark.parametrize("url, plain", [
    ("http://127.0.0.1:5000/v2/x/blobs/sha256:ab", True),
    ("https://storage.example.com/b?X-Amz-Credential=AK%2F2026&sig=a@b", True),
    ("http://[::1]:5000/v2/", True),
    ("http://192.0.2.2:5516\\@127.0.0.1:5515/token", False),
    ("http://user:pass@127.0.0.1:5515/token", False),
    ("http://127.0.0.1:5515/a b", False),
    ("http://127.0.0.1:5515\t/x", False),
    ("http://127.0.0.1:5515/\u00e9", False),
])
def test_which_urls_are_unambiguous(url: str, plain: bool) -> None:
    from vsnap.registry.client import _origin, unambiguous_url

    assert unambiguous_url(url) is plain
    assert (_origin(url) != ("", "", 0)) is plain
