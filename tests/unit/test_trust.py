"""The image trust model (_trust, _image): what root refuses to act on, each in one line."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from vsnap.host.trust import (
    copy_no_follow,
    require_inside,
    require_plain_names,
    require_trusted_ancestors,
    require_trusted_tree,
)
from vsnap.image.store import image_lock, image_read_lock, require_replaceable, require_trust
from vsnap.protocol.errors import ImageBusy, ImageError, ImageUntrusted

NOBODY = 65534


def make_image(root: Path) -> Path:
    image = root / "images" / "img"
    (image / "criu").mkdir(parents=True, mode=0o700)
    os.chmod(image.parent, 0o700)
    os.chmod(image, 0o700)
    (image / "criu" / "pages-1.img").write_bytes(b"x" * 10)
    (image / "manifest.json").write_text('{"format_version": 2, "files": {}}')
    return image


def test_a_root_owned_private_image_is_trusted(tmp_path: Path) -> None:
    image = make_image(tmp_path)
    assert sorted(require_trusted_tree(image)) == ["criu/pages-1.img", "manifest.json"]


def test_an_image_owned_by_another_user_is_refused(tmp_path: Path) -> None:
    image = make_image(tmp_path)
    for path in [image, image / "criu", image / "criu" / "pages-1.img"]:
        os.chown(path, NOBODY, NOBODY)
    with pytest.raises(ImageUntrusted, match=r"img: the image directory is owned by uid 65534, not by root"):
        require_trusted_tree(image)
    os.chown(image, 0, 0)  # only a file inside is foreign: still refused, naming it
    with pytest.raises(ImageUntrusted, match=r"criu: a directory of the image is owned by uid 65534"):
        require_trusted_tree(image)


def test_a_group_writable_file_or_a_link_inside_is_refused(tmp_path: Path) -> None:
    image = make_image(tmp_path)
    os.chmod(image / "criu" / "pages-1.img", 0o620)
    with pytest.raises(ImageUntrusted, match=r"pages-1.img: a file of the image has mode 0620"):
        require_trusted_tree(image)
    os.chmod(image / "criu" / "pages-1.img", 0o600)
    (image / "criu" / "evil").symlink_to("/etc/shadow")
    with pytest.raises(ImageUntrusted, match=r"evil: is a symlink"):
        require_trusted_tree(image)


def test_an_ancestor_others_can_write_is_refused_but_a_sticky_one_is_not(tmp_path: Path) -> None:
    image = make_image(tmp_path)
    os.chmod(tmp_path, 0o777)
    with pytest.raises(ImageUntrusted, match=r"a parent directory has mode 0777"):
        require_trusted_tree(image)
    os.chmod(tmp_path, 0o1777)  # like /tmp
    require_trusted_tree(image)
    os.chmod(tmp_path, 0o700)
    os.chown(image.parent, NOBODY, NOBODY)
    with pytest.raises(ImageUntrusted, match=r"images: a parent directory is owned by uid 65534"):
        require_trusted_ancestors(image)


def test_a_link_among_the_ancestors_counts_only_if_root_made_it(tmp_path: Path) -> None:
    image = make_image(tmp_path)
    link = tmp_path / "via"
    link.symlink_to(image.parent)
    require_trusted_ancestors(link / "img")
    os.lchown(link, NOBODY, NOBODY)
    with pytest.raises(ImageUntrusted, match=r"via: is a symlink owned by uid 65534"):
        require_trusted_ancestors(link / "img")


@pytest.mark.parametrize("rel", ["../../etc/passwd", "/etc/passwd", "criu/../../x", "criu//x", "./x", ""])
def test_manifest_paths_must_stay_inside_the_image(rel: str) -> None:
    with pytest.raises(ImageUntrusted, match="outside the image"):
        require_inside(rel, "manifest 'files'")


def test_names_vsnap_creates_elsewhere_are_plain() -> None:
    require_plain_names(["link_remap.3"], "shm_files")
    for bad in ["../../../root/.ssh/authorized_keys", "a/b", "..", ""]:
        with pytest.raises(ImageUntrusted, match="plain file names"):
            require_plain_names([bad], "manifest 'shm_files'")


def test_shm_files_must_be_files_of_the_image(tmp_path: Path) -> None:
    from vsnap.image.manifest import Manifest

    manifest = Manifest.model_construct(files={}, shm_files=["link_remap.1"])
    with pytest.raises(ImageUntrusted, match="names a file the image does not list"):
        require_trust(tmp_path, manifest)


def test_force_replaces_only_a_vsnap_image_and_never_a_link(tmp_path: Path) -> None:
    ordinary = tmp_path / "data"
    ordinary.mkdir()
    (ordinary / "precious").write_text("keep me")
    for force in (False, True):  # without --force too: the hint must not send the user to --force
        with pytest.raises(ImageError, match=r"is not a vsnap image .*--force replaces only images") as refused:
            require_replaceable(ordinary, force=force)
        assert "--force" not in refused.value.hint and "capture into another --image" in refused.value.hint
    with pytest.raises(ImageError) as refused:
        require_replaceable(ordinary, force=True, elsewhere="pull into another --to")
    assert refused.value.hint.endswith("or pull into another --to")
    assert (ordinary / "precious").read_text() == "keep me"
    link = tmp_path / "link"
    link.symlink_to(make_image(tmp_path))
    with pytest.raises(ImageUntrusted, match="is a symlink; vsnap never replaces or follows one"):
        require_replaceable(link, force=True)
    require_replaceable(tmp_path / "images" / "img", force=True)
    require_replaceable(tmp_path / "nothing-there", force=False)


def test_a_link_planted_at_a_lock_is_one_clear_error(tmp_path: Path) -> None:
    image = tmp_path / "img"
    target = tmp_path / "elsewhere"
    (tmp_path / ".img.lock").symlink_to(target)
    with pytest.raises(ImageUntrusted, match=r"\.img\.lock: is a symlink; vsnap never follows a link at its lock"):
        with image_lock(image):
            pass
    assert not target.exists()


def test_restores_share_the_read_lock_and_a_publish_waits_for_them(tmp_path: Path) -> None:
    image = tmp_path / "img"
    with image_read_lock(image), image_read_lock(image):  # two restores at once
        with pytest.raises(ImageBusy, match="restores are still reading"):
            with image_read_lock(image, exclusive=True, timeout_s=0.1):
                pass
    with image_read_lock(image, exclusive=True, timeout_s=0.1):
        with pytest.raises(ImageBusy, match="a capture is replacing"):
            with image_read_lock(image, timeout_s=0.1):
                pass


def test_copy_follows_no_link_on_either_side(tmp_path: Path) -> None:
    source = tmp_path / "src"
    source.write_text("data")
    (tmp_path / "link").symlink_to(source)
    with pytest.raises(OSError):
        copy_no_follow(tmp_path / "link", tmp_path / "out")
    victim = tmp_path / "victim"
    victim.write_text("root's file")
    (tmp_path / "planted").symlink_to(victim)
    with pytest.raises(OSError):
        copy_no_follow(source, tmp_path / "planted")
    assert victim.read_text() == "root's file"
    copy_no_follow(source, tmp_path / "copy")
    assert (tmp_path / "copy").read_text() == "data"


def test_missing_ancestors_are_made_by_root_or_refused(tmp_path: Path) -> None:
    """The hostile pass: a control_dir whose ancestors are missing under a sticky, world-writable
    directory. Whoever creates the missing ancestor first owns it; root must notice, not write through it."""
    from vsnap.host.trust import make_trusted_dirs

    shared = tmp_path / "shared-tmp"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    made = make_trusted_dirs(shared / "fresh" / "ctl.instances")
    assert made.is_dir() and (shared / "fresh").stat().st_uid == 0
    planted = shared / "hxyz"
    planted.mkdir()
    os.chown(planted, NOBODY, NOBODY)  # mallory got there first
    with pytest.raises(ImageUntrusted, match=r"hxyz: a directory on the way is owned by uid 65534"):
        make_trusted_dirs(planted / "ctl")
    link = shared / "linked"
    link.symlink_to(tmp_path)
    os.lchown(link, NOBODY, NOBODY)
    with pytest.raises(ImageUntrusted, match="is a symlink owned by uid 65534"):
        make_trusted_dirs(link / "ctl")


def test_a_dependency_that_is_not_a_regular_file_is_named_not_read(tmp_path: Path) -> None:
    from vsnap.image.compat import dependency_mismatches
    from vsnap.image.manifest import Dependency

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    deps = [Dependency(path=str(fifo), size=0, sha256="0" * 64), Dependency(path="/dev/zero", size=0, sha256="0" * 64)]
    assert dependency_mismatches(deps, hash_files=True) == [
        (f"file {fifo}", "a regular file", "something else"),
        ("file /dev/zero", "root's alone", "mode 0666: group or others can write it")]


def test_an_image_file_with_a_second_name_is_refused(tmp_path: Path) -> None:
    image = make_image(tmp_path)
    os.link(image / "criu" / "pages-1.img", tmp_path / "elsewhere")
    with pytest.raises(ImageUntrusted, match="pages-1.img: has 2 hard links"):
        require_trusted_tree(image)


def test_copies_keep_the_holes_of_sparse_files(tmp_path: Path) -> None:
    """vLLM's shared-memory rings are 400 MB files with a few KB written: an image and each
    restore's /dev/shm must not hold 400 MB of zeros."""
    source = tmp_path / "psm_ring"
    with open(source, "wb") as f:
        f.write(b"head")
        f.seek(64 << 20)
        f.write(b"middle")
        f.truncate(200 << 20)
    copy_no_follow(source, tmp_path / "copy")
    copied = tmp_path / "copy"
    assert copied.stat().st_size == source.stat().st_size
    assert copied.stat().st_blocks * 512 < (1 << 20)  # a few pages, not 200 MB
    with open(source, "rb") as a, open(copied, "rb") as b:
        while (chunk := a.read(8 << 20)):
            assert chunk == b.read(8 << 20)


