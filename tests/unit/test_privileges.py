"""host.privileges against written /proc files (tests/integration/test_container_privileges.py
runs the real thing in podman), and check_root as another user."""

from __future__ import annotations

from pathlib import Path

import pytest

from vsnap.host import facts, privileges
from vsnap.protocol.errors import HostNotReady

ALL_BUT_SYS_RESOURCE = "000001fffeffffff"  # what root has on these VMs and the GPU machine


def status(tmp_path: Path, cap_eff: str, seccomp: str = "0") -> Path:
    path = tmp_path / "status"
    path.write_text(f"Name:\tvsnap\nCapInh:\t0000000000000000\nCapEff:\t{cap_eff}\nSeccomp:\t{seccomp}\n")
    return path


def without(*bits: int) -> str:
    value = int(ALL_BUT_SYS_RESOURCE, 16)
    for bit in bits:
        value &= ~(1 << bit)
    return f"{value:016x}"


def test_root_on_these_machines_has_what_a_capture_and_a_restore_need(tmp_path: Path) -> None:
    for action in ("capture", "restore"):
        assert privileges.missing_capabilities(action, status(tmp_path, ALL_BUT_SYS_RESOURCE)) == []


@pytest.mark.parametrize("bit, name, actions", [
    (privileges.CAP_SYS_ADMIN, "CAP_SYS_ADMIN", ("capture", "restore")),
    (privileges.CAP_NET_ADMIN, "CAP_NET_ADMIN", ("capture", "restore")),
    (privileges.CAP_SYS_TIME, "CAP_SYS_TIME", ("restore",)),
])
def test_a_missing_capability_is_refused_by_name_for_the_actions_that_need_it(
        tmp_path: Path, bit: int, name: str, actions: tuple[str, ...]) -> None:
    path = status(tmp_path, without(bit))
    for action in ("capture", "restore"):
        if action in actions:
            with pytest.raises(HostNotReady) as refused:
                privileges.check_privileges(action, path)
            assert name in refused.value.message and "\n" not in refused.value.message
            assert refused.value.check == "privileges"
        else:
            assert name not in privileges.check_privileges(action, path)


def test_a_container_runtimes_default_capabilities_miss_three(tmp_path: Path) -> None:
    podman_default = "00000000800405fb"  # CapEff of `podman run` without --cap-add
    assert [n for n, _ in privileges.missing_capabilities("restore", status(tmp_path, podman_default))] == [
        "CAP_SYS_ADMIN", "CAP_NET_ADMIN", "CAP_SYS_TIME"]


def test_unreadable_status_leaves_the_verdict_to_criu(tmp_path: Path) -> None:
    assert privileges.missing_capabilities("restore", tmp_path / "missing") == []
    assert privileges.missing_capabilities("restore", status(tmp_path, "not-hex")) == []


def mountinfo(tmp_path: Path, *mount_points: str) -> Path:
    path = tmp_path / "mountinfo"
    lines = ["22 1 0:21 / /proc rw,nosuid,nodev,noexec,relatime shared:12 - proc proc rw"]
    lines += [f"{30 + i} 22 0:5 /null {m} ro,nosuid - devtmpfs udev rw" for i, m in enumerate(mount_points)]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_masks_under_proc_are_named_but_binfmt_misc_is_not(tmp_path: Path) -> None:
    assert privileges.masked_proc(mountinfo(tmp_path, "/proc/sys/fs/binfmt_misc")) == []
    masked = privileges.masked_proc(mountinfo(tmp_path, "/proc/kcore", "/proc/sys", "/procfoo"))
    assert masked == ["/proc/kcore", "/proc/sys"]


def test_confinement_names_seccomp_masks_and_apparmor(tmp_path: Path) -> None:
    label = tmp_path / "current"
    label.write_text("containers-default-0.50.1 (enforce)\n")
    found = privileges.confinement(status(tmp_path, ALL_BUT_SYS_RESOURCE, seccomp="2"),
                                   mountinfo(tmp_path, *(f"/proc/m{i}" for i in range(5))), (label,))
    assert found[0].startswith("a seccomp filter")
    assert found[1] == "a masked /proc (/proc/m0, /proc/m1, /proc/m2 and 2 more mounted over)"
    assert found[2] == "the AppArmor profile containers-default-0.50.1 (enforce)"
    label.write_text("unconfined\n")
    assert privileges.confinement(status(tmp_path, ALL_BUT_SYS_RESOURCE), mountinfo(tmp_path), (label,)) == []


def test_check_root_refuses_another_user_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(facts.os, "geteuid", lambda: 65534)
    with pytest.raises(HostNotReady) as refused:
        facts.check_root()
    assert refused.value.message == "vsnap must run as root (CRIU needs CAP_SYS_ADMIN)"
    assert refused.value.found == "uid 65534"
