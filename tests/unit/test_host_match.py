"""Restoring on another host: every recorded fact that differs is named on its own line, fatal
ones refuse the restore (all at once, not the first), the others are warnings; dependency files
are compared by sha256, reading only what this host has not hashed since it last changed."""

from __future__ import annotations

import io
import os
from pathlib import Path

import pytest

from tests.unit.fake_image import host_facts, manifest
from vsnap.host import verified as _verified
from vsnap.image import compat
from vsnap.image.compat import HostDifference, compare_facts, host_differences, require_host_matches
from vsnap.image.manifest import Dependency


@pytest.fixture
def settled_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The files these tests write are seconds old at most: count them as settled (_verified)."""
    monkeypatch.setattr(_verified, "FINE_MARGIN_NS", -10**12)
    monkeypatch.setattr(_verified, "COARSE_MARGIN_NS", -10**12)
from vsnap.cli import _render
from vsnap.protocol.errors import ImageHostMismatch

GPU = {"index": 0, "name": "NVIDIA H200", "uuid": "GPU-aaaaaaaa-aaaa-aaaa-aaaa-aaaaaaaaaaaa", "memory_bytes": 150 << 30}


def lines(differences: list[HostDifference]) -> list[tuple[str, bool]]:
    return [(d.line, d.fatal) for d in differences]


def test_the_same_host_has_no_difference_and_hostname_and_gpu_uuid_never_count() -> None:
    recorded = host_facts(gpus=[GPU], driver="570.1", cuda="12.8")
    current = host_facts(hostname="another-node", gpus=[{**GPU, "uuid": "GPU-bbbb", "index": 3}], driver="570.1",
                         cuda="12.8")
    assert compare_facts(recorded, current, engine="vllm", cuda=True) == []


@pytest.mark.parametrize("field,recorded,current,line,fatal", [
    ("arch", "x86_64", "aarch64", "arch: image has 'x86_64', host has 'aarch64'", True),
    ("python", "3.11.7", "3.11.9", "python: image has '3.11.7', host has '3.11.9'", True),
    ("torch", "2.13.0+cpu", "2.12.0+cpu", "torch: image has '2.13.0+cpu', host has '2.12.0+cpu'", True),
    ("torch", "2.13.0+cpu", None, "torch: image has '2.13.0+cpu', host has 'None'", True),
    ("vsnap", "0.2.0", "0.2.1", "vsnap: image has '0.2.0', host has '0.2.1'", False),
    ("kernel", "6.1.0", "6.8.0-45-generic", "kernel: image has '6.1.0', host has '6.8.0-45-generic'", False),
    ("criu", "4.2.1", "4.1", "criu: image has '4.2.1', host has '4.1'", True),
    ("criu", "4.2.1", "4.3", "criu: image has '4.2.1', host has '4.3'", False),
    ("criu", "4.2.1", "4.2.1-dirty", "criu: image has '4.2.1', host has '4.2.1-dirty'", True),
])
def test_each_fact_names_its_line_and_its_verdict(field: str, recorded: str, current: str | None, line: str,
                                                  fatal: bool) -> None:
    differences = compare_facts(host_facts(**{field: recorded}), host_facts(**{field: current}), engine="cpu",
                                cuda=False)
    assert lines(differences) == [(line, fatal)]
    assert differences[0].why  # docs/image-format.md explains each; the warning line carries it


def test_vllm_packages_driver_and_gpu_facts() -> None:
    recorded = host_facts(vllm="0.26.0", driver="570.86", cuda="12.8", gpus=[GPU],
                          packages={"transformers": "4.57.0", "triton": "3.4.0"})
    current = host_facts(vllm="0.32.0", driver="575.10", cuda="12.9",
                         gpus=[{**GPU, "name": "NVIDIA H100 80GB HBM3"}], packages={"transformers": "4.57.1"})
    assert lines(compare_facts(recorded, current, engine="vllm", cuda=True)) == [
        ("vllm: image has '0.26.0', host has '0.32.0'", True),
        ("package transformers: image has '4.57.0', host has '4.57.1'", True),
        ("package triton: image has '3.4.0', host has 'None'", True),
        ("NVIDIA driver: image has '570.86', host has '575.10'", True),
        ("CUDA driver API: image has '12.8', host has '12.9'", True),
        ("GPU model: image has 'NVIDIA H200', host has 'NVIDIA H100 80GB HBM3'", True),
    ]
    # the vLLM CPU backend and the cpu engine have no GPU state: driver and GPU are not compared
    assert lines(compare_facts(recorded, current.model_copy(update={"vllm": "0.26.0", "packages":
                                                                    recorded.packages}), engine="vllm",
                               cuda=False)) == []
    no_gpu = compare_facts(recorded, host_facts(vllm="0.26.0", driver="570.86", cuda="12.8",
                                                packages=recorded.packages), engine="vllm", cuda=True)
    assert lines(no_gpu) == [("GPU model: image has 'NVIDIA H200', host has 'none'", True)]


def test_a_host_without_criu_leaves_the_version_to_the_criu_check() -> None:
    assert compare_facts(host_facts(), host_facts(criu=""), engine="cpu", cuda=False) == []


def dependency(path: Path) -> Dependency:
    import hashlib

    data = path.read_bytes()
    return Dependency(path=str(path), size=len(data), sha256=hashlib.sha256(data).hexdigest())


@pytest.fixture()
def deps(tmp_path: Path) -> list[Path]:
    lib = tmp_path / "lib"
    lib.mkdir(mode=0o755)
    files = []
    for name, data in (("libtorch.so", b"t" * 4096), ("model.safetensors", b"w" * 100), ("gone.so", b"g")):
        (lib / name).write_bytes(data)
        os.chmod(lib / name, 0o644)
        files.append(lib / name)
    return files


def test_every_fatal_difference_is_named_at_once_fatal_first(tmp_path: Path, deps: list[Path]) -> None:
    recorded = [dependency(p) for p in deps]
    deps[0].write_bytes(b"t" * 4000)           # another size
    deps[1].write_bytes(b"W" * 100)            # same size, other content: only its sha256 tells
    deps[2].unlink()                           # missing
    image = manifest(host=host_facts(torch="2.12.0", kernel="5.15.0"), dependencies=recorded)
    differences = host_differences(image, host_facts(), hash_files=True, cache_root=tmp_path / "verified")
    assert lines(differences) == [
        ("torch: image has '2.12.0', host has '2.13.0+cpu'", True),
        (f"file {deps[0]}: image has '4096 bytes', host has '4000 bytes'", True),
        (f"file {deps[1]}: image has 'sha256 {recorded[1].sha256[:12]}', host has 'sha256 "
         f"{dependency(deps[1]).sha256[:12]}'", True),
        (f"file {deps[2]}: image has '1 bytes', host has 'missing'", True),
        ("kernel: image has '5.15.0', host has '6.1.0'", False),
    ]
    with pytest.raises(ImageHostMismatch) as error:
        require_host_matches(image, host_facts(), cache_root=tmp_path / "verified")
    message = error.value.message
    assert message.splitlines()[0] == "image does not fit this host in 4 facts:"
    assert message.splitlines()[1:] == [f"  {line}" for line, fatal in lines(differences) if fatal]
    assert error.value.exit_code == 4
    assert [m["fact"] for m in error.value.to_dict()["mismatches"]] == ["torch"] + [f"file {p}" for p in deps]


def test_facts_read_in_another_thread_are_waited_for_after_the_files(tmp_path: Path, deps: list[Path]) -> None:
    """A restore reads the host's facts beside the host check: the check compares the files first,
    then waits for the facts (a Future), and refuses on both kinds of difference as it does otherwise."""
    from concurrent.futures import Future

    image = manifest(host=host_facts(torch="2.12.0"), dependencies=[dependency(p) for p in deps])
    deps[0].write_bytes(b"t" * 4000)
    order: list[str] = []

    class Facts(Future):  # already read; says when the check asks for them
        def result(self, timeout: float | None = None) -> object:
            order.append("facts awaited")
            return super().result(timeout)

    ready = Facts()
    ready.set_result(host_facts())
    real = compat.dependency_mismatches

    def files(*args: object, **kwargs: object) -> list[tuple[str, str, str]]:
        order.append("files compared")
        return real(*args, **kwargs)  # type: ignore[arg-type]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(compat, "dependency_mismatches", files)
        differences = host_differences(image, ready, hash_files=True, cache_root=tmp_path / "verified")
    assert order == ["files compared", "facts awaited"]
    assert lines(differences)[:2] == [("torch: image has '2.12.0', host has '2.13.0+cpu'", True),
                                      (f"file {deps[0]}: image has '4096 bytes', host has '4000 bytes'", True)]
    failed: Future = Future()
    failed.set_exception(OSError("the facts could not be read"))
    with pytest.raises(OSError, match="could not be read"):  # the facts' failure is the check's
        require_host_matches(image, failed, cache_root=tmp_path / "verified")


def test_warnings_alone_do_not_refuse(tmp_path: Path) -> None:
    image = manifest(host=host_facts(kernel="5.15.0", vsnap="0.1.9"))
    warnings = require_host_matches(image, host_facts(), cache_root=tmp_path)
    assert lines(warnings) == [("vsnap: image has '0.1.9', host has '0.2.0'", False),
                               ("kernel: image has '5.15.0', host has '6.1.0'", False)]


def test_one_mismatch_is_one_error_line() -> None:
    error = ImageHostMismatch([("torch", "2.12.0", "2.13.0")])
    assert error.message == "image does not fit this host: torch: image has '2.12.0', host has '2.13.0'"


def test_a_hostile_recorded_value_cannot_forge_lines_or_drive_the_terminal() -> None:
    error = ImageHostMismatch([("kernel", "6.1\n  torch: image has 'fine'\x1b[2J", "6.8"), ("arch", "a", "b")])
    out = io.StringIO()
    console = _render.CleanConsole(file=out, width=200, color_system=None, highlight=False, soft_wrap=True)
    previous = _render.stderr
    _render.stderr = console
    try:
        _render.print_error(error, False)
    finally:
        _render.stderr = previous
    text = out.getvalue()
    assert "\x1b" not in text
    assert [line for line in text.splitlines() if line.startswith("  ")] == [
        "  kernel: image has \"6.1\\n  torch: image has 'fine'\\x1b[2J\", host has '6.8'",
        "  arch: image has 'a', host has 'b'"]


@pytest.mark.usefixtures("settled_at_once")
def test_dependencies_are_hashed_once_until_they_change(tmp_path: Path, deps: list[Path],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from vsnap.image import store as _image

    recorded = [dependency(p) for p in deps[:2]]
    cache = tmp_path / "verified"
    hashed: list[str] = []
    real = _image.sha256_file
    monkeypatch.setattr(_image, "sha256_file", lambda p: (hashed.append(Path(p).name), real(p))[1])
    assert compat.dependency_mismatches(recorded, hash_files=True, cache_root=cache) == []
    assert sorted(hashed) == ["libtorch.so", "model.safetensors"]
    hashed.clear()
    assert compat.dependency_mismatches(recorded, hash_files=True, cache_root=cache) == []
    assert hashed == []  # remembered by identity: not read again
    assert compat.dependency_mismatches(recorded, hash_files=True, cache_root=cache, rehash=True) == []
    assert sorted(hashed) == ["libtorch.so", "model.safetensors"]  # validate reads everything
    hashed.clear()
    deps[1].write_bytes(b"W" * 100)  # rewritten in place, same size: its ctime moved
    assert len(compat.dependency_mismatches(recorded, hash_files=True, cache_root=cache)) == 1
    assert hashed == ["model.safetensors"]
    hashed.clear()
    assert len(compat.dependency_mismatches(recorded, hash_files=True, cache_root=cache)) == 1
    assert hashed == ["model.safetensors"]  # a mismatch is never remembered
    assert compat.dependency_mismatches(recorded, hash_files=False) == []  # sizes alone cannot tell


@pytest.mark.usefixtures("settled_at_once")
def test_a_dependency_record_others_could_write_is_ignored(tmp_path: Path, deps: list[Path]) -> None:
    cache = tmp_path / "verified"
    _verified.remember_dependencies({str(deps[0]): (os.stat(deps[0]), "0" * 64)}, cache)
    assert str(deps[0]) in _verified.load_dependencies(cache)
    os.chmod(cache / _verified.DEPENDENCIES, 0o666)
    assert _verified.load_dependencies(cache) == {}
    os.chmod(cache / _verified.DEPENDENCIES, 0o600)
    os.chmod(deps[0], 0o664)  # a group-writable file is never remembered
    _verified.remember_dependencies({str(deps[0]): (os.stat(deps[0]), "0" * 64)}, cache)
    assert str(deps[0]) not in _verified.load_dependencies(cache)


def test_old_manifests_without_packages_still_read() -> None:
    from vsnap.image.manifest import HostFacts

    facts = HostFacts.model_validate_json('{"hostname": "h", "kernel": "k", "arch": "a", "criu": "4.2", '
                                          '"python": "3.11", "vsnap": "0.2.0"}')
    assert facts.packages == {}
    assert manifest().origin == "captured"


def test_a_failed_restore_names_the_differences_that_did_not_stop_it() -> None:
    from vsnap.ops.restore import _note_host_differences
    from vsnap.protocol.errors import CriuError

    differences = [HostDifference("kernel", "5.15.0", "6.1.0", False, "why"),
                   HostDifference("criu", "4.2.1", "4.3", False, "why")]
    error = CriuError("restore", 1, "/x/restore.log", "Error (criu/x.c:1): something", hint="read the log")
    assert _note_host_differences(differences)(type(error), error, None) is False  # the error goes on
    assert error.hint == ("read the log; this host differs from the capturing one in kernel, criu "
                          "(not refused; vsnap validate IMAGE lists each)")
    untouched = CriuError("restore", 1, "/x/restore.log", "", hint="read the log")
    _note_host_differences([])(type(untouched), untouched, None)
    assert untouched.hint == "read the log"


def test_a_tensor_parallel_image_needs_a_gpu_of_its_model_per_rank() -> None:
    two = [GPU, {**GPU, "index": 1, "uuid": "GPU-bbbbbbbb-bbbb-bbbb-bbbb-bbbbbbbbbbbb"}]
    image = manifest(engine="vllm", cuda_processes=3, tensor_parallel_size=2, gpu_uuids=["GPU-aaaaaaaa-aaaa-aaaa-aaaa-aaaaaaaaaaaa", "GPU-bbbbbbbb-bbbb-bbbb-bbbb-bbbbbbbbbbbb"],
                     host=host_facts(driver="580", cuda="13.0", gpus=two, vllm="0.26.0"))
    here = host_facts(driver="580", cuda="13.0", vllm="0.26.0")
    assert lines(host_differences(image, here.model_copy(update={"gpus": two}))) == []
    assert lines(host_differences(image, here.model_copy(update={"gpus": [GPU]}))) == [
        ("GPU count: image has '2 x NVIDIA H200', host has '1 x NVIDIA H200'", True)]
    one = manifest(engine="vllm", cuda_processes=2, host=host_facts(driver="580", cuda="13.0", gpus=[GPU],
                                                                    vllm="0.26.0"))
    assert lines(host_differences(one, here.model_copy(update={"gpus": [GPU]}))) == []  # one rank: as before


def test_criu_check_is_asked_once_per_boot_and_binary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`criu check` was 0.04 to 0.07 s of every restore's verify phase; its verdict is kept for the
    boot, the kernel and the binary it was asked of, and only in a directory of root's alone."""
    from vsnap.host import facts as _host
    from vsnap.host import proctree as _proctree
    from vsnap.host.criu.runner import CriuRunner

    binary = tmp_path / "criu"
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    monkeypatch.setattr(CriuRunner, "locate", classmethod(lambda cls: cls(binary)))
    asked: list[int] = []
    monkeypatch.setattr(_host, "check_criu", lambda: asked.append(1) or f"criu check passed ({len(asked)})")
    cache = tmp_path / "verified"
    assert _host.check_criu_this_boot(cache) == "criu check passed (1)"
    assert _host.check_criu_this_boot(cache) == "criu check passed (1)" and len(asked) == 1
    binary.write_text("#!/bin/sh\n# another build\n")  # a new CRIU: asked again
    assert _host.check_criu_this_boot(cache) == "criu check passed (2)"
    monkeypatch.setattr(_proctree, "_boot_ids", ["another-boot"])  # a reboot: asked again
    assert _host.check_criu_this_boot(cache) == "criu check passed (3)"
    assert _host.check_criu_this_boot(cache) == "criu check passed (3)"
    os.chmod(cache, 0o777)  # a record others could have written is no record
    assert _host.check_criu_this_boot(cache) == "criu check passed (4)"
    os.chmod(cache, 0o700)
    binary.chmod(0o777)  # a binary anyone may replace: never remembered
    assert _host.check_criu_this_boot(cache) == "criu check passed (5)"
    assert _host.check_criu_this_boot(cache) == "criu check passed (6)"
    monkeypatch.setattr(_host, "check_criu", lambda: (_ for _ in ()).throw(_host.HostNotReady("criu", "failed")))
    binary.chmod(0o755)
    with pytest.raises(_host.HostNotReady):  # a failure is never remembered
        _host.check_criu_this_boot(tmp_path / "other")
    with pytest.raises(_host.HostNotReady):
        _host.check_criu_this_boot(tmp_path / "other")
