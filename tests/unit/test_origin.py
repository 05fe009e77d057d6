"""The record of where a pulled image came from is believed only while it matches the image."""

from __future__ import annotations

import os
from pathlib import Path

from vsnap.image.origin import origin_name, read_origin, record_origin


def test_origin_is_shown_only_for_the_manifest_it_was_recorded_with(tmp_path: Path) -> None:
    parent = tmp_path / "images"
    image = parent / "llama"
    image.mkdir(parents=True, mode=0o700)
    (image / "manifest.json").write_bytes(b'{"pulled": 1}')
    assert read_origin(image) is None  # captured: no record
    record_origin(image, "registry.example/llama@sha256:" + "a" * 64)
    assert read_origin(image) == "registry.example/llama@sha256:" + "a" * 64
    (image / "manifest.json").write_bytes(b'{"captured again": 1}')
    assert read_origin(image) is None  # a stale record does not mislabel a newer image
    record = parent / origin_name(image)
    record.unlink()
    os.symlink("/etc/passwd", record)
    assert read_origin(image) is None  # never through a link


def test_something_planted_at_the_origin_name_does_not_fail_the_published_pull(tmp_path: Path) -> None:
    """Hostile pass 9: another user's directory at `.NAME.origin` in a sticky parent made a pull
    that had published its image end in a traceback, leaving `..NAME.origin.PID.tmp` behind."""
    parent = tmp_path / "images"
    image = parent / "llama"
    image.mkdir(parents=True, mode=0o700)
    (image / "manifest.json").write_bytes(b'{"pulled": 1}')
    planted = parent / origin_name(image)
    planted.mkdir()
    os.chown(planted, 65534, 65534)
    record_origin(image, "registry.example/llama@sha256:" + "a" * 64)
    assert read_origin(image) is None and planted.is_dir()
    assert sorted(p.name for p in parent.iterdir()) == [origin_name(image), "llama"]  # no temp file left


def test_the_record_is_read_strictly(tmp_path: Path) -> None:
    """The record is protocol.records' Origin: exactly its two strings, or not believed (before, a
    reference of any JSON type was shown as its str(), and extra keys were taken)."""
    import hashlib
    import json

    parent = tmp_path / "images"
    image = parent / "llama"
    image.mkdir(parents=True, mode=0o700)
    (image / "manifest.json").write_bytes(b'{"pulled": 1}')
    digest = hashlib.sha256(b'{"pulled": 1}').hexdigest()
    record = parent / origin_name(image)
    reference = "registry.example/llama:v1"
    for document, shown in (({"reference": reference, "manifest_sha256": digest}, reference),  # as older vsnap wrote it
                             ({"reference": 5, "manifest_sha256": digest}, None),
                             ({"reference": reference, "manifest_sha256": digest, "by": "x"}, None),
                             ({"reference": reference}, None),
                             ([reference, digest], None)):
        record.write_text(json.dumps(document))
        os.chmod(record, 0o600)
        assert read_origin(image) == shown, document
    record.unlink()
    record_origin(image, "registry.example/\udcff")  # not valid text: no record, no error
    assert not record.exists()
