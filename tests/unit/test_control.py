import os
from pathlib import Path

import pytest

from vsnap.protocol import control as control
from vsnap.protocol.control import Activation, Status
from vsnap.protocol.errors import ControlProtocolError, PhaseTimeout


@pytest.fixture
def ctl(tmp_path: Path) -> Path:
    return control.ensure_private_dir(tmp_path / "ctl")


def test_roundtrip_is_atomic_and_private(ctl: Path) -> None:
    control.write_message(ctl, control.ACTIVATION, Activation(host="127.0.0.1", port=8000, **control.stamp()))
    assert control.read_message(ctl, control.ACTIVATION, Activation) == \
        Activation(host="127.0.0.1", port=8000, **control.stamp())
    assert (ctl / control.ACTIVATION).stat().st_mode & 0o777 == 0o600
    assert [p.name for p in ctl.iterdir()] == [control.ACTIVATION]  # no temp file left
    assert control.read_message(ctl, control.STATUS, Status) is None


def test_symlinked_control_file_refused(ctl: Path, tmp_path: Path) -> None:
    (tmp_path / "elsewhere.json").write_text('{"host": "0.0.0.0", "port": 1}')
    os.symlink(tmp_path / "elsewhere.json", ctl / control.ACTIVATION)
    with pytest.raises(ControlProtocolError, match="is a symlink"):
        control.read_message(ctl, control.ACTIVATION, Activation)


def test_write_does_not_follow_symlink(ctl: Path, tmp_path: Path) -> None:
    target = tmp_path / "victim"
    target.write_text("keep")
    os.symlink(target, ctl / control.STATUS)
    control.write_message(ctl, control.STATUS, Status(state="validated"))
    assert target.read_text() == "keep"
    assert not (ctl / control.STATUS).is_symlink()


def test_file_others_could_write_refused(ctl: Path) -> None:
    path = ctl / control.ACTIVATION
    path.write_text('{"host": "127.0.0.1", "port": 1}')
    os.chmod(path, 0o666)
    with pytest.raises(ControlProtocolError, match="others could have written it"):
        control.read_message(ctl, control.ACTIVATION, Activation)


