"""vsnap images and vsnap rm on fake images (real files, real locks, no CRIU): every entry under a
root is hostile, and rm deletes only what vsnap made, never through a link, never while in use."""

from __future__ import annotations

import io
import json
import os
import time
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from tests.unit.fake_image import FILES, make_image
from vsnap.cli import app
from vsnap.cli import images as images_cli
from vsnap.host.instances import InstanceRecord, ProcessRef
from vsnap.image import local as _images
from vsnap.image.manifest import MANIFEST
from vsnap.image.store import image_lock, image_read_lock
from vsnap.protocol.errors import ImageBusy, ImageError, ImageUntrusted

NOBODY = 65534
runner = CliRunner()


def no_instances() -> list[InstanceRecord]:
    return []


def record(image: Path, instance_id: str = "r-0000abcd") -> InstanceRecord:
    me = ProcessRef(pid=os.getpid(), start_time=1, boot_id="b")
    return InstanceRecord(id=instance_id, image=str(image), name="fake", state="serving", owner=me, tree=me,
                          instance_dir=f"/run/vsnap/fake.instances/{instance_id}", started_at=time.time())


def listing(*dirs: Path, instances=no_instances) -> _images.ImageListing:
    return _images.list_images(list(dirs), instances=instances)


def skipped(result: _images.ImageListing) -> dict[str, str]:
    return {Path(s.path).name: s.reason for s in result.skipped}


# --- vsnap images ----------------------------------------------------------------------------------


def test_a_trusted_image_is_listed_with_its_facts(tmp_path: Path) -> None:
    image = make_image(tmp_path / "images" / "fake")
    result = listing(tmp_path / "images")
    assert result.skipped == [] and len(result.images) == 1
    info = result.images[0]
    assert (info.path, info.name, info.engine, info.origin) == (str(image), "fake", "cpu", "captured")
    assert info.model == "/var/lib/vsnap/models/cpu-tiny-v1" and info.created_at == "2026-12-01T10:00:00+00:00"
    assert info.size_bytes == sum(len(d) for d in FILES.values()) + (image / MANIFEST).stat().st_size
    assert info.files == len(FILES) + 1 and info.instances == []
    assert info.disk_bytes == sum(p.lstat().st_blocks * 512 for p in image.rglob("*") if p.is_file())


def test_an_image_given_itself_and_its_origin_and_instances(tmp_path: Path) -> None:
    ref = "registry.example:5000/team/fake:v1@sha256:" + "a" * 64
    image = make_image(tmp_path / "images" / "pulled", origin=ref)
    result = listing(image, instances=lambda: [record(image)])
    assert [(i.path, i.origin, i.instances) for i in result.images] == [(str(image), ref, ["r-0000abcd"])]


def test_every_hostile_entry_is_reported_never_followed_or_listed(tmp_path: Path) -> None:
    root = tmp_path / "images"
    make_image(root / "good")
    victim = make_image(tmp_path / "elsewhere" / "victim")
    (root / "link").symlink_to(victim)
    theirs = make_image(root / "theirs")
    for path in [theirs, *theirs.rglob("*")]:
        os.lchown(path, NOBODY, NOBODY)
    writable = make_image(root / "writable")
    os.chmod(writable / "criu" / "pages-1.img", 0o666)
    inner = make_image(root / "inner-link")
    (inner / "criu" / "extra").symlink_to("/etc/shadow")
    unlisted = make_image(root / "unlisted")
    (unlisted / "criu" / "planted.img").write_bytes(b"x")
    short = make_image(root / "short")
    (short / "criu" / "pages-1.img").write_bytes(b"p")
    malformed = make_image(root / "malformed")
    (malformed / MANIFEST).write_text("{not json")
    old = make_image(root / "old", raw={"format_version": 1, "files": {}, "vsnap_version": "0.1.0"})
    (root / "plain-dir").mkdir()  # no manifest: not an image, not reported
    (root / "README").write_text("notes")
    make_image(root / ".fake.staging-x")  # a capture in flight: hidden
    (root / ".gone.rm-0123abcd").mkdir(mode=0o700)
    result = listing(root)
    assert [Path(i.path).name for i in result.images] == ["good"]
    reasons = skipped(result)
    assert set(reasons) == {"link", "theirs", "writable", "inner-link", "unlisted", "short", "malformed", "old",
                            ".gone.rm-0123abcd"}
    assert "is a symlink; vsnap never follows one" in reasons["link"]
    assert "owned by uid 65534, not by root" in reasons["theirs"]
    assert "group or others can write it" in reasons["writable"]
    assert "is a symlink; nothing in an image may be a link" in reasons["inner-link"]
    assert "criu/planted.img" in reasons["unlisted"] and "an unlisted file" in reasons["unlisted"]
    assert "criu/pages-1.img" in reasons["short"] and "1 bytes" in reasons["short"]
    assert "is malformed" in reasons["malformed"]
    assert "image format 1" in reasons["old"]
    assert f"`vsnap rm {root / 'gone'}` finishes it" in reasons[".gone.rm-0123abcd"]
    assert (victim / MANIFEST).exists()


