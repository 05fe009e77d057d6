"""A large raw layer (the weights file) pulled as byte ranges side by side (issue 27, item 3).

Through Debian's docker-registry on loopback (its access log counts the 206 answers): a fake image
whose weights file is four 64 MiB pieces (the last one short) is pulled in four ranges, checked and
published; one part or one stream by VSNAP_PULL_PARTS=1; an interrupted pull resumes; a real CPU
capture padded with such a weights file is pulled in ranges and restored with its oracle.

Through a registry that lies (test_registry_hostile's small http.server): Range ignored (the
whole blob, 200: one stream, as before), a 206 whose Content-Range is not the range asked, a part
short or overlong by its Content-Length or by its body, a 206 of encoded bytes, a 200 to a later
part, a part whose bytes are wrong (the pieces do not match: the file named), a part that fails
while another is still arriving (cancelled at once), ranges redirected to storage on another
origin (the Range header goes, the login does not), the verified record written per file, so the
verify phase hashes nothing again, and a disk too full for the preallocated file. Without a
registry: the parts are whole pieces that tile the file, VSNAP_PULL_PARTS is checked, and a
filesystem without fallocate gets a sparse file."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from tests.conftest import VSNAP, engine_processes
from tests.integration.conftest import run_vsnap, write_spec
from tests.integration.registry_server import DOCKER_REGISTRY, LocalRegistry
from tests.integration.test_registry_hostile import (  # noqa: F401  (serve: the fixture)
    AUTH,
    Hostile,
    Server,
    docker_config,
    refused_in_one_line,
    serve,
    target,
    vsnap,
    with_basic_auth,
)
from tests.unit.fake_image import make_image, manifest
from vsnap import read_manifest
from vsnap.image.manifest import PIECES_SCHEME
from vsnap.image.store import PIECE, piece_hashes, verify_files
from vsnap.protocol.control import write_atomic
from vsnap.registry.oci import Layer, build_manifest, sha256_digest
from vsnap.registry.ranged import PARTS_ENV

WEIGHTS = "weights/rank0.bin"
SIZE = 3 * PIECE + 12345                       # four pieces, the last one short: four parts
PART_1 = f"bytes {PIECE}-{2 * PIECE - 1}"      # how the messages name the second part

needs_registry = pytest.mark.skipif(not os.path.exists(DOCKER_REGISTRY),
                                    reason="docker-registry is not installed (make system installs it)")


@pytest.fixture(scope="module")
def weights() -> bytes:
    """Random bytes, with 2 MiB of zeros in the middle of the second piece (not written by the pull)."""
    data = bytearray(os.urandom(SIZE))
    data[PIECE + (8 << 20):PIECE + (10 << 20)] = bytes(2 << 20)
    return bytes(data)


def pieces_digest(data: bytes) -> str:
    return hashlib.sha256("".join(hashlib.sha256(data[o:o + PIECE]).hexdigest()
                                  for o in range(0, len(data), PIECE)).encode()).hexdigest()


def ranged_manifest(files: dict[str, bytes]) -> dict[str, Any]:
    """fake_image's manifest of ``files``, the weights hashed by pieces as a capture records them."""
    doc = json.loads(manifest(files).model_dump_json())
    doc["files"][WEIGHTS] = {"size": len(files[WEIGHTS]), "digest": pieces_digest(files[WEIGHTS]),
                             "scheme": PIECES_SCHEME}
    return doc


def image_files(weights: bytes) -> dict[str, bytes]:
    return {WEIGHTS: weights, "criu/pages-1.img": b"pages" * 100, "logs/engine.log": b"log\n"}


# --- a real registry -----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Pushed:
    registry: LocalRegistry
    ref: str
    weights_digest: str
    base: Path


