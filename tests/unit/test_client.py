"""Homefleet's own client never resends a POST by itself (R20)."""

from __future__ import annotations

import socket
import threading

import httpx
import pytest

from app.client import HomefleetClient


def test_r20_the_client_sends_a_submission_once_even_when_the_connection_drops() -> None:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    server.settimeout(0.3)  # accept() gives up soon after the one connection: the test ends at once
    connections: list[bytes] = []

    def accept_and_drop() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            connections.append(conn.recv(65536))
            conn.close()  # no answer: the client cannot know whether the job was created

    thread = threading.Thread(target=accept_and_drop, daemon=True)
    thread.start()
    port = server.getsockname()[1]
    with HomefleetClient(f"http://127.0.0.1:{port}", timeout_s=5) as client:
        with pytest.raises(httpx.HTTPError):
            client.submit("tiny-sd", "txt2img", {"prompt": "x"}, idempotency_key="k-1")
    server.close()
    thread.join(5)
    assert len(connections) == 1
    assert connections[0].startswith(b"POST /v1/jobs")
    assert b"idempotency-key: k-1" in connections[0].lower()
