"""Ports the test harness hands to servers (``app.devtools.redis_server.free_port``): picked
below the kernel's ephemeral range and in blocks disjoint between pytest-xdist workers, so no
client socket and no other worker can take one between the pick and the server's bind."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from app.devtools import redis_server
from app.devtools.redis_server import PICK_RANGE, free_port


def ephemeral_low() -> int:
    path = Path("/proc/sys/net/ipv4/ip_local_port_range")
    return int(path.read_text().split()[0]) if path.exists() else 32768


def test_the_range_lies_below_the_kernels_ephemeral_ports() -> None:
    assert PICK_RANGE[1] <= ephemeral_low()


def test_ports_are_never_handed_out_twice_and_are_bindable() -> None:
    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == 200
    for port in ports[:20]:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_a_listening_port_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    # a pair below the kernel's ephemeral range (this worker's block), the second one free: a
    # kernel-chosen port's neighbour may be any outgoing connection's, under load
    held = next(port for port in iter(free_port, None) if redis_server._bindable(port + 1))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", held))
        taken.listen()
        monkeypatch.setattr(redis_server, "PICK_RANGE", (held, held + 2))
        monkeypatch.setattr(redis_server, "_handed_out", set())
        monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
        assert free_port() == held + 1


@pytest.mark.parametrize("count", [2, 3, 8])
def test_xdist_workers_get_disjoint_blocks(monkeypatch: pytest.MonkeyPatch, count: int) -> None:
    blocks = []
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", str(count))
    for index in range(count):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", f"gw{index}")
        blocks.append(redis_server._my_block())
    spans = sorted(blocks)
    assert all(low < high for low, high in spans)
    assert all(spans[i][1] <= spans[i + 1][0] for i in range(count - 1))
    assert spans[0][0] >= PICK_RANGE[0] and spans[-1][1] <= PICK_RANGE[1]
    monkeypatch.setenv("PYTEST_XDIST_WORKER", f"gw{count - 1}")
    monkeypatch.setattr(redis_server, "_handed_out", set())
    low, high = blocks[-1]
    assert all(low <= free_port() < high for _ in range(20))