@pytest.fixture(scope="module")
def pushed(tmp_path_factory: pytest.TempPathFactory, weights: bytes) -> Iterator[Pushed]:
    if not os.path.exists(DOCKER_REGISTRY):
        pytest.skip("docker-registry is not installed (make system installs it)")
    base = tmp_path_factory.mktemp("ranged")
    files = image_files(weights)
    image = make_image(base / "images" / "big", files, raw=ranged_manifest(files))
    with LocalRegistry(base / "registry", access_log=True) as registry:
        ref = f"{registry.address}/vsnap/big:v1"
        result = subprocess.run([VSNAP, "push", str(image), ref, "--json"], capture_output=True, text=True,
                                timeout=300)
        assert result.returncode == 0, result.stderr
        yield Pushed(registry, ref, sha256_digest(weights), base)


def blob_gets(pushed: Pushed, since: int, count: int) -> list[tuple[int, int]]:
    """(status, bytes) of each GET of the weights blob the registry logged after line ``since``,
    sorted; waits (a little) for ``count`` of them: the registry logs a request once its handler
    returned, which may be just after the client has every byte."""
    deadline = time.monotonic() + 5
    while True:
        gets = sorted((line.status, line.bytes) for line in pushed.registry.requests()[since:]
                      if line.method == "GET" and line.path.endswith("/blobs/" + pushed.weights_digest))
        if len(gets) >= count or time.monotonic() > deadline:
            return gets
        time.sleep(0.05)


def logged(pushed: Pushed) -> int:
    """How many requests the registry has logged, once that number held for half a second."""
    count, stable_since = len(pushed.registry.requests()), time.monotonic()
    while time.monotonic() - stable_since < 0.5:
        time.sleep(0.05)
        if (now := len(pushed.registry.requests())) != count:
            count, stable_since = now, time.monotonic()
    return count


def pull(pushed: Pushed, name: str, env: dict[str, str] | None = None, rc: int = 0, *args: str) -> dict:
    result = subprocess.run([VSNAP, "pull", pushed.ref, "--to", str(pushed.base / "pulled" / name), "--json", *args],
                            capture_output=True, text=True, timeout=300, env={**os.environ, **(env or {})})
    assert result.returncode == rc, f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    return json.loads(result.stdout) if result.stdout.strip() else {}


@needs_registry
def test_a_large_raw_layer_is_pulled_in_byte_ranges(pushed: Pushed, weights: bytes) -> None:
    since = len(pushed.registry.requests())
    doc = pull(pushed, "ranged")  # the default: four parts, here one piece each
    assert blob_gets(pushed, since, 4) == sorted([(206, PIECE)] * 3 + [(206, SIZE - 3 * PIECE)])
    pulled = Path(doc["image"])
    verify_files(pulled, read_manifest(pulled))  # every file hashed again, and the trust model
    assert (pulled / WEIGHTS).read_bytes() == weights
    assert doc["bytes_received"] == doc["image_bytes"]
    assert doc["ranged"] == 1  # the weights file

    since = len(pushed.registry.requests())
    assert pull(pushed, "one-stream", {PARTS_ENV: "1"})["ranged"] == 0
    assert blob_gets(pushed, since, 1) == [(200, SIZE)]

    since = len(pushed.registry.requests())
    pull(pushed, "option", {PARTS_ENV: "4"}, 0, "--parts", "2")  # the option over the variable
    assert blob_gets(pushed, since, 2) == sorted([(206, 2 * PIECE), (206, SIZE - 2 * PIECE)])

    since = len(pushed.registry.requests())
    pull(pushed, "two", {PARTS_ENV: "2"})
    assert blob_gets(pushed, since, 2) == sorted([(206, 2 * PIECE), (206, SIZE - 2 * PIECE)])

    refused = pull(pushed, "bad", {PARTS_ENV: "0"}, rc=2)
    assert PARTS_ENV in refused["message"] and "from 1 to 64" in refused["message"]


