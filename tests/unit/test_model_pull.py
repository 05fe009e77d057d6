"""`vsnap pull --model-dir` against a registry that serves forged artifacts (a small http.server on
loopback: tests/integration/test_registry_hostile's): what a pull writes into the model directory,
what it refuses, and what it records for the restore's verified shortcut. No CRIU, no
docker-registry; in-process pulls (root: the trust model's directories are root's)."""

from __future__ import annotations

import errno
import hashlib
import os
import threading
from pathlib import Path
from typing import Any, Callable

import pytest

from tests.integration.test_registry_hostile import Hostile, Server, serve  # noqa: F401 (serve: a fixture)
from tests.unit.fake_image import manifest as fake_manifest
from vsnap.host import verified
from vsnap.image.compat import dependency_mismatches
from vsnap.image.manifest import Dependency, ImageLaunch
from vsnap.protocol.errors import HostNotReady, ImageBusy, ImageUntrusted, VsnapError
from vsnap.registry import pull as pull_module
from vsnap.registry.oci import MODEL_FILE_MEDIA_TYPE, Layer, build_manifest, sha256_digest
from vsnap.registry.pull import pull_image

IMAGE_FILES = {"criu/pages-1.img": b"p" * 1000, "logs/engine.log": b"log\n"}
MEDIA = {"Content-Type": "application/vnd.oci.image.manifest.v1+json"}


def model_image(registry: Server, model_dir: str, model: dict[str, bytes], *, tag: str = "v1",
                image_files: dict[str, bytes] | None = None,
                blob_hook: Callable[[str], int | None] | None = None) -> tuple[str, Any]:
    """Serve an image whose launch.model is ``model_dir`` and whose model files (``model``, path in
    the model directory -> bytes) travel as model layers; the reference and manifest.json."""
    files = image_files or IMAGE_FILES
    base = fake_manifest(files)
    launch = ImageLaunch(**{**base.launch.model_dump(), "model": model_dir})
    deps = [Dependency(path=f"{model_dir.rstrip('/')}/{rel}", size=len(data), sha256=hashlib.sha256(data).hexdigest())
            for rel, data in model.items()]
    doc = fake_manifest(files, launch=launch, dependencies=deps)
    config = doc.model_dump_json().encode()
    layers = [Layer(rel, "raw", sha256_digest(data), len(data)) for rel, data in files.items()]
    model_layers = [Layer(rel, "raw", sha256_digest(data), len(data)) for rel, data in model.items()]
    document = build_manifest(config, layers, doc, model_layers)
    assert MODEL_FILE_MEDIA_TYPE.encode() in document or not model
    blobs = {sha256_digest(data): data for data in [config, *files.values(), *model.values()]}
    registry.route("GET", f"/v2/vsnap/x/manifests/{tag}")(lambda h: h.reply(200, document, MEDIA))

    def blob(h: Hostile) -> None:
        digest = h.path.rsplit("/", 1)[-1]
        if blob_hook is not None and (status := blob_hook(digest)) is not None:
            h.reply(status)  # the hook's answer instead of the blob
            return
        data = blobs.get(digest)
        h.reply(200, data) if data is not None else h.reply(404)
    registry.route("GET", "/v2/vsnap/x/blobs/")(blob)
    return f"{registry.address}/vsnap/x:{tag}", doc


def images(tmp_path: Path) -> Path:
    root = tmp_path / "images"
    root.mkdir(mode=0o700, exist_ok=True)
    return root


def models(tmp_path: Path) -> Path:
    root = tmp_path / "models"
    root.mkdir(mode=0o700, exist_ok=True)
    return root


