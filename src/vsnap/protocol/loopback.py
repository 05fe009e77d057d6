"""Bring up `lo` in this process's network namespace (a new one starts with it down). A leaf."""

from __future__ import annotations

import fcntl
import socket
import struct

_SIOCGIFFLAGS, _SIOCSIFFLAGS, _IFF_UP = 0x8913, 0x8914, 0x1


def loopback_up() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        flags = struct.unpack("16sh", fcntl.ioctl(s, _SIOCGIFFLAGS, struct.pack("16sh", b"lo", 0)))[1]
        if not flags & _IFF_UP:
            fcntl.ioctl(s, _SIOCSIFFLAGS, struct.pack("16sh", b"lo", flags | _IFF_UP))