@needs_registry
def test_an_interrupted_ranged_pull_resumes(pushed: Pushed) -> None:
    """Killed after its first file: the rerun keeps what was checked and fetches the weights in
    ranges, whole (parts do not resume one by one)."""
    target_dir = pushed.base / "pulled" / "interrupted"
    killed = subprocess.run([VSNAP, "pull", pushed.ref, "--to", str(target_dir), "--jobs", "2"],
                            capture_output=True, text=True, timeout=300,
                            env={**os.environ, "VSNAP_FAILPOINT": "blob pulled"})
    assert killed.returncode == -9, killed.stderr
    assert not os.path.lexists(target_dir)
    since = logged(pushed)  # the killed pull's parts in flight are logged as their connections close
    doc = pull(pushed, "interrupted")
    assert doc["reused"] >= 1 and doc["downloaded"] == doc["files"] - doc["reused"]
    gets = blob_gets(pushed, since, 4)
    assert len(gets) == 4 and all(status == 206 for status, _ in gets) and sum(n for _, n in gets) == SIZE
    verify_files(target_dir, read_manifest(target_dir))


@pytest.mark.criu
@needs_registry
def test_a_capture_with_a_large_weights_file_pulled_in_ranges_restores(tmp_path: Path) -> None:
    """A real CPU capture, padded as scripts/bench_registry.py pads it with a weights file of
    four pieces (the cpu engine never reads it), pushed, pulled in ranges with the original gone,
    restored, and its oracle passes."""
    from tests.integration.test_cpu_roundtrip import assert_serves_oracle
    from vsnap import restore_image, stop_server

    spec = write_spec(tmp_path, "cpu-ranged")
    captured = run_vsnap("capture", str(spec), "--json")
    assert captured.returncode == 0, captured.stderr
    image = Path(json.loads(captured.stdout)["image"])
    try:
        os.mkdir(image / "weights", 0o700)
        with open(image / WEIGHTS, "wb") as f:
            f.write(os.urandom(SIZE))
        os.chmod(image / WEIGHTS, 0o600)
        doc = json.loads((image / "manifest.json").read_text())
        doc["files"][WEIGHTS] = {"size": SIZE, "digest": piece_hashes(image, {WEIGHTS: SIZE})[WEIGHTS],
                                 "scheme": PIECES_SCHEME}
        doc["sizes"]["image_bytes"] = sum(entry["size"] for entry in doc["files"].values())
        write_atomic(image, "manifest.json", json.dumps(doc, indent=2).encode())
        with LocalRegistry(tmp_path / "registry", access_log=True) as registry:
            ref = f"{registry.address}/vsnap/cpu-ranged:v1"
            pushed = subprocess.run([VSNAP, "push", str(image), ref], capture_output=True, text=True, timeout=300)
            assert pushed.returncode == 0, pushed.stderr
            shutil.rmtree(image)  # the local image is gone: the pulled one is restored
            pulled = tmp_path / "pulled" / "cpu-ranged"
            result = subprocess.run([VSNAP, "pull", ref, "--to", str(pulled)], capture_output=True, text=True,
                                    timeout=300, env={**os.environ, PARTS_ENV: "4"})
            assert result.returncode == 0, result.stderr
            digest = doc["files"][WEIGHTS]["digest"]
            layer = [line for line in registry.requests() if line.method == "GET" and line.status == 206]
            assert len(layer) == 4 and sum(line.bytes for line in layer) == SIZE, layer
            assert read_manifest(pulled).files[WEIGHTS].digest == digest
        server = restore_image(pulled, port=0)
        try:
            manifest_ = read_manifest(pulled)
            assert_serves_oracle(server.url, manifest_.oracle, manifest_.launch.oracle_top_k)
        finally:
            stop_server(server)
    finally:
        for pid in engine_processes(tmp_path / "control" / "cpu-ranged"):
            subprocess.run(["kill", "-9", str(pid)])


# --- a registry that lies ---------------------------------------------------------------------------------------

Answer = Callable[[Hostile, bytes, int, int], None]


def good(h: Hostile, data: bytes, start: int, end: int) -> None:
    h.reply(206, data[start:end + 1], {"Content-Range": f"bytes {start}-{end}/{len(data)}"})


