import os
from pathlib import Path

import pytest

from vsnap.image.store import check_parent, checksum_tree, image_lock, is_vsnap_image, make_staging, publish
from vsnap.protocol.errors import ImageError


def test_publish_new_and_replace(tmp_path: Path) -> None:
    parent = tmp_path / "images"
    parent.mkdir(mode=0o700)
    image = parent / "img"
    first = make_staging(image)
    (first / "a").write_text("one")
    (first / "manifest.json").write_text('{"format_version": 2, "files": {}}')
    publish(first, image)
    assert (image / "a").read_text() == "one"
    assert image.stat().st_mode & 0o777 == 0o700 and (image / "a").stat().st_mode & 0o777 == 0o600
    second = make_staging(image)
    (second / "a").write_text("two")
    (second / "manifest.json").write_text('{"format_version": 2, "files": {}}')
    publish(second, image)
    assert (image / "a").read_text() == "two"
    assert sorted(p.name for p in parent.iterdir()) == ["img"]  # the old image and staging are gone


def test_publish_refuses_to_replace_non_image(tmp_path: Path) -> None:
    image = tmp_path / "img"
    image.write_text("a file")
    staging = make_staging(image)
    with pytest.raises(ImageError, match="is not a directory"):
        publish(staging, image)
    assert image.read_text() == "a file"


