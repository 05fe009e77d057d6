"""The OCI layout of an image, references, and what a pull refuses from a hostile registry
(no registry needed: these act on documents and streams)."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import threading
from pathlib import Path

import pytest
import zstandard

from vsnap.image.manifest import FileEntry, Manifest
from vsnap.image.store import PIECE, piece_hashes
from vsnap.protocol.errors import ArtifactError, ImageUntrusted, RegistryUnavailable, UsageError
from vsnap.registry.blobio import Cancelled, FileDigest, HashingIterator, checking, parallel, write_blob, zstd_chunks
from vsnap.registry.client import docker_config_path, inline_credentials, read_docker_config
from vsnap.registry.oci import (
    ARTIFACT_TYPE,
    CONFIG_MEDIA_TYPE,
    MAX_OCI_MANIFEST_BYTES,
    OCI_MANIFEST,
    TITLE,
    Layer,
    Reference,
    build_manifest,
    encoding_for,
    match_manifest,
    parse_artifact,
    parse_reference,
    sha256_digest,
)
from vsnap.registry.pull import make_or_adopt_staging, staging_dir

HEX = "a" * 64


def make_manifest(files: dict[str, bytes]) -> Manifest:
    return Manifest.model_validate({
        "format_version": 2, "protocol_version": 1, "vsnap_version": "0.2.0", "created_at": "2026-12-01T00:00:00+00:00",
        "name": "t", "engine": "cpu", "spec": {}, "control_dir": "/run/vsnap/t", "control_mount_key": "m0",
        "shm_mount_key": "m1", "netns_key": "n", "externals": {},
        "launch": {"engine": "cpu", "model": "/m", "served_model_name": "t", "oracle_prompts": ["a"],
                   "oracle_max_tokens": 1, "oracle_top_k": 1, "oracle_tolerance": 0.0, "timeout_s": 1.0},
        "oracle": {"samples": []},
        "host": {"hostname": "h", "kernel": "k", "arch": "x86_64", "criu": "4.2", "python": "3.11", "vsnap": "0.2.0"},
        "files": {rel: {"size": len(data), "digest": hashlib.sha256(data).hexdigest(), "scheme": "sha256"}
                  for rel, data in files.items()},
    })


def layers_of(files: dict[str, bytes]) -> list[Layer]:
    return [Layer(rel, "raw", sha256_digest(data), len(data)) for rel, data in files.items()]


FILES = {"criu/core-1.img": b"core", "criu/pages-1.img": b"\0" * 1000, "logs/engine.log": b"log"}
REF = Reference("127.0.0.1:5000", "vsnap/t", "v1")


def document(**changes: object) -> dict:
    doc = json.loads(build_manifest(b"{}", layers_of(FILES), make_manifest(FILES)))
    doc.update(changes)
    return doc


def encode(doc: dict) -> bytes:
    return json.dumps(doc).encode()


# --- references ---------------------------------------------------------------------------------

@pytest.mark.parametrize("text, expected", [
    ("127.0.0.1:5000/vsnap/cpu:v1", Reference("127.0.0.1:5000", "vsnap/cpu", "v1")),
    ("localhost/cpu", Reference("localhost", "cpu")),
    ("registry.example.com/a/b/c", Reference("registry.example.com", "a/b/c")),
    (f"reg.io:443/x@sha256:{HEX}", Reference("reg.io:443", "x", None, f"sha256:{HEX}")),
    (f"reg.io/x:t@sha256:{HEX}", Reference("reg.io", "x", "t", f"sha256:{HEX}")),
    ("[::1]:5000/x:latest", Reference("[::1]:5000", "x", "latest")),
])
def test_references_parse(text: str, expected: Reference) -> None:
    assert parse_reference(text) == expected
    assert str(expected) == text


@pytest.mark.parametrize("text, why", [
    ("cpu:v1", "name the registry first"),
    ("docker/cpu:v1", "not a registry host"),              # Docker Hub is never implied
    ("reg.io/Upper", "a repository is lowercase"),
    ("reg.io/a/../b", "a repository is lowercase"),
    ("reg.io//a", "a repository is lowercase"),
    ("reg.io/a:-bad", "a tag is"),
    ("reg.io/a@sha256:abc", "a digest is sha256"),
    ("reg.io/a@md5:" + "a" * 32, "a digest is sha256"),
    ("reg.io/a b", "spaces or control characters"),
    ("reg.io/a\x1b[2J", "spaces or control characters"),
    ("re_g.io/a", "not a registry host"),
])
def test_bad_references_are_usage_errors(text: str, why: str) -> None:
    with pytest.raises(UsageError, match=why) as caught:
        parse_reference(text)
    assert caught.value.exit_code == 2 and "REGISTRY/REPOSITORY" in caught.value.hint


def test_only_loopback_registries_are_plain_http_by_default() -> None:
    assert parse_reference("127.0.0.1:5000/a").loopback and parse_reference("localhost:5000/a").loopback
    assert parse_reference("[::1]:5000/a").loopback
    assert not parse_reference("127.0.0.1.example.com/a").loopback
    assert not parse_reference("reg.io:5000/a").loopback


# --- the layout ---------------------------------------------------------------------------------

def test_encoding_weights_raw_pages_compressed_small_files_raw() -> None:
    assert encoding_for("weights/rank0.bin", 16 << 30) == "raw"
    assert encoding_for("criu/pages-1.img", 100 << 20) == "zstd"
    assert encoding_for("shm/psm_abc", 400 << 20) == "zstd"
    assert encoding_for("criu/core-1.img", 4096) == "raw"


def test_manifest_is_vsnaps_artifact_deterministic_and_parses_back() -> None:
    manifest = make_manifest(FILES)
    layers = layers_of(FILES)
    data = build_manifest(b'{"x": 1}', list(reversed(layers)), manifest)
    assert data == build_manifest(b'{"x": 1}', layers, manifest)  # one image, one digest
    doc = json.loads(data)
    assert doc["mediaType"] == OCI_MANIFEST and doc["artifactType"] == ARTIFACT_TYPE
    assert doc["config"] == {"mediaType": CONFIG_MEDIA_TYPE, "digest": sha256_digest(b'{"x": 1}'), "size": 8}
    assert [layer["annotations"][TITLE] for layer in doc["layers"]] == sorted(FILES)
    artifact = parse_artifact(data, REF)
    assert artifact.reference.digest == sha256_digest(data)
    assert sorted(artifact.layers, key=lambda x: x.path) == sorted(layers, key=lambda x: x.path)
    match_manifest(artifact, manifest)


# --- hostile artifacts ----------------------------------------------------------------------------

def first_layer(**changes: object) -> dict:
    doc = document()
    doc["layers"][0].update(changes)
    return doc


@pytest.mark.parametrize("doc, message", [
    (document(mediaType="application/vnd.docker.distribution.manifest.v2+json"), "not an OCI image manifest"),
    (document(schemaVersion=1), "not an OCI image manifest"),
    (document(artifactType="application/vnd.other"), "not a vsnap image"),
    (document(artifactType=None), "not a vsnap image"),
    (first_layer(mediaType="application/vnd.oci.image.layer.v1.tar+gzip"), "vsnap reads only"),
    (first_layer(digest="sha512:" + "a" * 64), "only sha256 digests"),
    (first_layer(digest="sha512:" + "a" * 128), "malformed OCI manifest"),
    (first_layer(digest="sha256:" + "A" * 64), "only sha256 digests"),
    (first_layer(size=-1), "malformed OCI manifest"),
    (first_layer(size="12"), "malformed OCI manifest"),        # strict: no coercion
    (first_layer(annotations={}), "no org.opencontainers.image.title"),
    (first_layer(size=2 << 40), "over"),
    (document(layers="x"), "malformed OCI manifest"),
])
def test_malformed_or_foreign_artifacts_are_refused(doc: dict, message: str) -> None:
    with pytest.raises(ArtifactError, match=message) as caught:
        parse_artifact(encode(doc), REF)
    assert caught.value.exit_code == 4


@pytest.mark.parametrize("title", ["../etc/passwd", "/etc/passwd", "criu//x", "criu/./x", "", "a/..",
                                   "manifest.json", ".incoming/0", "a\0b"])
def test_titles_outside_the_image_or_ours_are_refused(title: str) -> None:
    with pytest.raises(ImageUntrusted):
        parse_artifact(encode(first_layer(annotations={TITLE: title})), REF)


def test_two_layers_one_title_refused() -> None:
    doc = document()
    doc["layers"][1]["annotations"][TITLE] = doc["layers"][0]["annotations"][TITLE]
    with pytest.raises(ArtifactError, match="two layers are titled"):
        parse_artifact(encode(doc), REF)


def test_a_file_and_a_directory_of_one_name_refused_before_any_blob() -> None:
    """Hostile pass 9: titles `logs` and `logs/engine.log` met only at the rename of whichever blob
    came second: a traceback (IsADirectoryError) when the file's came last."""
    doc = document()
    first = doc["layers"][0]["annotations"][TITLE]
    doc["layers"][1]["annotations"][TITLE] = first.split("/")[0]
    with pytest.raises(ImageUntrusted, match="names a file and a directory of the same name"):
        parse_artifact(encode(doc), REF)