@dataclass
class Lying:
    """A hostile registry serving the fake image; ``answer`` answers each ranged GET of the
    weights blob; every GET of a blob is logged with its Range header (None without one)."""

    registry: Server
    weights_digest: str
    answer: Answer = good
    asked: list[tuple[str, str | None]] = field(default_factory=list)

    def ranges(self) -> list[str | None]:
        return [rng for digest, rng in self.asked if digest == self.weights_digest]


def lying_registry(registry: Server, weights: bytes, answer: Answer = good, prefix: str = "/v2/vsnap/x/blobs/",
                   tag: str = "v1") -> Lying:
    files = image_files(weights)
    doc = ranged_manifest(files)
    config = json.dumps(doc).encode()
    layers = [Layer(rel, "raw", sha256_digest(data), len(data)) for rel, data in files.items()]
    document = build_manifest(config, layers, manifest(files))
    blobs = {sha256_digest(data): data for data in [config, *files.values()]}
    lying = Lying(registry, sha256_digest(weights), answer)
    media = {"Content-Type": "application/vnd.oci.image.manifest.v1+json"}
    registry.route("GET", f"/v2/vsnap/x/manifests/{tag}")(lambda h: h.reply(200, document, media))
    registry.route("GET", prefix)(blob_handler(blobs, lying))
    return lying


def blob_handler(blobs: dict[str, bytes], lying: Lying) -> Callable[[Hostile], None]:
    def blob(h: Hostile) -> None:
        digest = h.path.rsplit("/", 1)[-1]
        rng = h.headers.get("Range")
        lying.asked.append((digest, rng))
        data = blobs.get(digest)
        if data is None:
            h.reply(404)
            return
        match = re.fullmatch(r"bytes=([0-9]+)-([0-9]+)", rng or "")
        if match is None:
            h.reply(200, data)
            return
        (lying.answer if digest == lying.weights_digest else good)(h, data, int(match[1]), int(match[2]))
    return blob


def unframed(h: Hostile, status: int, headers: dict[str, str], body: bytes) -> None:
    """An answer without Content-Length: its body ends where the connection closes."""
    h.send_response(status)
    for key, value in {**headers, "Connection": "close"}.items():
        h.send_header(key, value)
    h.end_headers()
    h.wfile.write(body)
    h.wfile.flush()
    h.close_connection = True


def on_part_1(wrong: Answer) -> Answer:
    """``wrong`` answers the second part (bytes PIECE..2*PIECE-1); the others are answered right."""
    return lambda h, data, start, end: (wrong if start == PIECE else good)(h, data, start, end)


def range_header(start: int, end: int, size: int = SIZE) -> dict[str, str]:
    return {"Content-Range": f"bytes {start}-{end}/{size}"}


WRONG_ANSWERS: dict[str, tuple[Answer, str]] = {
    "Content-Range of other bytes": (
        lambda h, d, s, e: h.reply(206, d[:e - s + 1], range_header(0, e - s)),
        "Content-Range 'bytes 0-67108863/"),
    "Content-Range of another size": (
        lambda h, d, s, e: h.reply(206, d[s:e + 1], range_header(s, e, SIZE + 1)),
        f"vsnap asked for bytes {PIECE}-{2 * PIECE - 1}/{SIZE}"),
    "Content-Range missing": (
        lambda h, d, s, e: h.reply(206, d[s:e + 1]), "Content-Range ''"),
    "short by its Content-Length": (
        lambda h, d, s, e: h.reply(206, d[s:e], range_header(s, e)),
        f"Content-Length '{PIECE - 1}'; the range is {PIECE} bytes"),
    "short by its body": (
        lambda h, d, s, e: unframed(h, 206, range_header(s, e), d[s:s + (PIECE >> 1)]),
        f"{PIECE >> 1} bytes, then the end of the body; the range is {PIECE} bytes"),
    "overlong by its Content-Length": (
        lambda h, d, s, e: h.reply(206, d[s:e + 1] + b"\xee" * (1 << 20), range_header(s, e)),
        f"Content-Length '{PIECE + (1 << 20)}'; the range is {PIECE} bytes"),
    "overlong by its body": (
        lambda h, d, s, e: unframed(h, 206, range_header(s, e), d[s:e + 1] + b"\xee" * (4 << 20)),
        f"more than the {PIECE} bytes asked"),
    "encoded": (
        lambda h, d, s, e: h.reply(206, d[s:e + 1], {**range_header(s, e), "Content-Encoding": "gzip"}),
        "Content-Encoding 'gzip'"),
    "200 after a 206": (
        lambda h, d, s, e: h.reply(200, d), "HTTP 200 (the whole blob), after answering the first range with 206"),
}


