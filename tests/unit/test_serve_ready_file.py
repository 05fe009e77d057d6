"""`vsnap serve --ready-file`: a stale file of a killed vsnap serve is removed at the start, and
nothing vsnap serve did not write is ever removed (hostile pass 14)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from vsnap.host.instances import this_process
from vsnap.ops.serve import ReadyFile
from vsnap.protocol.errors import ControlProtocolError

URL = "http://127.0.0.1:8000"


def private_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "probe"
    directory.mkdir(mode=0o700)
    return directory


def written_by_a_dead_serve(path: Path) -> None:
    """What a vsnap serve that was SIGKILLed leaves: its ready file, naming a process that is gone."""
    subprocess.run([sys.executable, "-c", "import sys; from vsnap.ops.serve import ReadyFile; "
                    "ReadyFile.claim(sys.argv[1]).write(sys.argv[2])", str(path), URL], check=True)


def test_a_stale_ready_file_of_a_vsnap_serve_is_removed_at_the_start(tmp_path: Path) -> None:
    path = private_dir(tmp_path) / "ready"
    written_by_a_dead_serve(path)
    assert path.read_text().splitlines()[0] == URL
    ready = ReadyFile.claim(path)
    assert not path.exists()  # the probe fails until this boot is ready
    ready.write(URL)
    me = this_process()
    assert path.read_text() == f"{URL}\nvsnap-serve-ready {me.pid} {me.start_time} {me.boot_id}\n"
    assert os.stat(path).st_mode & 0o777 == 0o600
    ready.remove()
    assert not path.exists()
    ready.remove()  # twice: nothing to do


def test_the_ready_file_of_a_running_serve_is_refused(tmp_path: Path) -> None:
    path = private_dir(tmp_path) / "ready"
    ReadyFile.claim(path).write(URL)  # this process is the running serve
    with pytest.raises(ControlProtocolError) as refused:
        ReadyFile.claim(path)
    assert refused.value.message == f"{path}: the ready file of a running vsnap serve (pid {os.getpid()}); left as it is"
    assert refused.value.hint == "give each vsnap serve its own --ready-file" and refused.value.exit_code == 8
    assert path.exists()


@pytest.mark.parametrize("text", ["important\n", f"{URL}\n", f"{URL}\nvsnap-serve-ready 1 2\n",
                                  f"{URL}\nvsnap-serve-ready 1 2 b\nmore\n", "ftp://x\nvsnap-serve-ready 1 2 b\n"])
def test_a_file_vsnap_serve_did_not_write_is_refused_and_kept(tmp_path: Path, text: str) -> None:
    path = private_dir(tmp_path) / "ready"
    path.write_text(text)
    os.chmod(path, 0o600)
    with pytest.raises(ControlProtocolError, match="not a ready file vsnap serve wrote; left as it is") as refused:
        ReadyFile.claim(path)
    assert str(path) in refused.value.message and "--ready-file" in refused.value.hint
    assert path.read_text() == text
    ReadyFile(path.parent, path.name).remove()  # nor at the stop
    assert path.read_text() == text


def test_never_through_a_link_nor_what_another_user_could_have_written(tmp_path: Path) -> None:
    directory = private_dir(tmp_path)
    victim = tmp_path / "victim"
    written_by_a_dead_serve(victim)
    (directory / "ready").symlink_to(victim)
    with pytest.raises(ControlProtocolError, match="without following a link"):
        ReadyFile.claim(directory / "ready")
    assert victim.exists() and (directory / "ready").is_symlink()

    (directory / "ready").unlink()
    os.link(victim, directory / "ready")  # a second name of a file elsewhere
    with pytest.raises(ControlProtocolError, match="one link"):
        ReadyFile.claim(directory / "ready")
    assert victim.exists()

    (directory / "ready").unlink()
    written_by_a_dead_serve(directory / "ready")
    os.chown(directory / "ready", 65534, 65534)  # not root's
    with pytest.raises(ControlProtocolError, match="private regular file of root's"):
        ReadyFile.claim(directory / "ready")
    assert (directory / "ready").exists()

    (directory / "ready").unlink()
    (directory / "ready").mkdir()
    with pytest.raises(ControlProtocolError, match="private regular file of root's"):
        ReadyFile.claim(directory / "ready")
    assert (directory / "ready").is_dir()


@pytest.mark.parametrize("fields", ["\u00b2 1 {boot}", "1 \u0663 {boot}", "0 1 {boot}", "99999999999999999999 1 {boot}",
                                    "1 0 {boot}", "1 2 b", "1 2 {boot}\u0000", "+1 2 {boot}", "1 2 {BOOT}"])
def test_a_ready_file_whose_writer_is_no_process_is_refused_not_a_traceback(tmp_path: Path, fields: str) -> None:
    """'²'.isdigit() is true and int('²') a ValueError: a traceback at the start of vsnap serve; a
    pid of 0 or past pid_max named no process and was removed as a dead writer's. Hostile pass h1."""
    boot = this_process().boot_id
    path = private_dir(tmp_path) / "ready"
    text = f"{URL}\nvsnap-serve-ready {fields.format(boot=boot, BOOT=boot.upper())}\n"
    path.write_text(text)
    os.chmod(path, 0o600)
    with pytest.raises(ControlProtocolError, match="not a ready file vsnap serve wrote; left as it is"):
        ReadyFile.claim(path)
    assert path.read_text() == text


def test_the_root_directory_is_refused_as_a_ready_file_at_once() -> None:
    """`--ready-file /` has no file name: it was taken as absent, and writing it once the server
    served raised a bare OSError (a traceback). Hostile pass h1."""
    with pytest.raises(ControlProtocolError, match="is a directory, not a file path for the ready file"):
        ReadyFile.claim(Path("/"))