def test_a_model_or_dependency_someone_else_can_change_is_refused(tmp_path: Path) -> None:
    """The third hostile pass: a model directory its user owned was changed after the capture, and
    restores served the changed weights (the oracle's few prompts did not reach the rows changed)."""
    from vsnap.host.trust import require_trusted_model
    from vsnap.image.compat import dependency_mismatches
    from vsnap.image.manifest import Dependency

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"w" * 64)
    require_trusted_model(model)
    os.chown(model / "model.safetensors", NOBODY, NOBODY)
    with pytest.raises(ImageUntrusted, match="a file of the model is owned by uid 65534"):
        require_trusted_model(model)
    dep = Dependency(path=str(model / "model.safetensors"), size=64, sha256="0" * 64)
    assert dependency_mismatches([dep], hash_files=False) == [
        (f"file {model / 'model.safetensors'}", "root's alone", "owned by uid 65534")]
    os.chown(model / "model.safetensors", 0, 0)
    (model / "secret").symlink_to("/etc/shadow")
    os.lchown(model / "secret", NOBODY, NOBODY)
    with pytest.raises(ImageUntrusted, match="is a symlink owned by uid 65534 in the model directory"):
        require_trusted_model(model)


def test_a_model_path_through_someone_elses_link_is_refused(tmp_path: Path) -> None:
    """The fourth hostile pass: `model: /home/mal/m`, mal's link to root's model; mal re-pointed it
    while CRIU restored, and the engine reloaded mal's weights. The link is refused, and a trusted
    path is recorded resolved."""
    from vsnap.host.trust import require_trusted_model

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    link = tmp_path / "m"
    link.symlink_to(model)
    assert require_trusted_model(link) == model  # root's link: accepted, and resolved
    os.lchown(link, NOBODY, NOBODY)
    with pytest.raises(ImageUntrusted, match="m: is a symlink owned by uid 65534"):
        require_trusted_model(link)
    home = tmp_path / "home-mal"
    home.mkdir()
    os.chown(home, NOBODY, NOBODY)
    (home / "m").symlink_to(model)
    with pytest.raises(ImageUntrusted, match="home-mal: a parent directory is owned by uid 65534"):
        require_trusted_model(home / "m")