@pytest.mark.parametrize("wrong", list(WRONG_ANSWERS))
def test_a_part_answered_wrongly_is_refused_naming_it(wrong: str, serve: Callable[[], Server], tmp_path: Path,
                                                      weights: bytes) -> None:
    answer, needle = WRONG_ANSWERS[wrong]
    lying = lying_registry(serve(), weights, on_part_1(answer))
    to = target(tmp_path)
    run = vsnap("pull", f"{lying.registry.address}/vsnap/x:v1", "--to", to, env={PARTS_ENV: "4"})
    refused_in_one_line(run, 3, f"GET blob sha256:{lying.weights_digest[7:19]} {PART_1}", f"({WEIGHTS})", needle)
    assert "VSNAP_PULL_PARTS=1" in run.doc["hint"]
    assert not os.path.lexists(to)
    asked = lying.ranges()  # the first part alone, then the others (those not yet sent when one failed are not)
    assert asked[0] == f"bytes=0-{PIECE - 1}" and f"bytes={PIECE}-{2 * PIECE - 1}" in asked
    assert set(asked) <= {f"bytes={o}-{min(o + PIECE, SIZE) - 1}" for o in range(0, SIZE, PIECE)}
    # nothing was written outside the part asked: the third part's bytes are its own, or a hole
    incoming = [p for p in Path(to).parent.glob(".x.pull-*/.incoming/*")]
    for path in incoming:
        with open(path, "rb") as f:
            f.seek(2 * PIECE)
            assert b"\xee" * 64 not in f.read(8 << 20)


def test_a_part_whose_bytes_are_wrong_fails_the_pull_naming_the_file(
        serve: Callable[[], Server], tmp_path: Path, weights: bytes) -> None:
    def flipped(h: Hostile, data: bytes, start: int, end: int) -> None:
        body = bytearray(data[start:end + 1])
        body[100] ^= 0xFF
        h.reply(206, bytes(body), range_header(start, end))
    lying = lying_registry(serve(), weights, on_part_1(flipped))
    to = target(tmp_path)
    run = vsnap("pull", f"{lying.registry.address}/vsnap/x:v1", "--to", to, env={PARTS_ENV: "4"})
    refused_in_one_line(run, 4, f"the blob for {WEIGHTS} does not match manifest.json", "fetched in 4 byte ranges")
    assert len(lying.ranges()) == 4 and not os.path.lexists(to)


def test_a_registry_that_ignores_range_is_read_in_one_stream(
        serve: Callable[[], Server], tmp_path: Path, weights: bytes, monkeypatch: pytest.MonkeyPatch) -> None:
    from vsnap.registry.pull import pull_image

    lying = lying_registry(serve(), weights, lambda h, data, start, end: h.reply(200, data))
    monkeypatch.setenv("VSNAP_REGISTRY_DEADLINE_S", "5")
    result = pull_image(f"{lying.registry.address}/vsnap/x:v1", to=Path(target(tmp_path)), parts=4)
    assert result.ranged == 0 and result.downloaded == 3
    assert lying.ranges() == [f"bytes=0-{PIECE - 1}"]  # asked once, read whole: no second request
    assert (result.image_dir / WEIGHTS).read_bytes() == weights


