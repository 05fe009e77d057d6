"""A restore re-hashes an image file only when it may have changed since this host hashed it."""

import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from vsnap.protocol.errors import ImageTampered, ImageUntrusted
from vsnap._image import checksum_tree, verify_files


def _image(tmp_path: Path) -> tuple[Path, SimpleNamespace]:
    image = tmp_path / "img"
    (image / "criu").mkdir(parents=True)
    (image / "criu" / "pages-1.img").write_bytes(os.urandom(3000))
    (image / "weights").mkdir()
    (image / "weights" / "rank0.bin").write_bytes(os.urandom(5000))
    for path in [image, *image.rglob("*")]:
        os.chmod(path, 0o700 if path.is_dir() else 0o600)
    return image, SimpleNamespace(files=checksum_tree(image), shm_files=[])


def test_unchanged_files_are_not_hashed_twice(tmp_path: Path) -> None:
    image, manifest = _image(tmp_path)
    cache = tmp_path / "verified"
    assert verify_files(image, manifest, cache_root=cache) == ["criu/pages-1.img", "weights/rank0.bin"]
    assert verify_files(image, manifest, cache_root=cache) == []
    assert len(verify_files(image, manifest)) == 2  # without a cache: everything, every time


def test_a_write_that_keeps_size_and_mtime_is_still_caught(tmp_path: Path) -> None:
    image, manifest = _image(tmp_path)
    cache = tmp_path / "verified"
    verify_files(image, manifest, cache_root=cache)
    target = image / "weights" / "rank0.bin"
    before = target.stat()
    with open(target, "r+b") as f:
        f.write(b"\x00" if f.read(1) != b"\x00" else b"\x01")
    os.utime(target, ns=(before.st_atime_ns, before.st_mtime_ns))  # ctime cannot be put back
    with pytest.raises(ImageTampered, match="weights/rank0.bin"):
        verify_files(image, manifest, cache_root=cache)
    assert not list(cache.iterdir())  # the record is dropped with the failure


def test_files_writable_by_others_are_refused_before_any_hashing(tmp_path: Path) -> None:
    image, manifest = _image(tmp_path)
    cache = tmp_path / "verified"
    verify_files(image, manifest, cache_root=cache)
    os.chmod(image / "criu" / "pages-1.img", 0o666)  # once others can write it, no record vouches for it
    with pytest.raises(ImageUntrusted, match="pages-1.img: a file of the image has mode 0666"):
        verify_files(image, manifest, cache_root=cache)


def test_a_record_others_could_write_is_ignored(tmp_path: Path) -> None:
    image, manifest = _image(tmp_path)
    cache = tmp_path / "verified"
    verify_files(image, manifest, cache_root=cache)
    os.chmod(cache, 0o777)
    assert len(verify_files(image, manifest, cache_root=cache)) == 2


def test_rehash_hashes_everything_and_records_it(tmp_path: Path) -> None:
    image, manifest = _image(tmp_path)
    cache = tmp_path / "verified"
    verify_files(image, manifest, cache_root=cache)
    assert len(verify_files(image, manifest, cache_root=cache, rehash=True)) == 2
    assert verify_files(image, manifest, cache_root=cache) == []