def test_oversized_manifest_and_wrong_digest_refused() -> None:
    with pytest.raises(ArtifactError, match="over 4 MiB"):
        parse_artifact(b" " * (MAX_OCI_MANIFEST_BYTES + 1), REF)
    with pytest.raises(ArtifactError, match="not JSON|malformed"):
        parse_artifact(b"[1, 2", REF)
    pinned = REF.with_digest("sha256:" + "0" * 64)
    with pytest.raises(ArtifactError, match="answered a manifest of digest"):
        parse_artifact(encode(document()), pinned)


def test_config_over_the_manifest_limit_refused() -> None:
    doc = document()
    doc["config"]["size"] = 64 << 20
    with pytest.raises(ArtifactError, match="at most"):
        parse_artifact(encode(doc), REF)


def matched(files: dict[str, bytes], layers: list[Layer]) -> None:
    doc = json.loads(build_manifest(b"{}", layers, make_manifest(files)))
    match_manifest(parse_artifact(encode(doc), REF), make_manifest(files))


def test_layers_must_be_exactly_the_listed_files() -> None:
    layers = layers_of(FILES)
    with pytest.raises(ArtifactError, match="no layer holds logs/engine.log") as caught:
        matched(FILES, [layer for layer in layers if layer.path != "logs/engine.log"])
    assert caught.value.file == "logs/engine.log"
    with pytest.raises(ArtifactError, match="layer extra is not a file"):
        matched(FILES, layers + [Layer("extra", "raw", sha256_digest(b""), 0)])