def test_a_failing_part_cancels_the_one_still_arriving(
        serve: Callable[[], Server], tmp_path: Path, weights: bytes) -> None:
    """The first part arrives at ~1.3 MiB/s (50 s for its 64 MiB, over the 64 KiB/s floor, so its
    deadline would not end it); the second is refused at once: the pull ends in seconds."""
    def slow(h: Hostile, data: bytes, start: int, end: int) -> None:
        h.send_response(206)
        for key, value in {**range_header(start, end), "Content-Length": str(end - start + 1)}.items():
            h.send_header(key, value)
        h.end_headers()
        for offset in range(start, end + 1, 64 << 10):
            h.wfile.write(data[offset:min(offset + (64 << 10), end + 1)])
            h.wfile.flush()
            time.sleep(0.05)

    def answer(h: Hostile, data: bytes, start: int, end: int) -> None:
        if start == 0:
            slow(h, data, start, end)
        elif start == PIECE:
            h.reply(206, data[:end - start + 1], range_header(0, end - start))
        else:
            good(h, data, start, end)
    lying = lying_registry(serve(), weights, answer)
    run = vsnap("pull", f"{lying.registry.address}/vsnap/x:v1", "--to", target(tmp_path), env={PARTS_ENV: "4"})
    refused_in_one_line(run, 3, f"{PART_1} ({WEIGHTS}) with Content-Range 'bytes 0-")
    assert run.seconds < 15, run.seconds


def test_ranges_redirected_to_storage_take_the_range_and_not_the_login(
        serve: Callable[[], Server], tmp_path: Path, weights: bytes, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each part's GET is redirected (as distribution redirects to S3): the Range header goes
    with it, the docker config's login stays with the registry."""
    from vsnap.registry.pull import pull_image

    storage = serve()
    registry = serve()
    lying = lying_registry(storage, weights, prefix="/storage/")
    seen: list[tuple[str | None, str | None]] = []
    real = storage.routes[("GET", "/storage/")]

    def recording(h: Hostile) -> None:
        seen.append((h.headers.get("Range"), h.headers.get("Authorization")))
        real(h)
    storage.routes[("GET", "/storage/")] = recording

    registry.route("GET", "/v2/$")(lambda h: h.reply(401, b"", {"Www-Authenticate": 'Basic realm="r"'}))
    manifest_route = storage.routes[("GET", "/v2/vsnap/x/manifests/v1")]
    registry.route("GET", "/v2/vsnap/x/manifests/")(with_basic_auth(manifest_route))
    registry.route("GET", "/v2/vsnap/x/blobs/")(with_basic_auth(lambda h: h.reply(
        307, b"", {"Location": f"http://{storage.address}/storage/" + h.path.rsplit("/", 1)[-1]})))
    for key, value in docker_config(tmp_path, registry.address).items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("VSNAP_REGISTRY_DEADLINE_S", "5")
    result = pull_image(f"{registry.address}/vsnap/x:v1", to=Path(target(tmp_path)), parts=4)
    assert result.ranged == 1
    assert sorted(lying.ranges()) == sorted(f"bytes={o}-{min(o + PIECE, SIZE) - 1}" for o in range(0, SIZE, PIECE))
    assert seen and all(auth is None for _, auth in seen), seen
    assert all(seen.authorization == f"Basic {AUTH}" for seen in registry.seen if seen.path != "/v2/")
    assert (result.image_dir / WEIGHTS).read_bytes() == weights


def test_the_ranged_file_is_recorded_once_and_not_hashed_again(
        serve: Callable[[], Server], tmp_path: Path, weights: bytes, monkeypatch: pytest.MonkeyPatch) -> None:
    """The file is checked from its parts' pieces, recorded (host.verified) as one file, and the
    verify phase that follows the download hashes nothing again: not the weights file, which is
    the last renamed into place (a record written within a tick of it would leave it out)."""
    from vsnap.host import verified
    from vsnap.image import store
    from vsnap.registry.pull import pull_image

    lying = lying_registry(serve(), weights)
    hashed: list[dict[str, int]] = []
    real_hashes = store.piece_hashes
    monkeypatch.setattr(store, "piece_hashes", lambda root, files: hashed.append(dict(files)) or
                        real_hashes(root, files))
    recorded: list[set[str]] = []
    real_remember = verified.remember

    def remember(image_dir: Path, digests: dict, *args: Any, **kwargs: Any) -> None:
        if ".pull-" in image_dir.name:
            recorded.append(set(digests))
        real_remember(image_dir, digests, *args, **kwargs)
    monkeypatch.setattr(verified, "remember", remember)
    result = pull_image(f"{lying.registry.address}/vsnap/x:v1", to=Path(target(tmp_path)), parts=4)
    assert result.ranged == 1 and len(lying.ranges()) == 4
    assert recorded and WEIGHTS in recorded[-1]
    assert all(files == {} for files in hashed), hashed  # the verify phase found every file recorded


# --- the plan ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("size", "parts", "expected"), [
    (SIZE, 4, [0, PIECE, 2 * PIECE, 3 * PIECE]),
    (SIZE, 2, [0, 2 * PIECE]),
    (SIZE, 8, [0, PIECE, 2 * PIECE, 3 * PIECE]),       # never less than a piece
    (10 * PIECE, 4, [0, 2 * PIECE, 5 * PIECE, 7 * PIECE]),
    (2 * PIECE, 4, []),                                # not over RANGED_MIN_BYTES: one stream
    (SIZE, 1, []),
])
def test_parts_are_whole_pieces_that_tile_the_file(size: int, parts: int, expected: list[int]) -> None:
    from vsnap.image.manifest import FileEntry
    from vsnap.registry.ranged import plan

    entry = FileEntry(size=size, digest="0" * 64, scheme=PIECES_SCHEME)
    planned = plan(Layer(WEIGHTS, "raw", "sha256:" + "0" * 64, size), entry, parts)
    assert [part.start for part in planned] == expected
    if planned:
        assert planned[-1].end == size - 1 and sum(part.length for part in planned) == size
        assert all(part.end + 1 == after.start for part, after in zip(planned, planned[1:]))
    zstd = Layer(WEIGHTS, "zstd", "sha256:" + "0" * 64, size)
    assert plan(zstd, entry, parts) == []  # a compressed layer's ranges are not the file's