def test_a_root_that_is_a_link_or_someone_elses_is_reported(tmp_path: Path) -> None:
    real = tmp_path / "real"
    make_image(real / "fake")
    (tmp_path / "via-link").symlink_to(real)
    shared = tmp_path / "shared"
    make_image(shared / "fake")
    os.chmod(shared, 0o777)
    result = listing(tmp_path / "via-link", shared)
    assert result.images == []
    reasons = skipped(result)
    assert "is a symlink; vsnap never follows one" in reasons["via-link"]
    assert "group or others can write it" in reasons["shared"]


def test_a_manifest_over_the_bound_is_not_read(tmp_path: Path) -> None:
    image = make_image(tmp_path / "images" / "huge")
    with open(image / MANIFEST, "ab") as f:
        f.truncate((16 << 20) + 1)
    assert "a manifest holds at most 16777216" in skipped(listing(tmp_path / "images"))["huge"]


def test_a_missing_directory_given_is_an_image_error(tmp_path: Path) -> None:
    with pytest.raises(ImageError, match="does not exist") as error:
        listing(tmp_path / "nope")
    assert error.value.exit_code == 4


def test_the_default_root_is_listed_when_no_directory_is_given(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_images, "DEFAULT_ROOTS", (tmp_path / "images", tmp_path / "missing"))
    make_image(tmp_path / "images" / "fake")
    result = _images.list_images(instances=no_instances)
    assert [i.name for i in result.images] == ["fake"] and result.skipped == []


def test_the_table_fits_80_columns_and_loses_no_character(tmp_path: Path) -> None:
    ref = "registry.example.com:5000/team/llama-3.1-8b:v1@sha256:" + "b" * 64
    infos = [_images.ImageInfo("/var/lib/vsnap/images/llama-3.1-8b-instruct", "llama-3.1-8b-instruct", "vllm",
                               "/models/Meta-Llama-3.1-8B-Instruct", 20_923_456_789, 20_123_456_789, 60,
                               "2026-12-01T12:26:52+00:00", ref, 2),
             _images.ImageInfo("/var/lib/vsnap/images/cpu\x1b[31m", "cpu", "cpu", "/m/cpu-tiny-v1", 338_311_100,
                               328_311_100, 49,
                               "2026-12-01T14:26:52+02:00", "captured", 2)]
    console = Console(file=io.StringIO(), width=80, color_system=None)
    console.print(images_cli.images_table(infos, 80))
    text = console.file.getvalue()
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= 80
    assert "\x1b" not in text and "\\x1b" in text  # a manifest's escape sequence is shown, not obeyed
    flat = "".join(lines)
    for column in ("20.1 GB", "328.3 MB", "2026-12-01 12:26"):
        assert column in flat  # +02:00 shown in UTC
    folded = {"ref": ref, "model": "Meta-Llama-3.1-8B-Instruct"}
    for name, value in folded.items():  # folded over lines, but every character is there, in order
        assert all(ch in text for ch in value)
    last = [line[-12:].strip() for line in lines[2:]]
    assert "".join(part for part in last if part and part != "captured").startswith(ref[:30])


