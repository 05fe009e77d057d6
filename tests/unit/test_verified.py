"""A restore re-hashes an image file only when it may have changed since this host hashed it."""

import json
import os
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from vsnap.host import verified as _verified
from vsnap.image.store import checksum_tree, verify_files
from vsnap.protocol.errors import ImageTampered, ImageUntrusted


@pytest.fixture(autouse=True)
def settled_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The files these tests write are seconds old at most: count them as settled (tests that are
    about the margin put it back)."""
    monkeypatch.setattr(_verified, "FINE_MARGIN_NS", -10**12)
    monkeypatch.setattr(_verified, "COARSE_MARGIN_NS", -10**12)


def _real_margins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_verified, "FINE_MARGIN_NS", 100_000_000)
    monkeypatch.setattr(_verified, "COARSE_MARGIN_NS", 2_000_000_000)


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


def test_a_write_that_keeps_size_and_mtime_is_still_caught(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Remembered once settled; a later write changes ctime even with size and mtime put back."""
    _real_margins(monkeypatch)
    image, manifest = _image(tmp_path)
    cache = tmp_path / "verified"
    coarse = os.stat(image / "weights" / "rank0.bin").st_ctime_ns % 1_000_000_000 == 0
    time.sleep(2.2 if coarse else 0.15)  # older than the margin: the record will vouch for them
    assert verify_files(image, manifest, cache_root=cache) == ["criu/pages-1.img", "weights/rank0.bin"]
    assert verify_files(image, manifest, cache_root=cache) == []  # remembered
    target = image / "weights" / "rank0.bin"
    before = target.stat()
    with open(target, "r+b") as f:
        f.write(b"\x00" if f.read(1) != b"\x00" else b"\x01")
    os.utime(target, ns=(before.st_atime_ns, before.st_mtime_ns))  # ctime cannot be put back
    with pytest.raises(ImageTampered, match="weights/rank0.bin"):
        verify_files(image, manifest, cache_root=cache)
    assert not list(cache.iterdir())  # the record is dropped with the failure


