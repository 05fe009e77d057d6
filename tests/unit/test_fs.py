"""renameat2 (host/fs): the exchange that publishes an image, the no-replace rename that moves one
aside for `vsnap rm`, and the fallbacks of both where the C library or filesystem lacks the flag."""

from __future__ import annotations

import errno
from pathlib import Path
from typing import Callable

import pytest

from tests.unit.fake_image import make_image
from vsnap.host import fs
from vsnap.image import local as _images
from vsnap.image import store
from vsnap.image.store import make_staging, publish


def _dir(path: Path, content: str) -> Path:
    path.mkdir(mode=0o700)
    (path / "a").write_text(content)
    return path


def test_exchange_swaps_two_names_in_one_step(tmp_path: Path) -> None:
    one, two = _dir(tmp_path / "one", "1"), _dir(tmp_path / "two", "2")
    fs.renameat2(one, two, fs.RENAME_EXCHANGE)
    assert ((one / "a").read_text(), (two / "a").read_text()) == ("2", "1")


def test_noreplace_never_replaces_and_errors_name_both_paths(tmp_path: Path) -> None:
    one, two = _dir(tmp_path / "one", "1"), _dir(tmp_path / "two", "2")
    with pytest.raises(OSError) as info:
        fs.renameat2(one, two, fs.RENAME_NOREPLACE)
    assert info.value.errno == errno.EEXIST
    assert (info.value.filename, info.value.filename2) == (str(one), str(two))
    assert (two / "a").read_text() == "2"
    fs.renameat2(one, tmp_path / "three", fs.RENAME_NOREPLACE)
    assert (tmp_path / "three" / "a").read_text() == "1" and not one.exists()
    with pytest.raises(FileNotFoundError):
        fs.renameat2(tmp_path / "none", tmp_path / "four", fs.RENAME_NOREPLACE)


def test_without_renameat2_in_the_c_library_it_is_enosys(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fs, "_renameat2", lambda: None)
    with pytest.raises(OSError) as info:
        fs.renameat2(_dir(tmp_path / "one", "1"), tmp_path / "two", fs.RENAME_NOREPLACE)
    assert info.value.errno == errno.ENOSYS


def _unsupported(code: int) -> Callable[[Path, Path, int], None]:
    """A renameat2 that fails with ``code``, as fs.renameat2 reports it."""
    def renameat2(source: Path, destination: Path, flags: int) -> None:
        raise OSError(code, "not supported here", str(source), None, str(destination))
    return renameat2


@pytest.mark.parametrize("code", [errno.ENOSYS, errno.EINVAL])
def test_publish_without_the_exchange_moves_the_old_image_aside_first(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int) -> None:
    parent = tmp_path / "images"
    parent.mkdir(mode=0o700)
    image = parent / "img"
    for content in ("one", "two"):
        staging = make_staging(image)
        (staging / "a").write_text(content)
        (staging / "manifest.json").write_text('{"format_version": 2, "files": {}}')
        monkeypatch.setattr(store, "renameat2", _unsupported(code))
        publish(staging, image)
        assert (image / "a").read_text() == content
    assert sorted(p.name for p in parent.iterdir()) == ["img"]


@pytest.mark.parametrize("code", [errno.ENOSYS, errno.EINVAL])
def test_rm_without_noreplace_checks_the_fresh_name_then_renames(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int) -> None:
    image = make_image(tmp_path / "images" / "fake")
    monkeypatch.setattr(_images, "renameat2", _unsupported(code))
    assert _images.remove_image(image, instances=lambda: []).name == "fake"
    assert not image.exists()


def test_rm_reports_any_other_failure_of_the_rename(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from vsnap.protocol.errors import ImageError

    image = make_image(tmp_path / "images" / "fake")
    monkeypatch.setattr(_images, "renameat2", _unsupported(errno.EXDEV))
    with pytest.raises(ImageError, match="cannot move .* aside to remove it: not supported here"):
        _images.remove_image(image, instances=lambda: [])
    assert image.exists()