def test_a_model_file_over_one_piece_is_pulled(serve: Callable[[], Server], tmp_path: Path) -> None:
    """A model file is checked by its plain sha256 (what the dependency records), not by the
    image files' 64 MiB-piece scheme: every safetensors file of a real model is over 64 MiB."""
    registry = serve()
    model_dir = models(tmp_path) / "big"
    big = bytes(range(256)) * ((65 << 20) // 256) + b"tail"
    ref, _ = model_image(registry, str(model_dir), {"model.safetensors": big, "config.json": b"{}"})
    result = pull_image(ref, to=images(tmp_path) / "x", model_dir=model_dir, jobs=2)
    assert result.model_fetched == 2
    assert hashlib.sha256((model_dir / "model.safetensors").read_bytes()).digest() == hashlib.sha256(big).digest()


def test_a_disk_full_while_writing_manifest_json_is_named(serve: Callable[[], Server], tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    registry = serve()
    ref, _ = model_image(registry, str(models(tmp_path) / "m"), {"config.json": b"{}"})

    def full(*args: Any, **kwargs: Any) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(pull_module, "write_atomic", full)
    with pytest.raises(HostNotReady, match="the disk filled while pulling"):
        pull_image(ref, to=images(tmp_path) / "x")


def test_a_kept_model_file_changed_during_the_pull_is_not_recorded_as_verified(
        serve: Callable[[], Server], tmp_path: Path) -> None:
    """A model file kept (already there, checked before any blob) that changes while the rest
    downloads is never recorded with the image's sha256: the record takes the file as it was when
    it was checked, so the first restore hashes it again and refuses it."""
    registry = serve()
    model_dir = models(tmp_path) / "m"
    kept, fetched = b"k" * 4096, b"f" * 4096
    model_dir.mkdir(mode=0o700)
    (model_dir / "kept.bin").write_bytes(kept)
    os.chmod(model_dir / "kept.bin", 0o600)
    os.utime(model_dir / "kept.bin", ns=(1, 1))

    def change_kept(digest: str) -> None:
        if digest == sha256_digest(fetched):
            with open(model_dir / "kept.bin", "r+b") as f:  # root changes it in place: same size
                f.write(b"X")
    ref, doc = model_image(registry, str(model_dir), {"kept.bin": kept, "fetched.bin": fetched}, blob_hook=change_kept)
    pull_image(ref, to=images(tmp_path) / "x", model_dir=model_dir)
    dep = next(d for d in doc.dependencies if d.path.endswith("kept.bin"))
    assert dependency_mismatches([dep], hash_files=True, cache_root=verified.VERIFIED_DIR), \
        "the record says the changed file is the image's"


def test_two_pulls_into_one_model_directory_do_not_undo_each_other(
        serve: Callable[[], Server], tmp_path: Path) -> None:
    """Two images of one model pulled at once into its directory: the second is refused while the
    first holds the directory, and never removes the first's staging directory."""
    first, second = serve(), serve()
    model_dir = models(tmp_path) / "m"
    model = {"model.bin": b"w" * 100_000, "config.json": b"{}"}
    entered, release = threading.Event(), threading.Event()

    def hold(digest: str) -> None:
        if digest == sha256_digest(model["model.bin"]) and not entered.is_set():
            entered.set()
            release.wait(30)
    ref_a, _ = model_image(first, str(model_dir), model, blob_hook=hold)
    ref_b, _ = model_image(second, str(model_dir), model, image_files={"criu/pages-1.img": b"q" * 1000})
    outcome: dict[str, Any] = {}

    def pull_a() -> None:
        try:
            outcome["a"] = pull_image(ref_a, to=images(tmp_path) / "a", model_dir=model_dir, jobs=1)
        except Exception as exc:  # noqa: BLE001 (reported below)
            outcome["a"] = exc
    thread = threading.Thread(target=pull_a)
    thread.start()
    try:
        assert entered.wait(30)
        with pytest.raises((ImageBusy, HostNotReady), match="another vsnap pull"):
            pull_image(ref_b, to=images(tmp_path) / "b", model_dir=model_dir)
    finally:
        release.set()
        thread.join(60)
    assert not isinstance(outcome["a"], Exception), outcome["a"]
    assert (model_dir / "model.bin").read_bytes() == model["model.bin"]


@pytest.mark.parametrize("case", ["not the model's", "vsnap's records", "inside the image", "holds the image",
                                  "inside another image", "a hidden directory", "an existing hidden directory", "a spool directory",
                                  "runtime state", "a sticky directory others write to", "writable by a group"])
def test_a_model_directory_a_pull_must_not_write_into_is_refused_before_any_blob(
        case: str, serve: Callable[[], Server], tmp_path: Path) -> None:
    """The model directory is the manifest's (launch.model, the registry's word): a pull writes
    into it only where it holds nothing but that model's files (so a hostile image whose model
    directory is /root/.ssh, a crontab or a site-packages directory cannot add a file there,
    even when the user types the path it names), never into vsnap's own records, and never into
    the image it is pulling, or around it."""
    registry = serve()
    target = images(tmp_path) / "x"
    files = {"authorized_keys": b"ssh-ed25519 AAAA attacker\n"}
    if case == "not the model's":
        model_dir = models(tmp_path) / "keys"
        model_dir.mkdir(mode=0o700)
        (model_dir / "known_hosts").write_bytes(b"host key\n")
        needle = "known_hosts"
    elif case == "a hidden directory":
        model_dir = models(tmp_path) / "home" / ".ssh"
        needle = r"hidden directory \(\.ssh\)"
    elif case == "an existing hidden directory":
        model_dir = models(tmp_path) / ".local" / "lib" / "site-packages"
        model_dir.mkdir(parents=True, mode=0o700)
        needle = r"hidden directory \(\.local\)"
    elif case == "a spool directory":
        model_dir = Path(f"/var/spool/vsnap-test-{os.getpid()}")
        needle = "inside /var/spool"
    elif case == "runtime state":
        model_dir = Path(f"/run/vsnap-test-{os.getpid()}/system")
        needle = "inside /run"
    elif case == "a sticky directory others write to":
        model_dir = models(tmp_path) / "crontabs"
        model_dir.mkdir(mode=0o700)
        os.chmod(model_dir, 0o1730)
        needle = "mode 1730"
    elif case == "writable by a group":
        model_dir = models(tmp_path) / "m"
        (model_dir / "authorized_keys").parent.mkdir(mode=0o700)
        files = {"sub/authorized_keys": files["authorized_keys"]}
        (model_dir / "sub").mkdir(mode=0o770)
        os.chmod(model_dir / "sub", 0o770)
        needle = "mode 0770"
    elif case == "vsnap's records":
        model_dir = verified.VERIFIED_DIR / f"test-{os.getpid()}"
        needle = "vsnap's own"
    elif case == "inside the image":
        model_dir = target / "model"
        needle = "the image"
    elif case == "inside another image":  # hostile pass 18's review: the files would join that image
        from tests.unit.fake_image import make_image

        other = make_image(images(tmp_path) / "other")
        model_dir = other / "model"
        needle = f"the model directory {model_dir} is inside the vsnap image {other}"
    else:
        model_dir = target.parent
        needle = "the image"
    fetched: list[str] = []
    ref, _ = model_image(registry, str(model_dir), files, blob_hook=fetched.append)
    try:
        with pytest.raises(VsnapError, match=needle) as refused:
            pull_image(ref, to=target, model_dir=model_dir)
        assert "\n" not in refused.value.message
        assert not [rel for rel in files if (model_dir / rel).exists()] and not target.exists()
        assert not [data for data in files.values() if sha256_digest(data) in fetched]
        if case in ("a hidden directory", "a spool directory", "runtime state"):
            assert not model_dir.exists()
    finally:
        if case == "vsnap's records" and model_dir.exists():
            import shutil
            shutil.rmtree(model_dir)


@pytest.mark.parametrize("title", [".incoming", ".incoming/0"])
def test_a_model_file_named_like_the_pulls_own_directory_is_refused(
        title: str, serve: Callable[[], Server], tmp_path: Path) -> None:
    registry = serve()
    model_dir = models(tmp_path) / "m"
    ref, _ = model_image(registry, str(model_dir), {title: b"x" * 10, "config.json": b"{}"})
    with pytest.raises(ImageUntrusted, match="names a file vsnap writes itself"):
        pull_image(ref, to=images(tmp_path) / "x", model_dir=model_dir)


def test_a_file_where_the_model_has_a_directory_is_refused_before_any_blob(
        serve: Callable[[], Server], tmp_path: Path) -> None:
    registry = serve()
    model_dir = models(tmp_path) / "m"
    model_dir.mkdir(mode=0o700)
    (model_dir / "sub").write_bytes(b"a file, not the model's directory")
    fetched: list[str] = []
    ref, _ = model_image(registry, str(model_dir), {"sub/x.bin": b"x" * 100}, blob_hook=fetched.append)
    with pytest.raises(HostNotReady, match="stands where the image's model has a directory"):
        pull_image(ref, to=images(tmp_path) / "x", model_dir=model_dir)
    assert sha256_digest(b"x" * 100) not in fetched and not (images(tmp_path) / "x").exists()


def test_an_interrupted_model_download_resumes_with_the_files_it_kept(
        serve: Callable[[], Server], tmp_path: Path) -> None:
    registry = serve()
    model_dir = models(tmp_path) / "m"
    model = {"a.bin": b"a" * 5000, "b.bin": b"b" * 4000}
    seen: list[str] = []
    broken = {"on": True}

    def hook(digest: str) -> int | None:
        seen.append(digest)
        return 404 if broken["on"] and digest == sha256_digest(model["b.bin"]) else None  # the pull fails
    ref, _ = model_image(registry, str(model_dir), model, blob_hook=hook)
    with pytest.raises(VsnapError):
        pull_image(ref, to=images(tmp_path) / "x", model_dir=model_dir, jobs=1)
    assert not (model_dir / "a.bin").exists() and not (images(tmp_path) / "x").exists()
    broken["on"] = False
    result = pull_image(ref, to=images(tmp_path) / "x", model_dir=model_dir, jobs=1)
    assert result.model_fetched == 1 and seen.count(sha256_digest(model["a.bin"])) == 1  # a.bin kept from staging
    assert {p.name for p in model_dir.iterdir()} == {"a.bin", "b.bin"}


def test_a_resumed_pull_keeps_a_model_file_over_one_piece_by_its_plain_sha256(
        serve: Callable[[], Server], tmp_path: Path) -> None:
    """A file an interrupted pull had checked, whose record is gone, is hashed again by its entry's
    scheme: a model file by its plain sha256 (by pieces it never matched, and was fetched again)."""
    registry = serve()
    model_dir = models(tmp_path) / "m"
    model = {"big.bin": bytes(range(256)) * ((65 << 20) // 256), "small.bin": b"s" * 4000}
    seen: list[str] = []
    broken = {"on": True}

    def hook(digest: str) -> int | None:
        seen.append(digest)
        return 404 if broken["on"] and digest == sha256_digest(model["small.bin"]) else None
    ref, _ = model_image(registry, str(model_dir), model, blob_hook=hook)
    with pytest.raises(VsnapError):
        pull_image(ref, to=images(tmp_path) / "x", model_dir=model_dir, jobs=1)  # the larger first, then fails
    staging = next(p for p in model_dir.iterdir() if p.name.startswith(".vsnap-pull-"))
    assert (staging / "big.bin").is_file()
    verified.forget(staging)  # no record of it: the next pull must hash it
    broken["on"] = False
    result = pull_image(ref, to=images(tmp_path) / "x", model_dir=model_dir, jobs=1)
    assert result.model_fetched == 1 and seen.count(sha256_digest(model["big.bin"])) == 1


@pytest.mark.parametrize("model", ["relative/model", "/models/m\n/x", "/models/\x1b]0;owned\x07m",
                                   "/models/m/../../etc", "/m\0x"])
def test_a_manifest_whose_model_directory_is_not_a_plain_path_is_malformed(model: str, tmp_path: Path) -> None:
    """launch.model is the directory a pull writes the model into and the one its hints tell the
    user to type: an image whose manifest names anything but a plain absolute path is refused as
    it is read (a newline or an escape sequence would reach the user's terminal in a hint)."""
    from tests.unit.fake_image import make_image
    from vsnap.image.manifest import read_manifest
    from vsnap.protocol.errors import ImageFormatError

    base = fake_manifest()
    raw = fake_manifest(launch=ImageLaunch(**{**base.launch.model_dump(), "model": "/placeholder"})).model_dump()
    raw["launch"]["model"] = model
    image = make_image(tmp_path / "images" / "x", raw=raw)
    with pytest.raises(ImageFormatError, match="launch.model") as refused:
        read_manifest(image)
    assert refused.value.message.isprintable()


def test_a_disk_full_during_the_model_download_says_what_it_kept(
        serve: Callable[[], Server], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    registry = serve()
    model_dir = models(tmp_path) / "m"
    ref, _ = model_image(registry, str(model_dir), {"a.bin": b"a" * 5000, "b.bin": b"b" * 4000})
    real = pull_module.write_blob

    def full(chunks: Any, layer: Layer, *args: Any) -> None:
        if layer.path == "b.bin":
            raise OSError(errno.ENOSPC, "No space left on device")
        real(chunks, layer, *args)
    monkeypatch.setattr(pull_module, "write_blob", full)
    with pytest.raises(HostNotReady, match=rf"the disk filled while pulling .* into {model_dir}: 1 of 2 files are "
                                           r"fetched and checked, kept in .*\.vsnap-pull-"):
        pull_image(ref, to=images(tmp_path) / "x", model_dir=model_dir, jobs=1)
    monkeypatch.setattr(pull_module, "write_blob", real)
    assert pull_image(ref, to=images(tmp_path) / "x", model_dir=model_dir, jobs=1).model_fetched == 1


def test_a_model_directory_spanning_filesystems_is_refused_before_any_blob(
        serve: Callable[[], Server], tmp_path: Path) -> None:
    """A directory of the model that is another filesystem's (a mount point) cannot take a rename
    from the staging directory: refused before any blob, not with EXDEV after the download."""
    import subprocess

    registry = serve()
    model_dir = models(tmp_path) / "m"
    (model_dir / "sub").mkdir(parents=True, mode=0o700)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "mode=0700", "none", str(model_dir / "sub")]).returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    try:
        fetched: list[str] = []
        ref, _ = model_image(registry, str(model_dir), {"sub/x.bin": b"x" * 100, "y.bin": b"y"},
                             blob_hook=fetched.append)
        with pytest.raises(HostNotReady, match="is on another filesystem than"):
            pull_image(ref, to=images(tmp_path) / "x", model_dir=model_dir)
        assert sha256_digest(b"x" * 100) not in fetched
    finally:
        subprocess.run(["umount", str(model_dir / "sub")])


@pytest.mark.parametrize("name", [".incoming/x", "a\nb", ".vsnap-pull-0123456789abcdef/x"])
def test_a_push_of_a_model_file_a_pull_would_refuse_is_refused_before_any_byte(name: str) -> None:
    from vsnap.protocol.errors import ImageError
    from vsnap.registry.model_files import layers_to_push

    launch = ImageLaunch(**{**fake_manifest().launch.model_dump(), "model": "/nonexistent-model"})
    doc = fake_manifest(launch=launch, dependencies=[Dependency(path=f"/nonexistent-model/{name}", size=1,
                                                                sha256="0" * 64)])
    with pytest.raises(ImageError, match="a name a pull refuses") as refused:
        layers_to_push(doc)
    assert refused.value.message.isprintable()


def test_a_pull_reports_its_bytes_against_what_it_must_fetch(
        serve: Callable[[], Server], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The download phase's progress: the model's and the image's bytes still to fetch (a file
    already in place is not counted), done bytes rising to that total."""
    from vsnap.host import events

    monkeypatch.setattr(events.ByteProgress, "EVERY_S", 0.0)
    registry = serve()
    model_dir = models(tmp_path) / "m"
    model = {"a.bin": b"a" * 70000, "b.bin": b"b" * 40000}
    ref, _ = model_image(registry, str(model_dir), model)
    seen: list[events.PhaseEvent] = []
    result = pull_image(ref, to=images(tmp_path) / "x", model_dir=model_dir, jobs=1, on_event=seen.append)
    progress = [e for e in seen if e.state == "progress"]
    assert progress and all(e.phase == "download blobs" for e in progress)
    assert progress[-1].done_bytes == result.bytes_received + result.model_bytes_received == progress[-1].total_bytes
    assert result.model_bytes_received == 110000  # the model's two blobs, counted apart from the image's
    assert [e.done_bytes for e in progress] == sorted(e.done_bytes or 0 for e in progress)


def test_a_model_is_pulled_beside_the_same_image_and_never_over_another(
        serve: Callable[[], Server], tmp_path: Path) -> None:
    """The image at --to with the artifact's manifest.json: only the model comes (nothing of the
    image fetched or replaced). Another image there: refused as any pull over an image is,
    unless --force."""
    from vsnap.protocol.errors import ImageError

    registry = serve()
    model_dir = models(tmp_path) / "m"
    ref, _ = model_image(registry, str(model_dir), {"a.bin": b"a" * 5000})
    target = images(tmp_path) / "x"
    pull_image(ref, to=target)  # the image alone
    manifest_before = (target / "manifest.json").stat()
    result = pull_image(ref, to=target, model_dir=model_dir)
    assert result.image_was_there and result.downloaded == 0 and result.staging is None
    assert result.model_fetched == 1 and (model_dir / "a.bin").read_bytes() == b"a" * 5000
    assert (target / "manifest.json").stat().st_ino == manifest_before.st_ino  # not replaced

    other, _ = model_image(registry, str(model_dir), {"a.bin": b"a" * 5000, "b.bin": b"b" * 10}, tag="v2")
    with pytest.raises(ImageError, match="already exists"):
        pull_image(other, to=target, model_dir=model_dir)
    forced = pull_image(other, to=target, model_dir=model_dir, force=True)
    assert not forced.image_was_there and forced.model_fetched == 1


def hf_cache_model(tmp_path: Path) -> tuple[Path, Path, bytes]:
    """A model directory of Hugging Face's cache: snapshots/REV/config.json -> ../../blobs/SHA."""
    data = b'{"model_type": "llama"}'
    blobs = tmp_path / "hub" / "models--org--m" / "blobs"
    snapshot = tmp_path / "hub" / "models--org--m" / "snapshots" / "rev"
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    blob = blobs / hashlib.sha256(data).hexdigest()
    blob.write_bytes(data)
    (snapshot / "config.json").symlink_to(f"../../blobs/{blob.name}")
    return snapshot, blob, data


def test_a_push_of_a_model_whose_blob_the_image_needs_outside_its_directory_is_refused(tmp_path: Path) -> None:
    """The engine had the blob behind a link open: the image depends on it by its own path, which
    a pull of the model never brings back (it writes the link's name as a file)."""
    from vsnap.protocol.errors import ImageError
    from vsnap.registry.model_files import layers_to_push

    snapshot, blob, data = hf_cache_model(tmp_path)
    digest = hashlib.sha256(data).hexdigest()
    launch = ImageLaunch(**{**fake_manifest().launch.model_dump(), "model": str(snapshot)})
    deps = [Dependency(path=str(snapshot / "config.json"), size=len(data), sha256=digest)]
    assert set(layers_to_push(fake_manifest(launch=launch, dependencies=deps))) == {"config.json"}  # the link: fine
    deps.append(Dependency(path=str(blob), size=len(data), sha256=digest))
    with pytest.raises(ImageError, match=r"depends on .*blobs/.*, the file behind .*config.json, outside the model"):
        layers_to_push(fake_manifest(launch=launch, dependencies=deps))


def test_a_push_of_a_changed_model_file_says_what_to_do_for_a_push(tmp_path: Path) -> None:
    from vsnap.protocol.errors import ImageHostMismatch
    from vsnap.registry.model_files import layers_to_push

    model_dir = tmp_path / "m"
    model_dir.mkdir()
    (model_dir / "w.bin").write_bytes(b"now")
    launch = ImageLaunch(**{**fake_manifest().launch.model_dump(), "model": str(model_dir)})
    deps = [Dependency(path=str(model_dir / "w.bin"), size=3, sha256=hashlib.sha256(b"was").hexdigest())]
    with pytest.raises(ImageHostMismatch) as refused:
        layers_to_push(fake_manifest(launch=launch, dependencies=deps))
    assert refused.value.hint == "put the model back as it was captured, or capture the image again"


def test_a_link_where_the_model_has_a_directory_is_refused_before_any_blob(
        serve: Callable[[], Server], tmp_path: Path) -> None:
    """A link (even root's) on the way to a model file: the file would land where none of the
    model directory's checks ran."""
    registry = serve()
    model_dir = models(tmp_path) / "m"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    model_dir.mkdir(mode=0o700)
    (model_dir / "sub").symlink_to(elsewhere)
    ref, _ = model_image(registry, str(model_dir), {"sub/w.bin": b"w" * 100})
    with pytest.raises(HostNotReady, match=r"sub is a link where the image's model has a directory"):
        pull_image(ref, to=images(tmp_path) / "x", model_dir=model_dir)
    assert list(elsewhere.iterdir()) == []


def test_a_damaged_image_beside_its_model_is_not_kept_as_pulled(
        serve: Callable[[], Server], tmp_path: Path) -> None:
    """The same manifest.json at --to, a file of the image changed: the pull must not say it is
    there (a restore would then refuse it); refused with what to do, the image left as it was."""
    from vsnap.protocol.errors import ImageTampered

    registry = serve()
    model_dir = models(tmp_path) / "m"
    ref, _ = model_image(registry, str(model_dir), {"a.bin": b"a" * 5000})
    target = images(tmp_path) / "x"
    pull_image(ref, to=target)
    pages = target / "criu" / "pages-1.img"
    pages.write_bytes(b"q" * 1000)  # same size, other bytes
    with pytest.raises(ImageTampered, match="pages-1.img") as refused:
        pull_image(ref, to=target, model_dir=model_dir)
    assert "--force" in refused.value.hint
    assert pages.read_bytes() == b"q" * 1000 and not (model_dir / "a.bin").exists()


def test_a_link_or_another_users_directory_at_to_is_never_kept_as_the_image(
        serve: Callable[[], Server], tmp_path: Path) -> None:
    """The same image behind root's link at --to, or in a directory another user owns: a pull of
    the model alone never follows the link nor takes the directory as the image."""
    import shutil

    from vsnap.protocol.errors import ImageError

    registry = serve()
    model_dir = models(tmp_path) / "m"
    ref, _ = model_image(registry, str(model_dir), {"a.bin": b"a" * 5000})
    real = images(tmp_path) / "real"
    pull_image(ref, to=real)
    link = images(tmp_path) / "link"
    link.symlink_to(real)
    with pytest.raises(ImageUntrusted, match="symlink"):
        pull_image(ref, to=link, model_dir=model_dir)
    assert link.is_symlink() and not model_dir.exists()

    theirs = images(tmp_path) / "theirs"
    shutil.copytree(real, theirs, symlinks=True)
    for path in [theirs, *theirs.rglob("*")]:
        os.chown(path, 1000, 1000, follow_symlinks=False)
    with pytest.raises(ImageError):
        pull_image(ref, to=theirs, model_dir=model_dir)
    assert not model_dir.exists() and os.stat(theirs).st_uid == 1000


def test_a_fetched_model_file_changed_before_it_is_placed_is_not_recorded_as_verified(
        serve: Callable[[], Server], tmp_path: Path) -> None:
    """A model file fetched and checked first, changed in place (by root) while the image's blobs
    still download: the record never takes it with the image's sha256 (the first restore hashes it
    again and refuses it)."""
    from vsnap.registry.oci import MODEL_STAGING_PREFIX

    registry = serve()
    model_dir = models(tmp_path) / "m"
    fetched = b"f" * 4096

    def change_staged(digest: str) -> None:
        if digest == sha256_digest(IMAGE_FILES["criu/pages-1.img"]):  # the image's blobs come after the model's
            for staged in model_dir.glob(f"{MODEL_STAGING_PREFIX}*/w.bin"):
                with open(staged, "r+b") as f:
                    f.write(b"X")
    ref, doc = model_image(registry, str(model_dir), {"w.bin": fetched}, blob_hook=change_staged)
    pull_image(ref, to=images(tmp_path) / "x", model_dir=model_dir, jobs=1)
    assert (model_dir / "w.bin").read_bytes()[:1] == b"X"  # the hook ran
    dep = next(d for d in doc.dependencies if d.path.endswith("w.bin"))
    assert dependency_mismatches([dep], hash_files=True, cache_root=verified.VERIFIED_DIR), \
        "the record says the changed file is the image's"


def test_a_progress_display_that_fails_never_fails_the_pull(
        serve: Callable[[], Server], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The progress callback runs in the transfer threads: one that raises (stderr's reader gone:
    BrokenPipeError) stops the progress lines, never a blob's download."""
    from vsnap.host import events

    monkeypatch.setattr(events.ByteProgress, "EVERY_S", 0.0)
    registry = serve()
    model_dir = models(tmp_path) / "m"
    ref, _ = model_image(registry, str(model_dir), {"a.bin": b"a" * 70000})
    calls: list[str] = []

    def on_event(event: events.PhaseEvent) -> None:
        if event.state == "progress":
            calls.append(event.phase)
            raise BrokenPipeError(32, "Broken pipe")
    result = pull_image(ref, to=images(tmp_path) / "x", model_dir=model_dir, jobs=2, on_event=on_event)
    assert result.model_fetched == 1 and result.downloaded == len(IMAGE_FILES)
    assert 1 <= len(calls) <= 2  # reported once (by each of the two threads at most), then no more