def test_a_spec_reached_through_someone_elses_link_is_never_read(tmp_path: Path) -> None:
    """The fifth hostile pass: `vsnap validate ~zed/spec.yaml`, zed's link to /etc/shadow, printed
    the shadow file line by line as unknown keys."""
    from vsnap.protocol.errors import SpecError
    from vsnap.spec.schema import load_spec

    secret = tmp_path / "secret"
    secret.write_text("root:*:20228:0:99999:7:::\n")
    os.chmod(secret, 0o600)
    link = tmp_path / "spec.yaml"
    link.symlink_to(secret)
    os.lchown(link, NOBODY, NOBODY)
    with pytest.raises(SpecError) as info:
        load_spec(link)
    assert "owned by uid 65534; vsnap follows only root's links" in str(info.value)
    assert "20228" not in str(info.value.to_dict())
    good = tmp_path / "real.yaml"
    good.write_text("name: ok\nengine: cpu\n")
    (tmp_path / "root-link.yaml").symlink_to(good)
    assert load_spec(tmp_path / "root-link.yaml").name == "ok"  # root's own links still work


def test_a_dependency_recorded_through_someone_elses_link_is_refused(tmp_path: Path) -> None:
    from vsnap.host.trust import untrusted_file

    lib = tmp_path / "lib.so"
    lib.write_bytes(b"\x7fELF")
    link = tmp_path / "libfoo.so"
    link.symlink_to(lib)
    assert untrusted_file(link) is None
    os.lchown(link, NOBODY, NOBODY)
    assert untrusted_file(link) == "a symlink owned by uid 65534"


