from pathlib import Path

from vsnap.host.criu.options import DumpOptions, RestoreOptions, external_mounts
from vsnap.host.criu.runner import excerpt_errors, hint_for, parse_version
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
    assert argv[0] == "dump" and argv[argv.index("--tree") + 1] == "42"
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
    from vsnap.host.criu.options import LazyPagesOptions, RestoreOptions

    restore = RestoreOptions(images_dir=tmp_path / "criu", work_dir=tmp_path / "w", log_file=tmp_path / "w/r.log",
                             pidfile=tmp_path / "w/pid", lazy_pages=True)
    server = LazyPagesOptions(images_dir=tmp_path / "criu", work_dir=tmp_path / "w", log_file=tmp_path / "w/l.log")
    assert "--lazy-pages" in restore.to_argv()
    assert "--lazy-pages" not in RestoreOptions(tmp_path, tmp_path, tmp_path / "l", tmp_path / "p").to_argv()
    assert server.to_argv()[:1] == ["lazy-pages"] and server.socket == tmp_path / "w" / "lazy-pages.socket"


def test_a_page_server_that_dies_at_start_is_an_error_naming_its_log(tmp_path: Path) -> None:
    import pytest

    from vsnap.host.criu.options import LazyPagesOptions
    from vsnap.host.criu.runner import CriuRunner, LazyPagesServer
    from vsnap.protocol.errors import CriuError

    fake = tmp_path / "criu"
    fake.write_text("#!/bin/sh\nwhile [ \"$1\" != --log-file ]; do shift; done\n"
                    "echo 'Error (criu/uffd.c:1): uffd: no userfaultfd here' > \"$2\"\nexit 1\n")
    fake.chmod(0o755)
    options = LazyPagesOptions(images_dir=tmp_path, work_dir=tmp_path, log_file=tmp_path / "lazy-pages.log")
    with pytest.raises(CriuError, match="criu lazy-pages failed: .*no userfaultfd here") as failure:
        LazyPagesServer(CriuRunner(fake), options)
    assert "uffd-noncoop" in failure.value.hint and str(options.log_file) in str(failure.value.log_path)


# --- nothing but vsnap's argv decides what CRIU does ------------------------------------------


def every_argv(tmp_path: Path) -> dict[str, list[str]]:
    from vsnap.host.criu.options import LazyPagesOptions, check_argv, version_argv

    return {
        "dump": DumpOptions(pid=42, images_dir=tmp_path, log_file=tmp_path / "d.log", leave_running=True,
                            externals={"m0": "/dev"}, external_netns=(1, "net0")).to_argv(),
        "restore": RestoreOptions(images_dir=tmp_path, work_dir=tmp_path, log_file=tmp_path / "r.log",
                                  pidfile=tmp_path / "pid", externals={"m0": "/dev"}, inherit_fds={5: "net0"},
                                  lazy_pages=True).to_argv(),
        "lazy-pages": LazyPagesOptions(images_dir=tmp_path, work_dir=tmp_path, log_file=tmp_path / "l.log").to_argv(),
        "check": check_argv(),
        "check --feature": check_argv("uffd-noncoop"),
        "--version": version_argv(),
    }


def test_every_argv_has_no_default_config(tmp_path: Path) -> None:
    for name, argv in every_argv(tmp_path).items():
        assert argv.count("--no-default-config") == 1, name
    assert every_argv(tmp_path)["check --feature"] == ["check", "--no-default-config", "--feature", "uffd-noncoop"]


def test_criu_environment_drops_criu_variables(monkeypatch) -> None:
    from vsnap.host.criu.runner import criu_environment

    monkeypatch.setenv("CRIU_CONFIG_FILE", "/tmp/hostile.conf")  # read even with --no-default-config
    monkeypatch.setenv("CRIU_LIBS_DIR", "/tmp/plugins")  # plugins CRIU would load as root
    monkeypatch.setenv("PATH_KEPT", "yes")
    env = criu_environment()
    assert not any(key.startswith("CRIU_") for key in env) and env["PATH_KEPT"] == "yes"


def test_every_criu_run_gets_the_flag_and_the_clean_environment(tmp_path: Path, monkeypatch) -> None:
    """Every way the runner starts CRIU (version, check, check --feature, dump, restore, lazy-pages)."""
    import subprocess

    from vsnap.host.criu import runner as _criu
    from vsnap.host.criu.options import LazyPagesOptions

    monkeypatch.setenv("CRIU_CONFIG_FILE", "/tmp/hostile.conf")
    runs: list[tuple[list[str], dict]] = []

    class Done:
        returncode, stdout, stderr = 0, "Version: 4.2.1\n", ""

        def poll(self):
            return 0

        def wait(self, timeout=None):
            return 0

    def fake(argv, **kwargs):
        runs.append((list(argv), kwargs.get("env")))
        if argv[1] == "restore":
            Path(argv[argv.index("--pidfile") + 1]).write_text("7\n")
        if argv[1] == "lazy-pages":
            (tmp_path / "lazy-pages.socket").touch()
        return Done()

    monkeypatch.setattr(subprocess, "run", fake)
    monkeypatch.setattr(subprocess, "Popen", fake)
    runner = _criu.CriuRunner(Path("/usr/bin/criu-fake"))
    runner.version()
    runner.check()
    runner.check_feature("uffd-noncoop")
    runner.dump(DumpOptions(pid=42, images_dir=tmp_path, log_file=tmp_path / "d.log"))
    assert runner.restore(RestoreOptions(images_dir=tmp_path, work_dir=tmp_path, log_file=tmp_path / "r.log",
                                         pidfile=tmp_path / "pid")) == 7
    assert not (tmp_path / "pid").exists()  # read once, then gone
    runner.start_lazy_pages(LazyPagesOptions(images_dir=tmp_path, work_dir=tmp_path, log_file=tmp_path / "l.log"))
    assert len(runs) == 6
    for argv, env in runs:
        assert "--no-default-config" in argv, argv
        assert env is not None and "CRIU_CONFIG_FILE" not in env, argv


def test_a_low_open_files_limit_is_named_not_taken_for_a_missing_privilege() -> None:
    """Hostile pass 14: under `ulimit -n 64` CRIU's restore fails choosing its service descriptors,
    and its log also says "Operation not permitted" (it cannot raise RLIMIT_NOFILE)."""
    excerpt = ("Error (criu/util.c:1534): rlimit: Can't setup RLIMIT_NOFILE for self: Operation not permitted\n"
               "Error (criu/util.c:620): sfd: Can't chose service_fd_base: 0 45")
    assert hint_for(excerpt).startswith("the open-files limit is too low for CRIU")
    assert hint_for("Error (criu/cr-restore.c:1): Operation not permitted") == "CRIU needs root (CAP_SYS_ADMIN)"