def test_images_cli_json_and_stderr(tmp_path: Path) -> None:
    make_image(tmp_path / "images" / "fake")
    (tmp_path / "images" / "link").symlink_to(tmp_path)
    result = runner.invoke(app, ["images", str(tmp_path / "images"), "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["kind"] == "images" and [i["name"] for i in doc["images"]] == ["fake"]
    assert doc["skipped"][0]["path"].endswith("/link")
    (tmp_path / "images" / "x\nskipped forged: fine").symlink_to(tmp_path)
    plain = runner.invoke(app, ["images", str(tmp_path / "images")])
    assert plain.exit_code == 0 and "fake" in plain.stdout and "skipped" in plain.stderr
    assert [line for line in plain.stderr.splitlines() if line.startswith("skipped")] == [
        f"skipped {tmp_path}/images/link: is a symlink; vsnap never follows one",
        f"skipped {tmp_path}/images/x\\nskipped forged: fine: is a symlink; vsnap never follows one"]
    missing = runner.invoke(app, ["images", str(tmp_path / "nope")])
    assert missing.exit_code == 4 and "does not exist" in missing.stderr


# --- vsnap rm --------------------------------------------------------------------------------------


def test_rm_deletes_the_image_and_nothing_beside_it(tmp_path: Path) -> None:
    root = tmp_path / "images"
    image = make_image(root / "fake")
    keep = make_image(root / "other")
    (root / "notes.txt").write_text("mine")
    size = sum(len(d) for d in FILES.values()) + (image / MANIFEST).stat().st_size
    removed = _images.remove_image(image, instances=no_instances)
    assert (removed.path, removed.name, removed.files, removed.size_bytes) == (str(image), "fake", len(FILES) + 1,
                                                                               size)
    assert not os.path.lexists(image)
    assert sorted(p.name for p in root.iterdir()) == [".fake.lock", ".fake.readers.lock", "notes.txt", "other"]
    assert (keep / MANIFEST).exists()


def test_rm_is_refused_while_an_instance_runs_from_the_image(tmp_path: Path) -> None:
    image = make_image(tmp_path / "images" / "fake")
    with pytest.raises(ImageBusy, match="in use: instance r-0000abcd runs from it") as error:
        _images.remove_image(image, instances=lambda: [record(image)])
    assert error.value.exit_code == 4 and "vsnap stop" in error.value.hint
    assert (image / MANIFEST).exists()


def test_rm_is_refused_while_a_capture_or_a_restore_holds_the_locks(tmp_path: Path) -> None:
    image = make_image(tmp_path / "images" / "fake")
    with image_lock(image):
        with pytest.raises(ImageBusy, match="a vsnap capture is writing"):
            _images.remove_image(image, instances=no_instances)
    with image_read_lock(image):  # what a restore holds from verification until the engine read the image
        with pytest.raises(ImageBusy, match="a vsnap restore is reading"):
            _images.remove_image(image, instances=no_instances)
    assert (image / MANIFEST).exists()
    _images.remove_image(image, instances=no_instances)  # released: now it goes
    assert not image.exists()


def test_rm_never_removes_a_link_or_what_vsnap_did_not_make(tmp_path: Path) -> None:
    root = tmp_path / "images"
    victim = make_image(tmp_path / "elsewhere" / "victim")
    (root).mkdir(mode=0o700)
    (root / "link").symlink_to(victim)
    with pytest.raises(ImageUntrusted, match="is a symlink; vsnap rm removes an image directory, never a link"):
        _images.remove_image(root / "link", instances=no_instances)
    ordinary = root / "ordinary"
    ordinary.mkdir(mode=0o700)
    (ordinary / "thesis.txt").write_text("years of work")
    with pytest.raises(ImageError, match="is not a vsnap image"):
        _images.remove_image(ordinary, instances=no_instances)
    assert sorted(p.name for p in root.iterdir()) == ["link", "ordinary"]  # hostile pass 18: no lock files beside it
    theirs = make_image(root / "theirs")
    for path in [theirs, *theirs.rglob("*")]:
        os.lchown(path, NOBODY, NOBODY)
    with pytest.raises(ImageUntrusted, match="owned by uid 65534"):
        _images.remove_image(theirs, instances=no_instances)
    planted = make_image(root / "planted")
    (planted / "criu" / "not-ours.txt").write_text("someone's")
    with pytest.raises(ImageError, match="holds criu/not-ours.txt, which its manifest does not list"):
        _images.remove_image(planted, instances=no_instances)
    extra_dir = make_image(root / "extra-dir")
    (extra_dir / "stash").mkdir(mode=0o700)
    with pytest.raises(ImageError, match="holds the directory stash"):
        _images.remove_image(extra_dir, instances=no_instances)
    inner = make_image(root / "inner")
    (inner / "criu" / "to-victim").symlink_to(victim / MANIFEST)
    with pytest.raises(ImageUntrusted, match="nothing in an image may be a link"):
        _images.remove_image(inner, instances=no_instances)
    assert (victim / MANIFEST).exists() and (ordinary / "thesis.txt").exists()
    for kept in (theirs, planted, extra_dir, inner):
        assert (kept / MANIFEST).exists() and (kept / "criu" / "pages-1.img").exists()


def test_rm_refuses_system_directories_and_dotdot(tmp_path: Path) -> None:
    with pytest.raises(ImageError, match="system directory"):
        _images.remove_image("/var/lib/vsnap/images", instances=no_instances)
    with pytest.raises(ImageError, match="must not contain '..'"):
        _images.remove_image(f"{tmp_path}/a/../b", instances=no_instances)


def test_a_bare_name_means_the_default_root() -> None:
    assert _images.image_path("llama") == Path("/var/lib/vsnap/images/llama")
    assert _images.image_path("./llama") == Path(os.path.abspath("llama"))


def test_an_old_format_image_is_removable(tmp_path: Path) -> None:
    raw = {"format_version": 1, "files": {rel: {} for rel in FILES}, "name": "old"}
    image = make_image(tmp_path / "images" / "old", raw=raw)
    assert _images.remove_image(image, instances=no_instances).name == "old"
    assert not image.exists()


def test_an_interrupted_rm_is_finished_by_the_next(tmp_path: Path) -> None:
    root = tmp_path / "images"
    image = make_image(root / "fake")
    leftover = root / ".fake.rm-0123abcd"
    os.rename(image, leftover)  # interrupted after the rename, part way through the files
    os.unlink(leftover / "criu" / "pages-1.img")
    empty = root / ".fake.rm-89abcdef"  # interrupted after the manifest went: only directories left
    (empty / "criu").mkdir(parents=True, mode=0o700)
    os.chmod(empty, 0o700)
    theirs = root / ".fake.rm-deadbeef"  # looks like one, but another user made it: not ours
    theirs.mkdir(mode=0o700)
    os.chown(theirs, NOBODY, NOBODY)
    stray = root / ".fake.rm-0000ffff"  # root's, but holds a file and no manifest: not recognized, left
    stray.mkdir(mode=0o700)
    (stray / "notes").write_text("?")
    removed = _images.remove_image(image, instances=no_instances)
    assert removed.name is None and removed.finished == [str(leftover), str(empty)]
    assert sorted(p.name for p in root.iterdir() if not p.name.endswith(".lock")) == [".fake.rm-0000ffff",
                                                                                     ".fake.rm-deadbeef"]
    with pytest.raises(ImageError, match="holds files but no manifest"):
        _images.remove_image(image, instances=no_instances)
    assert (stray / "notes").exists()
    os.unlink(stray / "notes")
    os.rmdir(stray)
    with pytest.raises(ImageError, match="does not exist"):
        _images.remove_image(image, instances=no_instances)
    make_image(image)  # a new image there, and one left by an interrupted rm it cannot recognize
    os.mkdir(stray, 0o700)
    (stray / "notes").write_text("?")
    assert _images.remove_image(image, instances=no_instances).finished == []  # the image goes, the stray stays
    assert not image.exists() and (stray / "notes").exists()


def test_deletion_never_goes_through_a_link_swapped_in(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "pages-1.img").write_text("precious")
    staging = tmp_path / ".fake.rm-0123abcd"
    staging.mkdir(mode=0o700)
    (staging / "criu").symlink_to(victim)
    with pytest.raises(ImageUntrusted, match="criu: is not a real directory any more"):
        _images._delete(staging, ["criu/pages-1.img", MANIFEST], ["criu"])
    assert (victim / "pages-1.img").read_text() == "precious"


def test_rm_cli_exit_codes_and_json(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_images, "running_instances", no_instances)
    image = make_image(tmp_path / "images" / "fake")
    result = runner.invoke(app, ["rm", str(image), "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["kind"] == "rm" and doc["removed"]["path"] == str(image) and doc["removed"]["files"] == 4
    again = runner.invoke(app, ["rm", str(image)])
    assert again.exit_code == 4 and f"error: {image} does not exist" in again.stderr
    image = make_image(tmp_path / "images" / "busy")
    monkeypatch.setattr(_images, "running_instances", lambda: [record(image)])
    busy = runner.invoke(app, ["rm", str(image), "--json"])
    assert busy.exit_code == 4 and json.loads(busy.stdout)["error"] == "ImageBusy"


def test_nothing_is_captured_or_pulled_into_an_image(tmp_path: Path) -> None:
    """Hostile pass 18: a spec whose image or control directory lay inside an existing image was
    captured there; the image then held files its manifest does not list, and was refused by every
    restore and by vsnap rm. Inside an image (or a directory vsnap stages one in), nothing is made."""
    from vsnap.image.store import check_parent, require_outside_images

    victim = make_image(tmp_path / "images" / "victim")
    before = sorted(str(p) for p in victim.rglob("*"))
    for inside in (victim / "sub", victim / "logs" / "deeper" / "x"):
        with pytest.raises(ImageError, match=f"the image {inside} is inside the vsnap image {victim}"):
            check_parent(inside)
    with pytest.raises(ImageError, match="the control directory .* is inside the vsnap image"):
        require_outside_images(victim, "the control directory", "hint", itself=True)
    staging = tmp_path / "images" / ".victim.staging-abcd1234"
    with pytest.raises(ImageError, match="inside the vsnap image .*staging-abcd1234"):
        require_outside_images(staging / "x", "the image", "hint")
    assert sorted(str(p) for p in victim.rglob("*")) == before
    require_outside_images(tmp_path / "images" / "beside", "the image", "hint")  # beside an image: fine
    require_outside_images(victim, "the image", "hint")  # the image itself: what --force replaces


def test_an_image_recording_a_control_directory_inside_another_image_fails_validate(tmp_path: Path) -> None:
    """Hostile pass 18's review: `vsnap validate IMAGE` checked nothing of the control directory an
    image records, which a restore refuses (inside another image, a system directory): it now shows
    that row, failing, and stops there (nothing the image names is read after it)."""
    from vsnap.ops import validate as ops_validate

    victim = make_image(tmp_path / "images" / "victim")
    nested = make_image(tmp_path / "images" / "nested", control_dir=str(victim / "logs"))
    rows = {check.name: check for check in ops_validate.validate_target(nested).checks}
    assert not rows["control directory"].ok
    assert f"is inside the vsnap image {victim}" in rows["control directory"].detail
    assert "image files" not in rows
    fine = make_image(tmp_path / "images" / "fine", control_dir=str(tmp_path / "ctl" / "fine"))
    rows = {check.name: check for check in ops_validate.validate_target(fine).checks}
    assert rows["control directory"].ok and rows["image files"].ok


def test_opening_a_directory_that_is_no_image_makes_no_lock_file_beside_it(tmp_path: Path) -> None:
    """Hostile pass 18's review: `vsnap restore /root/notes` left `/root/.notes.readers.lock`."""
    from vsnap.image.handle import open_image

    notes = tmp_path / "notes"
    notes.mkdir(mode=0o700)
    os.chmod(tmp_path, 0o700)
    with pytest.raises(ImageError, match="not a vsnap image"):
        open_image(notes)
    assert [p.name for p in tmp_path.iterdir()] == ["notes"]
