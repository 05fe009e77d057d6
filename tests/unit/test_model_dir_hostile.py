"""A model directory as hostile input (hostile pass 20): what root loads, hashes and pushes of it.
Each test fails on the code before the fix it names."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.unit.fake_image import manifest as fake_manifest
from tests.unit.test_resources import spec
from vsnap.engine.adapters.cpu.model import TinyConfig
from vsnap.host.trust import model_file_paths, require_trusted_model
from vsnap.image.manifest import Dependency, ImageLaunch
from vsnap.image.store import sha256_file
from vsnap.ops import resources
from vsnap.protocol.errors import ImageError, ImageUntrusted, SpecError
from vsnap.spec.schema import MAX_CONFIG_BYTES, load_spec


def a_model(tmp_path: Path) -> Path:
    directory = tmp_path / "model"
    directory.mkdir(mode=0o755)
    (directory / "config.json").write_text("{}")
    (directory / "model.safetensors").write_bytes(b"\0" * 64)
    return directory


def test_a_root_link_out_of_the_model_is_refused_so_push_never_sends_its_target(tmp_path: Path) -> None:
    # before: the link passed (its target, /etc/shadow, is root's) and push sent the target's bytes
    directory = a_model(tmp_path)
    (directory / "README.md").symlink_to("/etc/shadow")
    with pytest.raises(ImageUntrusted, match="symlink out of the model directory, to /etc/shadow"):
        require_trusted_model(directory)


def test_a_link_inside_the_model_and_hugging_face_caches_links_to_its_blobs_are_kept(tmp_path: Path) -> None:
    directory = a_model(tmp_path)
    (directory / "alias.json").symlink_to("config.json")
    require_trusted_model(directory)
    repo = tmp_path / "hub" / "models--org--m"
    (repo / "blobs").mkdir(parents=True)
    (repo / "snapshots" / "rev").mkdir(parents=True)
    (repo / "blobs" / "abc").write_text("{}")
    (repo / "snapshots" / "rev" / "config.json").symlink_to("../../blobs/abc")
    assert require_trusted_model(repo / "snapshots" / "rev") == repo / "snapshots" / "rev"
    (repo / "secret").write_text("x")  # beside the blobs, not among them
    (repo / "snapshots" / "rev" / "s").symlink_to("../../secret")
    with pytest.raises(ImageUntrusted, match="symlink out of"):
        require_trusted_model(repo / "snapshots" / "rev")


def test_a_link_to_a_pseudo_file_or_a_fifo_in_the_model_is_refused(tmp_path: Path) -> None:
    # before: /proc/self/pagemap (256 GiB to read) and a FIFO shard passed; the capture hung
    directory = a_model(tmp_path)
    (directory / "README.md").symlink_to("/proc/self/pagemap")
    with pytest.raises(ImageUntrusted, match="symlink out of"):
        require_trusted_model(directory)
    (directory / "README.md").unlink()
    os.mkfifo(directory / "model-00002-of-00002.safetensors")
    with pytest.raises(ImageUntrusted, match="not a regular file or a directory"):
        require_trusted_model(directory)
    with pytest.raises(ImageUntrusted, match="no fixed bytes"):
        require_trusted_model(Path("/proc/self"))


def test_a_name_that_is_not_utf8_and_a_dangling_link_are_one_line_refusals(tmp_path: Path) -> None:
    # before: a non-UTF-8 name passed the preflight and crashed the capture after the boot
    directory = a_model(tmp_path)
    bad = os.fsencode(directory) + b"/notes-\xff.txt"
    with open(bad, "wb"):
        pass
    with pytest.raises(ImageUntrusted, match="not UTF-8"):
        require_trusted_model(directory)
    os.unlink(bad)
    (directory / "tokenizer.json").symlink_to("missing-blob")
    with pytest.raises(ImageUntrusted, match="cannot be read") as refused:
        require_trusted_model(directory)
    assert refused.value.hint == "finish the download, or remove the link"


def test_a_clones_history_and_a_tools_cache_are_not_files_of_the_model(tmp_path: Path) -> None:
    # before: all of .git (its config may hold a token) was a dependency and pushed
    directory = a_model(tmp_path)
    for hidden in (".git/config", ".cache/huggingface/x.lock", "sub/.git/kept"):
        (directory / hidden).parent.mkdir(parents=True, exist_ok=True)
        (directory / hidden).write_text("x")
    require_trusted_model(directory)
    assert [p.relative_to(directory).as_posix() for p in model_file_paths(directory)] == [
        "config.json", "model.safetensors", "sub/.git/kept"]


def test_a_push_of_an_image_that_recorded_a_clones_history_is_refused() -> None:
    from vsnap.registry.model_files import layers_to_push

    launch = ImageLaunch(**{**fake_manifest().launch.model_dump(), "model": "/nonexistent-model"})
    doc = fake_manifest(launch=launch, dependencies=[Dependency(path="/nonexistent-model/.git/config", size=1,
                                                                sha256="0" * 64)])
    with pytest.raises(ImageError, match="not a file of the model"):
        layers_to_push(doc)


def test_a_file_that_holds_more_than_its_size_is_not_hashed_for_ever() -> None:
    # before: a size-0 pseudo file was read to its end (pagemap: 256 GiB)
    with pytest.raises(ImageError, match="grew while it was hashed"):
        sha256_file(Path("/proc/self/status"))


@pytest.mark.parametrize("key", ["dtype", "torch_dtype"])
def test_a_float32_checkpoint_counts_as_loaded_in_16_bits_whichever_key_names_it(tmp_path: Path, key: str) -> None:
    # before: only torch_dtype was read; transformers 4.56+ writes dtype, and the share was 1
    directory = a_model(tmp_path)
    (directory / "config.json").write_text(json.dumps({key: "float32"}))
    assert resources.loaded_share(spec(tmp_path), directory) == 0.5
    assert resources.loaded_share(spec(tmp_path, quantization="fp8"), directory) == 0.25
    (directory / "config.json").write_text(json.dumps({"text_config": {key: "float32"}}))
    assert resources.loaded_share(spec(tmp_path), directory) == 0.5


def test_a_giant_config_is_refused_before_vllm_reads_it(tmp_path: Path) -> None:
    # before: vLLM's parser read a 2 GB sparse config.json whole (4.8 GB of memory) before any check
    directory = a_model(tmp_path)
    with open(directory / "config.json", "r+b") as f:
        f.truncate(MAX_CONFIG_BYTES + 1)
    path = tmp_path / "m.yaml"
    path.write_text(f"name: m\nengine: vllm\nmodel: {directory}\nimage: {tmp_path}/img\n")
    with pytest.raises(SpecError, match="config.json has 4194305 bytes, over the 4 MiB"):
        load_spec(path)


@pytest.mark.parametrize("bad", [{"n_layers": 10**9}, {"d_model": True}, {"vocab_size": 0}, {"d_model": 250}])
def test_the_demo_engine_refuses_a_config_that_would_allocate_without_bound(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError, match="config.json"):
        TinyConfig.from_dict({"model_type": "vsnap-tiny-decoder", **bad})


def test_a_link_chain_through_another_users_link_is_refused(tmp_path: Path) -> None:
    # before: only the first link and the final file were checked; uid 1000 could re-point the middle
    directory = a_model(tmp_path)
    middle = tmp_path / "l3"
    middle.symlink_to(directory / "config.json")
    os.lchown(middle, 1000, 1000)
    (directory / "README.md").symlink_to(middle)
    with pytest.raises(ImageUntrusted, match="leads through a link root does not own"):
        require_trusted_model(directory)


def hub_repository(tmp_path: Path) -> Path:
    repo = tmp_path / "hub" / "models--org--m"
    (repo / "blobs").mkdir(parents=True)
    (repo / "snapshots" / "rev" / "tokenizer").mkdir(parents=True)
    for name in ("a" * 64, "b" * 40):
        (repo / "blobs" / name).write_text("{}")
    (repo / "snapshots" / "rev" / "config.json").symlink_to(f"../../blobs/{'a' * 64}")
    (repo / "snapshots" / "rev" / "tokenizer" / "tokenizer.json").symlink_to(f"../../../blobs/{'b' * 40}")
    return repo


def test_hugging_face_layouts_pass_a_subfolder_and_an_old_local_dir_too(tmp_path: Path) -> None:
    repo = hub_repository(tmp_path)
    require_trusted_model(repo / "snapshots" / "rev" / "tokenizer", "the serve.tokenizer")  # before: refused
    local = a_model(tmp_path)  # huggingface_hub 0.17 to 0.22: --local-dir links into the cache's blobs
    (local / "tokenizer.json").symlink_to(repo / "blobs" / ("a" * 64))
    require_trusted_model(local)
    (repo / "blobs" / "notes").write_text("x")  # in blobs/, but not a blob's name
    (local / "notes").symlink_to(repo / "blobs" / "notes")
    with pytest.raises(ImageUntrusted, match="symlink out of"):
        require_trusted_model(local)


def test_a_link_to_a_directory_outside_is_refused_even_into_blobs(tmp_path: Path) -> None:
    # before: a linked directory in blobs/ was never walked, so nothing under it was checked
    repo = hub_repository(tmp_path)
    (repo / "blobs" / "dd").mkdir()
    (repo / "blobs" / "dd" / "x").symlink_to("/etc/shadow")
    (repo / "snapshots" / "rev" / "d").symlink_to("../../blobs/dd")
    with pytest.raises(ImageUntrusted, match="to the directory"):
        require_trusted_model(repo / "snapshots" / "rev")


def test_a_model_in_dev_shm_is_refused_for_what_it_is() -> None:
    shm = Path("/dev/shm") / f"vsnap-test-model-{os.getpid()}"
    shm.mkdir()
    try:
        with pytest.raises(ImageUntrusted, match="each engine tree replaces with its own"):
            require_trusted_model(shm)
    finally:
        shm.rmdir()


def test_a_top_level_git_file_is_not_a_model_file_and_a_pull_leaves_a_cache_alone(tmp_path: Path) -> None:
    from vsnap.registry.model_files import _require_only_model

    directory = a_model(tmp_path)
    (directory / ".git").write_text("gitdir: ../.git/modules/m\n")  # a submodule's
    assert ".git" not in [p.name for p in model_file_paths(directory)]
    # a node where `huggingface-cli download --local-dir` ran: before, the pull refused its .cache
    (directory / ".cache" / "huggingface").mkdir(parents=True)
    wanted = {rel: Dependency(path=f"{directory}/{rel}", size=1, sha256="0" * 64)
              for rel in ("config.json", "model.safetensors", ".git")}
    _require_only_model(directory, wanted)
    (directory / "stranger").write_text("x")
    with pytest.raises(Exception, match="not a file of the image's model"):
        _require_only_model(directory, wanted)


def test_the_capture_records_the_model_files_alone_and_hashes_what_it_statted(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from vsnap.ops import capture

    monkeypatch.setattr(capture.verified, "remember_dependencies", lambda *a, **k: None)
    directory = a_model(tmp_path)
    (directory / ".git").mkdir()
    (directory / ".git" / "config").write_text("[remote] url = https://user:hf_SECRET@hf.co/m\n")
    recorded = capture._dependencies([], directory, tmp_path / "control")
    assert [Path(d.path).name for d in recorded] == ["config.json", "model.safetensors"]
    with pytest.raises(ImageError, match="changed while vsnap read it"):
        sha256_file(directory / "config.json", size=3)


def test_validate_does_not_hand_a_refused_model_to_vllms_parser(tmp_path: Path) -> None:
    from vsnap.ops.validate import _validate_spec

    directory = a_model(tmp_path)
    (directory / "README.md").symlink_to("/etc/shadow")
    path = tmp_path / "m.yaml"
    path.write_text(f"name: m\nengine: vllm\nmodel: {directory}\nimage: {tmp_path}/img\n"
                    f"snapshot:\n  control_dir: {tmp_path}/control\n")
    rows = {check.name: check for check in _validate_spec(path).checks}
    assert not rows["model"].ok and "symlink out of" in rows["model"].detail
    assert rows["vllm arguments"].detail == "not checked: the model is refused below"


def test_a_path_in_the_model_longer_than_a_record_takes_is_a_one_line_refusal(tmp_path: Path) -> None:
    # before: a raw ENAMETOOLONG from lstat, a traceback in validate
    directory = a_model(tmp_path)
    fd = os.open(directory, os.O_PATH)
    try:
        for _ in range(17):  # 17 x 256 characters: past 4096 whatever tmp_path is
            os.mkdir("d" * 255, dir_fd=fd)
            deeper = os.open("d" * 255, os.O_PATH, dir_fd=fd)
            os.close(fd)
            fd = deeper
    finally:
        os.close(fd)
    with pytest.raises(ImageUntrusted, match="longer than 4096 characters"):
        require_trusted_model(directory)