def test_no_directory_is_made_through_someone_elses_link(tmp_path: Path) -> None:
    """The sixth hostile pass: `--out /tmp/yx/new/sub` with /tmp/yx yan's link to /root made
    /root/new/sub before the check refused the link."""
    from vsnap.host.trust import make_trusted_dirs

    shared = tmp_path / "shared-tmp"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    victim = tmp_path / "root-only"
    victim.mkdir(mode=0o700)
    link = shared / "yx"
    link.symlink_to(victim)
    os.lchown(link, NOBODY, NOBODY)
    with pytest.raises(ImageUntrusted, match="yx: is a symlink owned by uid 65534"):
        make_trusted_dirs(link / "new" / "sub")
    assert list(victim.iterdir()) == []  # nothing was made through the link
    os.lchown(link, 0, 0)  # root's own link is followed
    assert make_trusted_dirs(link / "new").is_dir() and (victim / "new").is_dir()


def test_an_image_parent_is_never_made_through_someone_elses_link(tmp_path: Path) -> None:
    """The seventh hostile pass: check_parent's mkdir -p raced a user's link into /root."""
    from vsnap.image.store import check_parent

    shared = tmp_path / "shared-tmp"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    victim = tmp_path / "root-only"
    victim.mkdir(mode=0o700)
    (shared / "rx").symlink_to(victim)
    os.lchown(shared / "rx", NOBODY, NOBODY)
    with pytest.raises(ImageUntrusted, match="rx: is a symlink owned by uid 65534"):
        check_parent(shared / "rx" / "zz" / "img")
    assert list(victim.iterdir()) == []


def test_force_never_replaces_an_image_someone_else_owns(tmp_path: Path) -> None:
    """The eighth hostile pass: a user's directory with a fake manifest.json was replaced (and its
    tree deleted by root) by `capture --force`."""
    fake = tmp_path / "fake"
    fake.mkdir()
    (fake / "manifest.json").write_text('{"format_version": 1, "files": {}}')
    (fake / "keep").mkdir()
    os.chown(fake, NOBODY, NOBODY)
    with pytest.raises(ImageUntrusted, match="--force replaces only root's own images"):
        require_replaceable(fake, force=True)
    assert (fake / "keep").is_dir()


def test_a_single_file_the_engine_reads_must_be_roots_regular_file(tmp_path: Path) -> None:
    """A chat template, a TLS key: root's alone like the model, and a regular file (a FIFO or
    /dev/zero as a template would block the engine or never end)."""
    from vsnap.host.trust import require_trusted_file, require_trusted_path

    template = tmp_path / "template.jinja"
    template.write_text("{{ messages }}")
    assert require_trusted_file(template, "the serve.chat_template") == template
    os.chown(template, NOBODY, NOBODY)
    with pytest.raises(ImageUntrusted, match="the serve.chat_template is owned by uid 65534"):
        require_trusted_file(template, "the serve.chat_template")
    os.chown(template, 0, 0)
    os.chmod(template, 0o666)
    with pytest.raises(ImageUntrusted, match="group or others can write it"):
        require_trusted_path(template, "the serve.chat_template")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo, 0o600)
    with pytest.raises(ImageUntrusted, match="the serve.ssl_keyfile is not a regular file"):
        require_trusted_file(fifo, "the serve.ssl_keyfile")
    tokenizer = tmp_path / "tokenizer"  # a directory: every file in it, as for the model
    tokenizer.mkdir()
    (tokenizer / "tokenizer.json").write_text("{}")
    os.chown(tokenizer / "tokenizer.json", NOBODY, NOBODY)
    with pytest.raises(ImageUntrusted, match="a file of the serve.tokenizer is owned by uid 65534"):
        require_trusted_path(tokenizer, "the serve.tokenizer")


