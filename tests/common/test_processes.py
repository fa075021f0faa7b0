"""The ports handed to child processes: free, distinct, and out of reach of the kernel's ephemeral ports."""

import os
import socket

from services.common.processes import (
    PORT_RANGE_ENV,
    _ephemeral_low,
    free_port,
    keep_port,
    port_range_share,
    split_port_range,
)


def test_free_ports_are_distinct_bindable_and_below_the_ephemeral_range():
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == len(ports)
    assert all(1024 < port < _ephemeral_low() for port in ports)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", ports[0]))


def test_each_share_of_the_range_draws_only_its_own_ports(monkeypatch):
    """pytest-xdist's workers each take a share (tests/conftest.py), so two never hand out the same port."""
    monkeypatch.delenv(PORT_RANGE_ENV, raising=False)  # restored after the test, whatever split_port_range sets
    split_port_range(1, 3)
    low, high = (int(part) for part in os.environ[PORT_RANGE_ENV].split("-"))
    share = (_ephemeral_low() - 10_000) // 3
    assert (low, high) == (10_000 + share, 10_000 + 2 * share)
    assert all(low <= free_port() < high for _ in range(50))


def test_process_trees_started_side_by_side_get_disjoint_parts_of_this_processs_share(monkeypatch):
    monkeypatch.setenv(PORT_RANGE_ENV, "20000-20300")
    assert [port_range_share(i, 3) for i in range(3)] == ["20000-20100", "20100-20200", "20200-20300"]


def test_a_kept_port_is_never_handed_out(monkeypatch):
    """A service keeps its own port, which it binds only once built: the engines a gateway starts meanwhile never get
    it, nor do the services of a run get ports the launcher handed to another service (disjoint shares)."""
    monkeypatch.setenv(PORT_RANGE_ENV, "5000-5004")  # below where the other tests draw
    keep_port(5002)
    drawn = {free_port() for _ in range(3)}
    assert drawn == {5000, 5001, 5003}
