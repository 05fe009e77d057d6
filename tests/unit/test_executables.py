"""Root runs only what root owns (issue 26, item 4): every program vsnap starts is resolved once to
an absolute path whose file and directories are root's alone, or refused in one line naming it.
And (a leftover of the same pass) a CRIU killed by a signal is told so, not that it "needs root"."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from vsnap.host import executables
from vsnap.host.criu.runner import CriuRunner, hint_for
from vsnap.host.executables import resolve_executable
from vsnap.host.proctree import find_unshare
from vsnap.protocol.errors import HostNotReady

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="ownership checks need root (to chown a file away)")


def fake_program(directory: Path, name: str, marker: Path) -> Path:
    """An executable that leaves ``marker`` behind if it is ever run."""
    directory.mkdir(mode=0o755, exist_ok=True)
    program = directory / name
    program.write_text(f"#!/bin/sh\ntouch {marker}\necho 'Version: 9.9'\n")
    program.chmod(0o755)
    return program


@pytest.fixture(autouse=True)
def _fresh(monkeypatch: pytest.MonkeyPatch) -> None:
    executables.forget_resolved()
    monkeypatch.delenv("VSNAP_CRIU", raising=False)


def _refused(exc: HostNotReady, program: Path) -> None:
    text = f"{exc.message} {exc.hint}"
    assert str(program) in exc.message and "\n" not in text
    assert "root" in exc.hint


def test_a_criu_of_another_user_first_on_path_is_refused_and_never_run(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    marker = tmp_path / "ran"
    criu = fake_program(tmp_path / "bin", "criu", marker)
    os.chown(criu, 65534, 65534)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    with pytest.raises(HostNotReady) as caught:
        CriuRunner.locate().require_version()
    _refused(caught.value, criu)
    assert "uid 65534" in caught.value.message
    assert not marker.exists()


def test_a_group_writable_criu_or_directory_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    marker = tmp_path / "ran"
    criu = fake_program(tmp_path / "bin", "criu", marker)
    criu.chmod(0o775)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    with pytest.raises(HostNotReady) as caught:
        CriuRunner.locate()
    _refused(caught.value, criu)
    assert "0775" in caught.value.message
    criu.chmod(0o755)
    (tmp_path / "bin").chmod(0o777)  # the directory: anyone could swap the program
    executables.forget_resolved()
    with pytest.raises(HostNotReady) as caught:
        CriuRunner.locate()
    assert str(tmp_path / "bin") in caught.value.message
    assert not marker.exists()


def test_vsnap_criu_is_checked_the_same_way(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    marker = tmp_path / "ran"
    criu = fake_program(tmp_path / "elsewhere", "criu-4.2", marker)
    os.chown(criu, 65534, 65534)
    monkeypatch.setenv("VSNAP_CRIU", str(criu))
    with pytest.raises(HostNotReady) as caught:
        CriuRunner.locate()
    _refused(caught.value, criu)
    assert "VSNAP_CRIU" in caught.value.message
    os.chown(criu, 0, 0)
    executables.forget_resolved()
    assert CriuRunner.locate().binary == criu
    assert not marker.exists()


def test_a_relative_path_entry_is_skipped_and_the_result_is_absolute(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    marker = tmp_path / "ran"
    fake_program(tmp_path, "unshare", marker)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", f".::{os.environ['PATH']}")
    found = find_unshare()
    assert os.path.isabs(found) and Path(found).parent != tmp_path


def test_a_root_owned_program_is_resolved_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    program = fake_program(tmp_path / "bin", "tool", tmp_path / "ran")
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    assert resolve_executable("tool") == program
    os.chown(program, 65534, 65534)  # only root could do this; the first answer stands in this process
    assert resolve_executable("tool") == program
    with pytest.raises(HostNotReady, match="not installed"):
        resolve_executable("no-such-tool-here")


def test_a_criu_killed_by_a_signal_is_not_told_it_needs_root() -> None:
    """Leftover of hostile pass 12: an OOM-killed restore's log ended in a line the table read as
    "CRIU needs root"."""
    excerpt = "Error (criu/cr-restore.c:1234): Can't open /proc/1/ns: Permission denied"
    assert hint_for(excerpt, 1) == "CRIU needs root (CAP_SYS_ADMIN)"
    killed = hint_for(excerpt, -9)
    assert "SIGKILL" in killed and "OOM" in killed and "dmesg" in killed and "needs root" not in killed
    assert "SIGSEGV" in hint_for("", -11)
    task_killed = ("Error (criu/cr-restore.c:1480): 4242 killed by signal 9: Killed\n"
                   "Error (criu/files.c:90): Can't open fd: Permission denied")
    assert "OOM" in hint_for(task_killed, 1) and "needs root" not in hint_for(task_killed, 1)


def test_a_criu_killed_by_a_signal_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The error line names the signal, not the last line of CRIU's log."""
    from vsnap.host.criu.options import RestoreOptions
    from vsnap.protocol.errors import CriuError

    criu = tmp_path / "criu"
    criu.write_text("#!/bin/sh\necho 'Error (criu/files.c:1): Permission denied' > \"$LOG\"\nkill -9 $$\n")
    criu.chmod(0o755)
    log = tmp_path / "restore.log"
    options = RestoreOptions(images_dir=tmp_path, work_dir=tmp_path, log_file=log, pidfile=tmp_path / "p.pid",
                             externals={}, inherit_fds={}, lazy_pages=False)
    monkeypatch.setenv("LOG", str(log))
    with pytest.raises(CriuError) as caught:
        CriuRunner(criu).restore(options)
    assert caught.value.message == "criu restore failed: criu itself was killed by SIGKILL"
    assert "OOM" in caught.value.hint and "needs root" not in caught.value.hint