def test_a_file_only_root_may_read_is_named(tmp_path: Path) -> None:
    """unreadable_by_others: the chat template's text reaches every HTTP client, so it must be a
    file anyone may read (not /etc/shadow), and reachable by them."""
    import tempfile

    from vsnap.host.trust import unreadable_by_others

    public = Path(tempfile.mkdtemp(dir="/tmp"))  # under sticky /tmp: others may enter it once it is 0755
    try:
        os.chmod(public, 0o755)
        template = public / "t.jinja"
        template.write_text("{{ messages }}")
        os.chmod(template, 0o644)
        assert unreadable_by_others(template) is None
        os.chmod(template, 0o600)
        assert unreadable_by_others(template) == f"{template} has mode 0600: only root may read it"
        os.chmod(template, 0o644)
        os.chmod(public, 0o700)
        assert unreadable_by_others(template) == f"{public} has mode 0700: others cannot reach {template}"
    finally:
        import shutil

        shutil.rmtree(public)


def make_site(root: Path) -> Path:
    site = root / "site-packages"
    (site / "pkg").mkdir(parents=True)
    (site / "pkg" / "__init__.py").write_text("")
    (site / "pkg" / "ext.py").write_text("class Extension:\n    pass\n")
    return site


def test_a_worker_extension_must_be_roots_installed_code(tmp_path: Path) -> None:
    """untrusted_module: found as the import system would (first match on the path), without
    importing anything, in root's site-packages only, every file on the way root's alone."""
    from vsnap.host.trust import untrusted_module

    site = make_site(tmp_path)
    assert untrusted_module("pkg.ext.Extension", [str(site)], [str(site)]) is None
    os.chown(site / "pkg" / "ext.py", NOBODY, NOBODY)
    assert untrusted_module("pkg.ext.Extension", [str(site)], [str(site)]) == (
        f"{site / 'pkg' / 'ext.py'} is owned by uid 65534")
    os.chown(site / "pkg" / "ext.py", 0, 0)
    os.chown(site / "pkg" / "__init__.py", NOBODY, NOBODY)  # the package's __init__ runs first
    assert "__init__.py is owned by uid 65534" in untrusted_module("pkg.ext.Extension", [str(site)], [str(site)])
    os.chown(site / "pkg" / "__init__.py", 0, 0)
    cache = site / "pkg" / "__pycache__"  # bytecode planted there would be loaded instead of the source
    cache.mkdir(mode=0o777)
    os.chmod(cache, 0o777)
    assert "__pycache__ is mode 0777: group or others can write it" in untrusted_module(
        "pkg.ext.Extension", [str(site)], [str(site)])
    os.rmdir(cache)
    shadow = tmp_path / "elsewhere"  # earlier on the path: the engine would import this one
    (shadow / "pkg").mkdir(parents=True)
    (shadow / "pkg" / "__init__.py").write_text("")
    assert untrusted_module("pkg.ext.Extension", [str(shadow), str(site)], [str(site)]) == (
        f"pkg is {shadow / 'pkg' / '__init__.py'}, not a module installed in {site}")
    (site / "nspkg" / "sub").mkdir(parents=True)  # no __init__: a namespace package, parts from anywhere
    (site / "nspkg" / "sub" / "m.py").write_text("")
    assert untrusted_module("nspkg.sub.m.C", [str(site)], [str(site)]) == (
        "nspkg is not a module or regular package on the engine's path")
    assert untrusted_module("missing.C", [str(site)], [str(site)]) == (
        "missing is not a module or regular package on the engine's path")
    assert untrusted_module("pkg.ext.inner.C", [str(site)], [str(site)]) == (  # ext is a module, not a package
        "pkg.ext.inner is not a module or regular package on the engine's path")