def test_a_file_changed_just_before_its_hash_is_not_remembered(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A write in the same clock tick as the change before the stat would keep ctime: a file whose
    ctime is less than the margin older than its stat is not remembered (so hashed again)."""
    _real_margins(monkeypatch)
    image, manifest = _image(tmp_path)
    cache = tmp_path / "verified"
    rel = "weights/rank0.bin"
    st = os.lstat(image / rel)
    margin = 2_000_000_000 if st.st_ctime_ns % 10**9 == 0 else 100_000_000
    digest = manifest.files[rel].digest
    _verified.remember(image, {rel: (st, digest)}, cache, statted_at_ns=st.st_ctime_ns + margin // 2)
    assert _verified.load(image, cache) == {}
    _verified.remember(image, {rel: (st, digest)}, cache, statted_at_ns=st.st_ctime_ns + margin + 1)
    assert list(_verified.load(image, cache)) == [rel]


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


def test_no_record_is_written_through_another_users_directory(tmp_path: Path) -> None:
    """VSNAP_RUNTIME_DIR can put the cache under a directory others write to: a record is written
    only where every directory on the way is root's (make_trusted_dirs), never through another
    user's directory or link."""
    import os

    from vsnap.host.verified import writable_root

    if os.geteuid() != 0:
        pytest.skip("needs root (chown)")
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chown(theirs, 65534, 65534)
    assert not writable_root(theirs / "run" / "verified")
    assert not (theirs / "run").exists()  # nothing made inside it
    os.symlink(theirs, tmp_path / "link")
    os.lchown(tmp_path / "link", 65534, 65534)
    assert not writable_root(tmp_path / "link" / "verified")
    mine = tmp_path / "mine" / "run" / "verified"
    assert writable_root(mine) and oct(mine.stat().st_mode & 0o777) == "0o700"


def test_forget_never_removes_through_a_link_or_anothers_directory(tmp_path: Path) -> None:
    """Hostile pass 10: forget unlinked <root>/<hash>.json by path, so a link planted at the cache's
    name (VSNAP_RUNTIME_DIR under a directory another user made first) removed root's file of that
    name in any directory."""
    image, manifest = _image(tmp_path)
    victim = tmp_path / "victim"
    victim.mkdir(mode=0o700)
    record = victim / _verified._record_path(image, victim).name
    record.write_text("root's")
    os.symlink(victim, tmp_path / "link")
    _verified.forget(image, tmp_path / "link")
    assert record.read_text() == "root's"
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    os.chmod(open_dir, 0o777)  # not a directory of root's alone: its files are not ours to judge
    (open_dir / record.name).write_text("x")
    _verified.forget(image, open_dir)
    assert (open_dir / record.name).exists()
    _verified.forget(image, victim)  # root's own private cache: the record goes
    assert not record.exists()
    _verified.forget(image, tmp_path / "none")  # no cache: nothing to do


def _write(path: Path, document: object) -> None:
    path.write_text(document if isinstance(document, str) else json.dumps(document))
    os.chmod(path, 0o600)


def test_records_are_read_strictly_and_a_malformed_one_is_no_record(tmp_path: Path) -> None:
    """The records are protocol.records: exactly their fields and types, or ignored (the files are
    hashed again); what older vsnap wrote (json.dumps) still reads."""
    image, manifest = _image(tmp_path)
    cache = tmp_path / "verified"
    verify_files(image, manifest, cache_root=cache)
    record = cache / _verified._record_path(image, cache).name
    written = json.loads(record.read_text())
    assert set(written) == {"image", "files"} and written["image"] == str(image.resolve())
    _write(record, json.dumps(written, indent=1))  # any JSON layout of the same record
    assert sorted(_verified.load(image, cache)) == ["criu/pages-1.img", "weights/rank0.bin"]
    rel = "weights/rank0.bin"
    entry = written["files"][rel]
    for bad in ({**written, "extra": 1},                                       # a field it does not have
                {**written, "files": {rel: {**entry, "sha256": 5}}},           # a value of another type
                {**written, "files": {rel: {**entry, "identity": "x"}}},
                {**written, "files": {rel: {"identity": entry["identity"]}}},  # a field missing
                {**written, "files": {rel: 5}},                                # once: AttributeError, a traceback
                {**written, "image": str(tmp_path / "other")},                 # another image's record
                [written], "\ufeff" + json.dumps(written), "{", "[" * 100_000):
        _write(record, bad)
        assert _verified.load(image, cache) == {}, bad
        assert len(verify_files(image, manifest, cache_root=cache)) == 2  # hashed again, and remembered
    assert verify_files(image, manifest, cache_root=cache) == []


def test_a_malformed_dependency_or_host_check_record_is_no_record(tmp_path: Path) -> None:
    cache = tmp_path / "verified"
    cache.mkdir(mode=0o700)
    _write(cache / _verified.DEPENDENCIES, {"files": {"/lib/x.so": {"identity": [1, 2], "sha256": "00"}}})
    assert list(_verified.load_dependencies(cache)) == ["/lib/x.so"]
    _write(cache / _verified.DEPENDENCIES, {"files": {"/lib/x.so": {"identity": [1, 2], "sha256": None}}})
    assert _verified.load_dependencies(cache) == {}
    key = ["boot", "6.1.0", "/usr/sbin/criu", 1, 2, 3, 4, 5]
    # as older vsnap wrote it
    _write(cache / _verified.HOST_CHECKS, {"criu": {"key": key, "verdict": "criu 4.2 passed"}})
    assert _verified.host_check_passed("criu", key, cache) == "criu 4.2 passed"
    assert _verified.host_check_passed("criu", key[:-1], cache) is None  # another key
    for bad in ({"criu": {"key": key, "verdict": 1}}, {"criu": {"key": key}}, {"criu": []}, {"other": {}}, "nul"):
        _write(cache / _verified.HOST_CHECKS, bad)
        assert _verified.host_check_passed("criu", key, cache) is None, bad
    _verified.remember_host_check("criu", key, "asked again", cache)  # a malformed record is replaced
    assert _verified.host_check_passed("criu", key, cache) == "asked again"


def test_what_a_record_cannot_hold_is_left_out_not_an_error(tmp_path: Path) -> None:
    """A name that is not valid text (a lone surrogate) or an inode number past 63 bits: that file
    is only hashed again; the others are remembered."""
    image, manifest = _image(tmp_path)
    cache = tmp_path / "verified"
    bad = image / "bad\udcff"  # the byte 0xff in its name
    bad.write_bytes(b"x")
    os.chmod(bad, 0o600)
    good = "criu/pages-1.img"
    _verified.remember(image, {good: (os.lstat(image / good), "a" * 64), bad.name: (os.lstat(bad), "b" * 64)}, cache)
    assert list(_verified.load(image, cache)) == [good]
    assert _verified._hashed("x", [1, 1 << 63, 3, 4, 5], "c" * 64) is None
    _verified.remember_host_check("criu", ["boot\udcff"], "passed", cache)
    assert _verified.host_check_passed("criu", ["boot\udcff"], cache) is None