def test_file_of_another_user_refused(ctl: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("chown to another user needs root")
    path = ctl / control.ACTIVATION
    path.write_text('{"host": "127.0.0.1", "port": 1}')
    os.chmod(path, 0o600)
    os.chown(path, 65534, 65534)
    with pytest.raises(ControlProtocolError, match="written by uid 65534"):
        control.read_message(ctl, control.ACTIVATION, Activation)


def test_malformed_file_refused(ctl: Path) -> None:
    control.write_atomic(ctl, control.ACTIVATION, b'{"host": "x", "port": 99999}')
    with pytest.raises(ControlProtocolError, match="malformed"):
        control.read_message(ctl, control.ACTIVATION, Activation)


def test_directory_rules(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    os.chmod(shared, 0o755)
    with pytest.raises(ControlProtocolError, match="must be private"):
        control.ensure_private_dir(shared)
    os.symlink(shared, tmp_path / "link")
    with pytest.raises(ControlProtocolError, match="is a symlink"):
        control.ensure_private_dir(tmp_path / "link")


def test_wait_survives_clock_jump(monkeypatch: pytest.MonkeyPatch) -> None:
    """A restore days later makes CLOCK_MONOTONIC jump: the jump must not expire the wait."""
    clock = [1000.0]
    calls = [0]
    monkeypatch.setattr(control.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(control.time, "sleep", lambda s: clock.__setitem__(0, clock[0] + s))

    def probe() -> str | None:
        calls[0] += 1
        if calls[0] == 3:
            clock[0] += 5 * 24 * 3600  # restored five days later
        if calls[0] == 4:
            clock[0] -= 9 * 24 * 3600  # on a host whose clock started later
        return "activated" if calls[0] == 10 else None

    assert control.wait_until(probe, timeout_s=5, phase="wait", interval_s=0.1) == "activated"


def test_wait_times_out_on_real_waiting(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [0.0]
    monkeypatch.setattr(control.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(control.time, "sleep", lambda s: clock.__setitem__(0, clock[0] + s))
    with pytest.raises(PhaseTimeout, match="wait did not finish within 2 s"):
        control.wait_until(lambda: None, timeout_s=2, phase="wait", interval_s=0.5)
    assert 2 <= clock[0] <= 3


def test_listener_handoff_passes_a_bound_socket(ctl: Path) -> None:
    """The engine receives the HTTP socket the orchestrator bound (what crosses network namespaces)."""
    import socket
    import threading

    server = control.open_handoff(ctl)
    received: list[socket.socket] = []
    thread = threading.Thread(target=lambda: received.append(control.receive_listener(server, 10)))
    thread.start()
    with socket.create_server(("127.0.0.1", 0)) as listener:
        control.send_listener(ctl, listener, peer_allowed=lambda pid: pid == os.getpid())  # the engine: here
        port = listener.getsockname()[1]
    thread.join(10)
    server.close()
    assert received and received[0].getsockname()[1] == port
    received[0].close()


def test_owner_heartbeat(ctl: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert control.owner_gone(ctl) == "no owner file"
    beat = control.OwnerHeartbeat(ctl)
    beat.beat()
    assert control.owner_gone(ctl) is None
    import time as real_time

    later = real_time.time() + control.OWNER_TIMEOUT_S + 1
    assert "silent" in (control.owner_gone(ctl, now=later) or "")
    beat.detach()
    assert control.owner_gone(ctl, now=later) is None


def test_a_message_of_another_protocol_is_refused_naming_both_versions(tmp_path: Path) -> None:
    ctl = control.ensure_private_dir(tmp_path / "ctl")
    control.write_atomic(ctl, control.ACTIVATION, b'{"host": "127.0.0.1", "port": 1, "protocol": 1, "vsnap": "0.1.0"}')
    with pytest.raises(ControlProtocolError, match=rf"vsnap 0\.1\.0 \(protocol 1\).*protocol {control.PROTOCOL_VERSION}"):
        control.read_message(ctl, control.ACTIVATION, Activation)
    control.write_atomic(ctl, control.ACTIVATION, b'{"host": "127.0.0.1", "port": 1}')  # before versions existed
    with pytest.raises(ControlProtocolError, match=r"protocol 1\)"):
        control.read_message(ctl, control.ACTIVATION, Activation)


def test_listener_handoff_never_follows_a_link_or_serves_another_process(ctl: Path, tmp_path: Path) -> None:
    """Hostile pass 10: listen.sock is the tree's to write. A link there made vsnap connect (as
    root, in the host's mount namespace) to any socket and hand it the bound TCP listener."""
    import socket

    other = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    other.bind(str(tmp_path / "victim.sock"))
    other.listen(1)
    os.symlink(tmp_path / "victim.sock", ctl / control.LISTENER)
    with socket.create_server(("127.0.0.1", 0)) as listener:
        anyone = lambda pid: True  # noqa: E731 - the checks before the peer's
        with pytest.raises(ControlProtocolError, match="listen.sock: not a socket"):
            control.send_listener(ctl, listener, anyone)
        os.unlink(ctl / control.LISTENER)
        (ctl / control.LISTENER).write_text("")
        with pytest.raises(ControlProtocolError, match="not a socket"):
            control.send_listener(ctl, listener, anyone)
        os.unlink(ctl / control.LISTENER)
        with pytest.raises(ControlProtocolError, match="cannot open it"):
            control.send_listener(ctl, listener, anyone)
        unheard = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # bound, never listening
        unheard.bind(str(ctl / control.LISTENER))
        with pytest.raises(ControlProtocolError, match="the handoff failed: Connection refused") as info:
            control.send_listener(ctl, listener, anyone)
        assert "read its engine log" in info.value.hint
        unheard.close()
        os.unlink(ctl / control.LISTENER)
        server = control.open_handoff(ctl)  # a real socket, but the check on its listener says no
        seen: list[int] = []
        with pytest.raises(ControlProtocolError, match=rf"pid {os.getpid()}\) is not in the tree"):
            control.send_listener(ctl, listener, peer_allowed=lambda pid: seen.append(pid) is not None)
        assert seen == [os.getpid()]
        server.close()
    other.close()


def test_an_error_with_unrepresentable_attributes_is_still_reported(ctl: Path) -> None:
    """A NaN, an int past 64 bits, a lone surrogate or a non-string attribute name on an engine's
    exception must not make the report fail (the host would see only "tree exited"): those
    attributes are left out."""
    error = RuntimeError("CUDA out of memory")
    error.free_bytes = 1 << 70
    error.ratio = float("nan")
    error.seconds = 1.5
    error.device = "cuda:0"
    error.note = "half a pair \ud800"
    vars(error)[3] = "not a name"
    control.write_message(ctl, control.ERROR, control.error_report("recover", error, gpu="0"))
    report = control.read_message(ctl, control.ERROR, control.ErrorReport)
    assert (report.phase, report.type, report.message) == ("recover", "RuntimeError", "CUDA out of memory")
    assert report.detail == {"seconds": 1.5, "device": "cuda:0", "gpu": "0"}


def test_a_failed_atomic_write_names_its_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Hostile pass 14: a full disk under the runtime directory said only "No space left on device"."""
    import errno

    def full(fd: int, data: object) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(control.os, "write", full)
    with pytest.raises(OSError) as failed:
        control.write_atomic(tmp_path, "record.json", b"{}")
    assert failed.value.filename == str(tmp_path / "record.json") and failed.value.errno == errno.ENOSPC
    assert list(tmp_path.iterdir()) == []  # no temporary file left


@pytest.mark.parametrize("where", ["open", "close", "rename"])
def test_a_stop_landing_as_a_call_returns_leaves_no_temp_file(ctl: Path, monkeypatch: pytest.MonkeyPatch,
                                                              where: str) -> None:
    """Hostile pass 18: a signal's exception (vsnap serve's SIGTERM, a Ctrl-C) raised as os.open or
    os.close returned fell outside the block that removed the temp file; a record's temp file then
    stayed in the registry for good (279 of 3000 interruptions)."""
    real = getattr(os, where)

    def interrupted(*args, **kwargs):  # the call completes, then the handler raises
        result = real(*args, **kwargs)
        if where == "open" and not args[1] & os.O_CREAT:
            return result  # the directory's open: the temp file's is the one that matters
        raise KeyboardInterrupt
    monkeypatch.setattr(control.os, where, interrupted)
    with pytest.raises(KeyboardInterrupt):
        control.write_atomic(ctl, "status.json", b"{}")
    monkeypatch.undo()
    left = sorted(p.name for p in ctl.iterdir())
    assert left == (["status.json"] if where == "rename" else []), left


def test_only_old_temp_files_of_records_are_removed(tmp_path: Path) -> None:
    """What a writer killed between its create and its rename left: removed once old, when its
    name is one of the records' (prune_dead_runs); anything else stays."""
    import re
    import time

    d = tmp_path / "records"
    d.mkdir(mode=0o700)
    old, fresh = ".r-0000abcd.json.4242.tmp", ".r-0000abce.json.4243.tmp"
    other, link = ".notes.json.4244.tmp", ".r-0000abcf.json.4245.tmp"
    for name in (old, fresh, other):
        (d / name).write_text("{}")
    (d / link).symlink_to(tmp_path / "elsewhere")
    (d / "r-0000abcd.json").write_text("{}")
    past = time.time() - 3600
    for name in (old, other):
        os.utime(d / name, (past, past))
    os.utime(d / link, (past, past), follow_symlinks=False)
    removed = control.remove_stale_temp_files(d, re.compile(r"r-[0-9a-f]{8}\.json"))
    assert removed == [old]
    assert sorted(p.name for p in d.iterdir()) == sorted([fresh, other, link, "r-0000abcd.json"])