def test_layer_sizes_and_digests_must_fit_their_files() -> None:
    bad_size = [Layer(x.path, x.encoding, x.digest, x.size + 1) if x.path == "criu/core-1.img" else x
                for x in layers_of(FILES)]
    with pytest.raises(ArtifactError, match="layer criu/core-1.img has 5 bytes, its file 4"):
        matched(FILES, bad_size)
    bad_digest = [Layer(x.path, x.encoding, sha256_digest(b"evil"), x.size) if x.path == "criu/core-1.img" else x
                  for x in layers_of(FILES)]
    with pytest.raises(ArtifactError, match="has digest"):
        matched(FILES, bad_digest)
    bomb_sized = [Layer(x.path, "zstd", x.digest, 1 << 30) if x.path == "criu/pages-1.img" else x
                  for x in layers_of(FILES)]
    with pytest.raises(ArtifactError, match="more than zstd makes"):
        matched(FILES, bomb_sized)


def test_manifest_listing_itself_refused() -> None:
    files = {**FILES, "manifest.json": b"{}"}
    artifact = parse_artifact(encode(document()), REF)
    with pytest.raises(ImageUntrusted, match="manifest.json itself"):
        match_manifest(artifact, make_manifest(files))


# --- streaming ------------------------------------------------------------------------------------

