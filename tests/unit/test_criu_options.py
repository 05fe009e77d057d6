from pathlib import Path

from vsnap._criu import excerpt_errors, hint_for, parse_version
from vsnap._criu_options import DumpOptions, RestoreOptions, external_mounts
from vsnap.protocol.errors import CriuError

MOUNTINFO = """\
22 27 0:21 / /proc rw,relatime - proc proc rw
24 27 0:6 / /dev rw,relatime - devtmpfs devtmpfs rw
25 24 0:23 / /dev/shm rw,relatime - tmpfs tmpfs rw
27 1 254:0 / / rw,relatime - ext4 /dev/vda rw
30 25 0:27 / /dev/shm rw,relatime - tmpfs tmpfs rw
31 27 0:28 / /my\\040dir rw - tmpfs tmpfs rw
"""


def test_external_mounts_skip_own_and_duplicates() -> None:
    assert external_mounts(MOUNTINFO) == {"m0": "/dev", "m1": "/dev/shm", "m2": "/my dir"}


def test_dump_argv() -> None:
    argv = DumpOptions(pid=42, images_dir=Path("/img"), log_file=Path("/img/dump.log"),
                       externals={"m0": "/dev"}).to_argv()
    assert argv[:3] == ["dump", "--tree", "42"]
    for flag in ("--link-remap", "--file-locks", "--tcp-established"):
        assert flag in argv
    assert argv[argv.index("--network-lock") + 1] == "skip"
    assert argv[argv.index("--ghost-limit") + 1] == "512M"
    assert argv[-2:] == ["--external", "mnt[/dev]:m0"]
    assert "--leave-running" not in argv
    with_netns = DumpOptions(pid=42, images_dir=Path("/img"), log_file=Path("/l"), external_netns=(4026532345, "net0"))
    assert with_netns.to_argv()[-2:] == ["--external", "net[4026532345]:net0"]


def test_restore_argv() -> None:
    argv = RestoreOptions(images_dir=Path("/img"), work_dir=Path("/ctl"), log_file=Path("/ctl/r.log"),
                          pidfile=Path("/ctl/pid"), externals={"m0": "/dev"}, inherit_fds={5: "net0"}).to_argv()
    assert argv[0] == "restore"
    assert "--restore-detached" in argv
    assert argv[argv.index("--work-dir") + 1] == "/ctl"
    assert argv[argv.index("--pidfile") + 1] == "/ctl/pid"
    assert argv[argv.index("--root") + 1] == "/"
    assert argv[-4:] == ["--external", "mnt[m0]:/dev", "--inherit-fd", "fd[5]:net0"]


def test_parse_version() -> None:
    assert parse_version("Version: 4.2.1\nGitID: v4.2.1\n") == (4, 2, 1)
    assert parse_version("Version: 3.17\n") == (3, 17)
    assert parse_version("nonsense") is None


def test_error_excerpt_and_hint(tmp_path: Path) -> None:
    log = tmp_path / "restore.log"
    log.write_text(
        "(00.01) Error (criu/util.c:1534): rlimit: Can't setup RLIMIT_NOFILE for self: Operation not permitted\n"
        "(00.02) 1: restoring\n"
        "(00.03) 1: Error (criu/cr-restore.c:1480): Can't fork for 7: File exists\n"
        "(00.04) Error (criu/cr-restore.c:2331): Restoring FAILED.\n")
    excerpt = excerpt_errors(log)
    error = CriuError("restore", 1, log, excerpt, hint_for(excerpt))
    assert error.message == "criu restore failed: Can't fork for 7: File exists"
    assert "holds that PID" in error.hint
    assert error.exit_code == 5


def test_lazy_restore_and_its_page_server_share_the_work_dir(tmp_path: Path) -> None:
    from vsnap._criu_options import LazyPagesOptions, RestoreOptions

    restore = RestoreOptions(images_dir=tmp_path / "criu", work_dir=tmp_path / "w", log_file=tmp_path / "w/r.log",
                             pidfile=tmp_path / "w/pid", lazy_pages=True)
    server = LazyPagesOptions(images_dir=tmp_path / "criu", work_dir=tmp_path / "w", log_file=tmp_path / "w/l.log")
    assert "--lazy-pages" in restore.to_argv()
    assert "--lazy-pages" not in RestoreOptions(tmp_path, tmp_path, tmp_path / "l", tmp_path / "p").to_argv()
    assert server.to_argv()[:1] == ["lazy-pages"] and server.socket == tmp_path / "w" / "lazy-pages.socket"


def test_a_page_server_that_dies_at_start_is_an_error_naming_its_log(tmp_path: Path) -> None:
    import pytest

    from vsnap._criu import CriuRunner, LazyPagesServer
    from vsnap._criu_options import LazyPagesOptions
    from vsnap.protocol.errors import CriuError

    fake = tmp_path / "criu"
    fake.write_text("#!/bin/sh\necho 'Error (criu/uffd.c:1): uffd: no userfaultfd here' > \"$7\"\nexit 1\n")
    fake.chmod(0o755)
    options = LazyPagesOptions(images_dir=tmp_path, work_dir=tmp_path, log_file=tmp_path / "lazy-pages.log")
    with pytest.raises(CriuError, match="criu lazy-pages failed: .*no userfaultfd here") as failure:
        LazyPagesServer(CriuRunner(fake), options)
    assert "uffd-noncoop" in failure.value.hint and str(options.log_file) in str(failure.value.log_path)
