"""The ports handed to child processes: free, distinct, and out of reach of the kernel's ephemeral ports."""

import socket

from services.common.processes import _ephemeral_low, free_port


def test_free_ports_are_distinct_bindable_and_below_the_ephemeral_range():
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == len(ports)
    assert all(1024 < port < _ephemeral_low() for port in ports)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", ports[0]))
