"""cluster_helpers.Connections, which the cluster tests use to prove their traffic stayed on loopback, tells a
loopback connection from one over a network interface (real sockets of this process)."""

from __future__ import annotations

import os
import socket

import psutil
import pytest
from cluster_helpers import Connections


def _connected(address: str) -> tuple[socket.socket, socket.socket, socket.socket]:
    server = socket.create_server((address, 0))
    client = socket.create_connection(server.getsockname())
    accepted, _ = server.accept()
    return server, client, accepted


def test_connections_tell_loopback_from_a_network_interface():
    sockets = _connected("127.0.0.1")
    try:
        loopback = Connections()
        loopback.sample([os.getpid()])
        assert ("127.0.0.1", "127.0.0.1") in loopback.seen and not loopback.off_loopback()
    finally:
        for sock in sockets:
            sock.close()
    address = next((entry.address for name, entries in psutil.net_if_addrs().items() for entry in entries
                    if entry.family == socket.AF_INET and not entry.address.startswith("127.")), None)
    if address is None:
        pytest.skip("no network interface besides loopback")
    sockets = _connected(address)
    try:
        network = Connections()
        network.sample([os.getpid()])
        assert (address, address) in network.off_loopback()
    finally:
        for sock in sockets:
            sock.close()