def test_file_digest_streamed_equals_piece_hashes(tmp_path: Path) -> None:
    data = os.urandom(1000) * (PIECE // 1000 * 2 + 3)  # a little over two pieces
    (tmp_path / "f").write_bytes(data)
    digest = FileDigest()
    for offset in range(0, len(data), 3 << 20):
        digest.update(data[offset:offset + (3 << 20)])
    assert digest.hexdigest() == piece_hashes(tmp_path, {"f": len(data)})["f"]
    exact, empty = FileDigest(), FileDigest()
    exact.update(data[:PIECE])
    assert exact.hexdigest() == hashlib.sha256(data[:PIECE]).hexdigest()
    assert empty.hexdigest() == hashlib.sha256(b"").hexdigest()


def blob_for(data: bytes, rel: str = "criu/pages-1.img", *, zstd: bool = True) -> tuple[bytes, Layer, FileEntry]:
    blob = zstandard.ZstdCompressor(level=3).compress(data) if zstd else data
    return blob, Layer(rel, "zstd" if zstd else "raw", sha256_digest(blob), len(blob)), \
        FileEntry(size=len(data), digest=hashlib.sha256(data).hexdigest(), scheme="sha256")


def written(tmp_path: Path, chunks: list[bytes], layer: Layer, entry: FileEntry) -> bytes:
    path = tmp_path / "out"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        write_blob(chunks, layer, entry, fd, "ref")
    finally:
        os.close(fd)
    return path.read_bytes()


def test_a_zstd_blob_is_written_and_checked(tmp_path: Path) -> None:
    data = os.urandom(100_000) + bytes(9 << 20) + b"tail"  # zeros become a hole
    blob, layer, entry = blob_for(data)
    assert written(tmp_path, [blob[i:i + 7777] for i in range(0, len(blob), 7777)], layer, entry) == data
    assert os.stat(tmp_path / "out").st_blocks * 512 < len(data)


def test_compressed_push_stream_is_what_the_pull_reads(tmp_path: Path) -> None:
    data = b"abc" * 300_000
    (tmp_path / "f").write_bytes(data)
    stream = HashingIterator(zstd_chunks(tmp_path / "f"))
    blob = b"".join(stream)
    assert stream.digest == sha256_digest(blob) and stream.size == len(blob) < len(data) // 10
    assert zstandard.ZstdDecompressor().decompress(blob) == data
    layer = Layer("criu/pages-1.img", "zstd", stream.digest, stream.size)
    entry = FileEntry(size=len(data), digest=hashlib.sha256(data).hexdigest(), scheme="sha256")
    assert written(tmp_path, [blob], layer, entry) == data


def test_compression_does_not_depend_on_the_thread_count(tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(os.urandom(1 << 20) + bytes(8 << 20) + b"x" * (3 << 20))
    blobs = {threads: b"".join(zstd_chunks(tmp_path / "f", threads=threads)) for threads in (1, 2, 5)}
    assert blobs[1] == blobs[2] == blobs[5]  # one image, one digest, on any host


def test_an_altered_blob_names_its_file(tmp_path: Path) -> None:
    data = os.urandom(50_000)
    blob, layer, entry = blob_for(data, zstd=False)
    altered = bytes([blob[0] ^ 1]) + blob[1:]
    with pytest.raises(ArtifactError, match="criu/pages-1.img does not match its digest") as caught:
        written(tmp_path, [altered], layer, entry)
    assert caught.value.file == "criu/pages-1.img"


def test_a_blob_longer_than_promised_is_cut_off(tmp_path: Path) -> None:
    blob, layer, entry = blob_for(b"x" * 1000, zstd=False)
    with pytest.raises(ArtifactError, match="runs past its 1000 bytes"):
        written(tmp_path, [blob, b"more"], layer, entry)


def test_a_decompression_bomb_stops_at_the_recorded_size(tmp_path: Path) -> None:
    bomb = zstandard.ZstdCompressor(level=19).compress(bytes(256 << 20))  # 256 MiB of zeros in a few KB
    layer = Layer("criu/pages-1.img", "zstd", sha256_digest(bomb), len(bomb))
    entry = FileEntry(size=1 << 20, digest=hashlib.sha256(bytes(1 << 20)).hexdigest(), scheme="sha256")
    with pytest.raises(ArtifactError, match="holds more than the 1048576 bytes"):
        written(tmp_path, [bomb], layer, entry)
    assert os.stat(tmp_path / "out").st_size <= 8 << 20


def test_garbage_instead_of_zstd_is_named(tmp_path: Path) -> None:
    garbage = os.urandom(5000)
    layer = Layer("criu/pages-1.img", "zstd", sha256_digest(garbage), len(garbage))
    entry = FileEntry(size=10, digest=HEX, scheme="sha256")
    with pytest.raises(ArtifactError, match="not a valid zstd stream"):
        written(tmp_path, [garbage], layer, entry)


def test_decompressed_bytes_must_match_the_manifest(tmp_path: Path) -> None:
    blob, layer, _ = blob_for(b"payload" * 1000)
    other = FileEntry(size=7000, digest=hashlib.sha256(b"P" * 7000).hexdigest(), scheme="sha256")
    with pytest.raises(ArtifactError, match="does not match manifest.json"):
        written(tmp_path, [blob], layer, other)
    short = FileEntry(size=7001, digest=HEX, scheme="sha256")
    with pytest.raises(ArtifactError, match="holds 7000 bytes; manifest.json records 7001"):
        written(tmp_path, [blob], layer, short)


def test_first_failure_cancels_the_other_transfers() -> None:
    cancel = threading.Event()
    stopped = []
    all_started = threading.Barrier(3, timeout=30)  # else on a loaded machine 2 may start after the cancel

    def transfer(item: int) -> int:
        all_started.wait()
        if item == 0:
            raise ArtifactError("ref", "blob 0 is bad")
        on_bytes = checking(cancel)
        try:
            for _ in range(1000):
                on_bytes(1)
                threading.Event().wait(0.01)
        except Cancelled:
            stopped.append(item)
            raise
        return item

    with pytest.raises(ArtifactError, match="blob 0 is bad"):
        parallel(transfer, range(3), 3, cancel)
    assert cancel.is_set() and sorted(stopped) == [1, 2]


# --- staging and credentials ---------------------------------------------------------------------

def test_staging_is_adopted_only_if_vsnap_made_it(tmp_path: Path) -> None:
    image = tmp_path / "img"
    digest = "sha256:" + "b" * 64
    staging = make_or_adopt_staging(image, digest)
    assert staging == staging_dir(image, digest) and staging.stat().st_mode & 0o777 == 0o700
    (staging / "kept").write_text("x")
    assert make_or_adopt_staging(image, digest) == staging and (staging / "kept").exists()
    other = make_or_adopt_staging(image, "sha256:" + "c" * 64)  # another manifest: the old leftover goes
    assert other.exists() and not staging.exists()
    os.chmod(other, 0o755)  # not what vsnap makes: neither adopted nor removed
    with pytest.raises(ImageUntrusted, match="is not a private directory of root's that vsnap made"):
        make_or_adopt_staging(image, "sha256:" + "c" * 64)
    make_or_adopt_staging(image, "sha256:" + "d" * 64)
    assert other.exists()


def test_docker_config_follows_docker_config_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DOCKER_CONFIG", str(tmp_path))
    assert docker_config_path() is None
    auth = base64.b64encode(b"alice:s3:cret").decode()
    (tmp_path / "config.json").write_text(json.dumps({"auths": {"localhost:5000": {"auth": auth},
                                                                "https://reg.io": {"username": "u", "password": "p"}}}))
    config = read_docker_config(docker_config_path())  # type: ignore[arg-type]
    assert inline_credentials(config, "127.0.0.1:5000") == ("alice", "s3:cret")  # localhost and 127.0.0.1 alike
    assert inline_credentials(config, "reg.io") == ("u", "p")
    assert inline_credentials(config, "other.io") is None
    (tmp_path / "config.json").write_text(json.dumps({"auths": {"reg.io": {"auth": "%%%"}}}))
    with pytest.raises(RegistryUnavailable, match="not base64"):
        inline_credentials(read_docker_config(tmp_path / "config.json"), "reg.io")
    (tmp_path / "config.json").write_text("[]")
    with pytest.raises(RegistryUnavailable, match="is not a JSON object"):
        read_docker_config(tmp_path / "config.json")


def test_pushed_blobs_are_remembered_until_the_file_changes(tmp_path: Path) -> None:
    from vsnap.registry.pushed import PushedBlobs

    image, root = tmp_path / "img", tmp_path / "pushed"
    (image / "criu").mkdir(parents=True, mode=0o700)
    page = image / "criu" / "pages-1.img"
    page.write_bytes(b"x" * 100)
    os.chmod(page, 0o600)
    layer = Layer("criu/pages-1.img", "zstd", "sha256:" + HEX, 42)
    PushedBlobs(image, root).remember(layer, os.lstat(page))
    assert PushedBlobs(image, root).known("criu/pages-1.img", os.lstat(page), "zstd") == layer
    assert PushedBlobs(image, root).known("criu/pages-1.img", os.lstat(page), "raw") is None
    with open(page, "ab") as f:
        f.write(b"y")  # size, mtime and ctime change: the blob must be made again
    assert PushedBlobs(image, root).known("criu/pages-1.img", os.lstat(page), "zstd") is None
    PushedBlobs(image, root).remember(layer, os.lstat(page))
    assert PushedBlobs(image, root).known("criu/pages-1.img", os.lstat(page), "zstd") == layer
    os.chmod(root, 0o777)  # a record others could have written is no record
    assert PushedBlobs(image, root).known("criu/pages-1.img", os.lstat(page), "zstd") is None


def test_a_docker_config_anyone_else_could_write_is_refused(tmp_path: Path) -> None:
    """Hostile pass 9: DOCKER_CONFIG (or HOME) pointing into another user's directory let that user
    name a credential helper, `x/../pwn`, that root ran as ./docker-credential-x/../pwn."""
    home = tmp_path / "mallory"
    home.mkdir()
    config = home / "config.json"
    config.write_text(json.dumps({"auths": {}}))
    assert read_docker_config(config) == {"auths": {}}  # root's alone: read
    os.chown(home, 65534, 65534)
    with pytest.raises(RegistryUnavailable, match="is not root's alone .*owned by uid 65534"):
        read_docker_config(config)
    os.chown(home, 0, 0)
    os.chown(config, 65534, 65534)
    with pytest.raises(RegistryUnavailable, match="is owned by uid 65534, not by root"):
        read_docker_config(config)
    os.chown(config, 0, 0)
    os.chmod(config, 0o666)
    with pytest.raises(RegistryUnavailable, match="has mode 0666"):
        read_docker_config(config)
    os.chmod(config, 0o644)
    link = tmp_path / "link.json"
    link.symlink_to(config)
    os.lchown(link, 65534, 65534)
    with pytest.raises(RegistryUnavailable, match="is not root's alone"):
        read_docker_config(link)
    for bad in ({"credsStore": "x/../pwn"}, {"credHelpers": {"reg.io": "../../tmp/evil"}}, {"credsStore": ["x"]}):
        config.write_text(json.dumps(bad))
        with pytest.raises(RegistryUnavailable, match="names the credential helper"):
            read_docker_config(config)
    config.write_text(json.dumps({"credsStore": "desktop", "credHelpers": {"reg.io": "ecr-login"}}))
    assert read_docker_config(config)["credsStore"] == "desktop"


def test_a_push_of_another_users_directory_writes_nothing_beside_it(tmp_path: Path) -> None:
    """Hostile pass 9: `vsnap push ~mallory/img` made root's `.img.readers.lock` in mallory's
    directory and parsed her manifest.json before the trust model refused the image."""
    from tests.unit.fake_image import make_image
    from vsnap.registry.push import push_image

    image = make_image(tmp_path / "mallory" / "img")
    os.chown(image.parent, 65534, 65534)
    with pytest.raises(ImageUntrusted, match="owned by uid 65534"):
        push_image(image, "127.0.0.1:9/vsnap/x:v1")
    assert sorted(p.name for p in image.parent.iterdir()) == ["img"]


def test_a_registry_that_drips_bytes_is_given_up_after_the_grace() -> None:
    """Each read answers within the read timeout, yet a byte a second would hold a pull for ever."""
    from vsnap.protocol.errors import RegistryUnavailable
    from vsnap.registry.client import at_least_min_rate

    now = [0.0]

    def drip():  # type: ignore[no-untyped-def]
        while True:
            now[0] += 1.0
            yield b"x"

    with pytest.raises(RegistryUnavailable, match=r"KiB/s after 1\d\d s; vsnap gives up below 64 KiB/s"):
        for _ in at_least_min_rate(drip(), "r.example", "blob sha256:0", clock=lambda: now[0]):
            pass
    assert 120 < now[0] < 130  # not before the grace, soon after it
    fast = [b"y" * (1 << 20)] * 300  # 1 MiB a second for 300 s: kept
    now[0] = 0.0

    def steady():  # type: ignore[no-untyped-def]
        for chunk in fast:
            now[0] += 1.0
            yield chunk

    assert sum(map(len, at_least_min_rate(steady(), "r.example", "blob", clock=lambda: now[0]))) == 300 << 20


def test_files_of_equal_content_are_sent_one_job_at_a_time() -> None:
    """Two jobs with one known digest take turns (the second then finds the blob in the registry);
    other digests, and digests known only once sent, do not wait."""
    from vsnap.registry.push import OnePerDigest

    same = [Layer(f"pages-{n}.img", "raw", "sha256:" + "a" * 64, 10) for n in (1, 2)]
    other = Layer("core.img", "raw", "sha256:" + "b" * 64, 10)
    turns = OnePerDigest([*same, other])
    inside, release = threading.Event(), threading.Event()
    second_in = threading.Event()

    def first() -> None:
        with turns.holding(same[0]):
            inside.set()
            release.wait(10)

    def second() -> None:
        with turns.holding(same[1]):
            second_in.set()

    a = threading.Thread(target=first)
    a.start()
    assert inside.wait(10)
    b = threading.Thread(target=second)
    b.start()
    with turns.holding(other), turns.holding(None):  # neither waits for the digest in use
        pass
    assert not second_in.wait(0.2)  # the same digest waits for its turn
    release.set()
    a.join(10)
    b.join(10)
    assert second_in.is_set()


@pytest.mark.parametrize("title", ["criu/a\nb", "logs/\x1b[31mred", "x\r", "a\tb"])
@pytest.mark.parametrize("model", [False, True])
def test_a_title_with_a_control_character_is_refused_in_one_line(title: str, model: bool) -> None:
    """A newline in a layer title (JSON carries it) reached the refusal's message as it was."""
    from vsnap.registry.oci import MODEL_FILE_MEDIA_TYPE

    changes: dict = {"annotations": {TITLE: title}}
    if model:
        changes["mediaType"] = MODEL_FILE_MEDIA_TYPE
    with pytest.raises(ImageUntrusted, match="control character") as refused:
        parse_artifact(encode(first_layer(**changes)), REF)
    assert refused.value.message.isprintable()


def test_a_manifest_file_name_with_a_newline_is_named_in_one_line() -> None:
    files = {**FILES, "criu/a\nb": b"x"}
    with pytest.raises(ArtifactError, match="no layer holds") as refused:
        match_manifest(parse_artifact(encode(document()), REF), make_manifest(files))
    assert refused.value.message.isprintable()
