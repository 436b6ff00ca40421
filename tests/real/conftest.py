"""Shared by the real-run tests: an address of this machine that is not loopback."""

from __future__ import annotations

import fcntl
import socket
import struct

import pytest


def external_address() -> str | None:
    """An IPv4 address of this machine that is not loopback: the host name's, else the first interface's."""
    try:
        address = socket.gethostbyname(socket.gethostname())
        if not address.startswith("127."):
            return address
    except OSError:
        pass
    if not hasattr(socket, "if_nameindex"):
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            try:  # SIOCGIFADDR: the interface's IPv4 address (Linux)
                answer = fcntl.ioctl(probe.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue
            address = socket.inet_ntoa(answer[20:24])
            if not address.startswith("127."):
                return address
    return None


@pytest.fixture(scope="session", name="external_address")
def external_address_fixture() -> str | None:
    return external_address()