def test_the_number_of_parts_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    from vsnap.protocol.errors import UsageError
    from vsnap.registry.ranged import DEFAULT_PARTS, parts_wanted

    monkeypatch.delenv(PARTS_ENV, raising=False)
    assert parts_wanted() == DEFAULT_PARTS and parts_wanted(1) == 1
    for bad in ("0", "65", "four", "-2", "1.5"):
        monkeypatch.setenv(PARTS_ENV, bad)
        with pytest.raises(UsageError, match=f"{PARTS_ENV} is .*; it is a whole number from 1 to 64"):
            parts_wanted()
    monkeypatch.setenv(PARTS_ENV, "8")
    assert parts_wanted() == 8 and parts_wanted(2) == 2


def test_a_disk_too_full_for_the_file_fails_before_a_part_is_written(
        serve: Callable[[], Server], tmp_path: Path, weights: bytes, monkeypatch: pytest.MonkeyPatch) -> None:
    """The preallocation meets the full disk (a quota, another writer since the free-space check):
    the pull's own disk-full error, with what it keeps, and only the first part was asked."""
    import errno

    from vsnap.protocol.errors import HostNotReady
    from vsnap.registry import ranged
    from vsnap.registry.pull import pull_image

    def full(fd: int, size: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(ranged, "preallocate", full)
    lying = lying_registry(serve(), weights)
    with pytest.raises(HostNotReady, match=r"the disk filled while pulling .*: \d of 3 files are fetched and checked"):
        pull_image(f"{lying.registry.address}/vsnap/x:v1", to=Path(target(tmp_path)), parts=4, jobs=1)
    assert lying.ranges() == [f"bytes=0-{PIECE - 1}"]


def test_a_filesystem_without_fallocate_gets_a_sparse_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from vsnap.registry import ranged

    monkeypatch.setattr(ranged, "_fallocate", lambda: None)
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        ranged.preallocate(fd, 3 * PIECE)
        st = os.fstat(fd)
        assert st.st_size == 3 * PIECE and st.st_blocks == 0
    finally:
        os.close(fd)
