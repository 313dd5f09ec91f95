"""free_port: the ports the local stack's servers are told to bind (etcd, apiserver, Prometheus...)."""

import secrets
import socket

import pytest

import batchpilot_localdev as localdev
from batchpilot_localdev import _ephemeral_range, free_port


def test_free_ports_are_distinct_bindable_and_outside_the_ephemeral_range() -> None:
    # Outside the range the kernel gives outgoing connections their source ports from, a port cannot
    # be taken by a client's connect() between the pick and the server's bind (a CI run lost etcd so).
    low, high = _ephemeral_range()
    ports = [free_port() for _ in range(300)]
    assert len(set(ports)) == len(ports)
    assert all(not low <= p <= high for p in ports), [p for p in ports if low <= p <= high]
    for port in ports[:20]:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_a_port_someone_listens_on_is_never_handed_out(monkeypatch: pytest.MonkeyPatch) -> None:
    # A 200-port range with every other port held by a listener that free_port did not hand out.
    low = 20000 + 200 * secrets.randbelow(60)
    monkeypatch.setattr(localdev, "_listen_range", lambda: (low, low + 199))
    listeners: list[socket.socket] = []
    try:
        for port in range(low, low + 200, 2):
            sock = socket.socket()
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:  # already taken by someone else: just as good
                sock.close()
                continue
            sock.listen()
            listeners.append(sock)
        taken = {s.getsockname()[1] for s in listeners}
        picked = {free_port() for _ in range(40)}
        assert picked and not picked & taken
        assert all(low <= p < low + 200 for p in picked)
    finally:
        for sock in listeners:
            sock.close()