def test_parent_writable_by_others_refused(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    with pytest.raises(ImageError, match="group or others can write it"):
        check_parent(shared / "img")


def test_second_capture_to_same_path_refused(tmp_path: Path) -> None:
    image = tmp_path / "img"
    with image_lock(image):
        with pytest.raises(ImageError, match="another vsnap capture is writing"):
            with image_lock(image):
                pass
    with image_lock(image):  # released
        pass


def test_checksum_tree(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "x").write_bytes(b"abc")
    (tmp_path / "manifest.json").write_text("{}")
    files = checksum_tree(tmp_path)
    assert list(files) == ["sub/x"]
    assert files["sub/x"].digest == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    assert files["sub/x"].scheme == "sha256"


def test_a_large_file_digest_is_what_the_documented_shell_command_prints(tmp_path: Path) -> None:
    """docs/image-format.md: split -b 64M --filter='sha256sum | cut -c1-64 | tr -d "\\n"' FILE | sha256sum"""
    import subprocess

    big = tmp_path / "pages-1.img"
    with open(big, "wb") as f:
        for n in range(129):  # 129 MiB: three pieces, the last one short
            f.write(bytes([n]) * (1 << 20))
    entry = checksum_tree(tmp_path)["pages-1.img"]
    assert entry.scheme == "sha256-of-64MiB-pieces"
    shell = subprocess.run(["sh", "-c", "split -b 64M --filter='sha256sum | cut -c1-64 | tr -d \"\\n\"' \"$1\" "
                            "| sha256sum | cut -c1-64", "sh", str(big)], capture_output=True, text=True, check=True)
    assert shell.stdout.strip() == entry.digest


def test_manifest_of_another_format_version_is_named(tmp_path: Path) -> None:
    """A manifest of another version has other fields: its version must still be what is reported."""
    from vsnap.image.manifest import read_manifest
    from vsnap.protocol.errors import ImageFormatError

    image = tmp_path / "img"
    image.mkdir()
    (image / "manifest.json").write_text('{"format_version": 3, "vsnap_version": "9.0", "layout": "something new"}')
    with pytest.raises(ImageFormatError, match=r"captured by vsnap 9\.0 \(image format 3\); this vsnap speaks "
                                               r"vsnap .* \(image format 2\)") as info:
        read_manifest(image)
    assert info.value.format_version == 3
    # an image of the first format names the vsnap that wrote it from its host facts
    (image / "manifest.json").write_text('{"format_version": 1, "host": {"vsnap": "0.1.0"}}')
    with pytest.raises(ImageFormatError, match=r"vsnap 0\.1\.0 \(image format 1\)"):
        read_manifest(image)
    (image / "manifest.json").write_text('{"format_version": 2, "name": 5}')
    with pytest.raises(ImageFormatError, match="is malformed"):
        read_manifest(image)


def test_a_manifest_nested_too_deep_is_malformed_not_a_traceback(tmp_path: Path) -> None:
    """Hostile pass 10: json.loads raises RecursionError (not a ValueError) on deep nesting: the
    manifest's reader, `vsnap images` and the image check all ended in a traceback."""
    from vsnap.image.local import list_images
    from vsnap.image.manifest import read_manifest
    from vsnap.image.store import is_vsnap_image
    from vsnap.protocol.errors import ImageFormatError

    image = tmp_path / "img"
    image.mkdir()
    (image / "manifest.json").write_text('{"format_version": 2, "x": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(ImageFormatError, match="is malformed"):
        read_manifest(image)
    assert not is_vsnap_image(image)
    listing = list_images([tmp_path])  # the listing goes on past it
    assert listing.images == [] and [entry.path for entry in listing.skipped] == [str(image)]


@pytest.mark.parametrize("host, url", [("127.0.0.1", "http://127.0.0.1:8000"), ("0.0.0.0", "http://127.0.0.1:8000"),
                                       ("::1", "http://[::1]:8000"), ("::", "http://[::1]:8000"),
                                       ("fe80::1", "http://[fe80::1]:8000"), ("localhost", "http://localhost:8000")])
def test_server_urls_are_usable_ipv6_bracketed(host: str, url: str) -> None:
    from vsnap.host.http import server_url

    assert server_url(host, 8000) == url
    assert server_url(host, 8000, tls=True) == url.replace("http://", "https://")


def test_only_vsnaps_own_leftovers_are_removed(tmp_path: Path) -> None:
    """The third hostile pass: in a sticky parent, another user's `.NAME.staging-x` was deleted by root."""
    from vsnap.image.store import remove_stale_staging

    image = tmp_path / "img"
    ours = make_staging(image)
    theirs = tmp_path / ".img.staging-mine"
    theirs.mkdir()
    (theirs / "work.txt").write_text("precious")
    os.chown(theirs, 65534, 65534)
    shared = tmp_path / ".img.old-1"
    shared.mkdir(mode=0o755)
    os.chmod(shared, 0o755)
    remove_stale_staging(image)
    assert not ours.exists()
    assert (theirs / "work.txt").read_text() == "precious" and shared.is_dir()


def test_an_image_name_is_never_a_glob(tmp_path: Path) -> None:
    """Hostile pass 9: a capture of `a*` (or `[ab]`) removed the staging directory of a concurrent
    capture of `ab`, a pull of `a*` the staging of a pull of `ab`: NAME went into a glob pattern."""
    from vsnap.image.store import remove_stale_staging
    from vsnap.registry.pull import make_or_adopt_staging

    other = tmp_path / "ab"
    capturing = make_staging(other)
    pulling = make_or_adopt_staging(other, "sha256:" + "e" * 64)
    (capturing / "pages-1.img").write_text("in flight")
    for name in ("a*", "[ab]b", "?b"):
        remove_stale_staging(tmp_path / name)
        make_or_adopt_staging(tmp_path / name, "sha256:" + "f" * 64)
    assert (capturing / "pages-1.img").read_text() == "in flight" and pulling.is_dir()
    remove_stale_staging(other)  # its own leftovers still go
    make_or_adopt_staging(other, "sha256:" + "f" * 64)
    assert not capturing.exists() and not pulling.exists()


def test_a_standbys_image_digest_is_the_manifest_files_not_this_versions_reading_of_it(tmp_path: Path) -> None:
    """Standbys recorded a digest of the parsed manifest, which changed when a vsnap version added
    a field with a default (a standby failed to activate after an upgrade); the digest is now
    manifest.json's bytes, and the same bytes give the same digest however they parse."""
    import hashlib
    import json

    from tests.unit import fake_image
    from vsnap.image.handle import manifest_digest, open_image
    from vsnap.image.manifest import read_manifest

    image = fake_image.make_image(tmp_path / "images" / "m")
    raw = json.loads((image / "manifest.json").read_bytes())
    (image / "manifest.json").write_text(json.dumps(raw, indent=1))  # as another writer would: same fields
    manifest = read_manifest(image)
    data = (image / "manifest.json").read_bytes()
    assert open_image(image, lock=False).digest == hashlib.sha256(data).hexdigest() != manifest_digest(manifest)
    raw["name"] = raw["name"] + "-again"
    (image / "manifest.json").write_text(json.dumps(raw))
    assert open_image(image, lock=False).digest != hashlib.sha256(data).hexdigest()


def test_a_fifo_named_manifest_json_is_not_an_image_and_is_not_waited_on(tmp_path: Path) -> None:
    """capture --force, pull --force and publish ask whether the directory there is an image: a
    FIFO at its manifest.json used to hang them in open(2), waiting for a writer."""
    import signal

    os.mkfifo(tmp_path / "manifest.json", 0o600)
    signal.signal(signal.SIGALRM, lambda *_: pytest.fail("is_vsnap_image waited on a FIFO"))
    signal.alarm(5)
    try:
        assert is_vsnap_image(tmp_path) is False
    finally:
        signal.alarm(0)


@pytest.mark.parametrize("field, value, needle", [
    ("name", "prod\u200b", "name must be a spec's name"),
    ("name", "A" * 15_000_000, "name must be a spec's name"),
    ("vsnap_version", "0.2.0; ok\nhint: fine", "vsnap_version must be at most"),
    ("created_at", "2026\u202e", "created_at must be at most"),
    ("origin", "x" * 2000, "origin must be at most"),
    ("host", {"hostname": "h\x1b]8;;", "kernel": "6", "arch": "x", "criu": "4", "python": "3", "vsnap": "0"},
     "host.hostname must be at most"),
])
def test_a_manifest_string_a_command_prints_is_one_short_printable_line(tmp_path: Path, field: str, value, needle: str) -> None:
    """Hostile pass 19: a manifest (a registry's, or one edited in place) whose name was 15 MB kept
    `vsnap images` busy for 5 minutes; newlines and invisible characters in its versions, dates and
    hostname forged lines or lookalike names wherever they were printed. Refused as malformed."""
    import json

    from tests.unit.fake_image import make_image
    from vsnap.image.manifest import read_manifest
    from vsnap.protocol.errors import ImageFormatError

    image = make_image(tmp_path / "img")
    raw = json.loads((image / "manifest.json").read_text())
    raw[field] = value
    (image / "manifest.json").write_text(json.dumps(raw))
    with pytest.raises(ImageFormatError, match=needle):
        read_manifest(image)
