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
    server.settimeout(10)  # a loaded machine may take a while to start the client
    connections: list[bytes] = []

    def accept_and_drop() -> None:
        conn, _ = server.accept()
        connections.append(conn.recv(65536))
        conn.close()  # no answer: the client cannot know whether the job was created

    thread = threading.Thread(target=accept_and_drop, daemon=True)
    thread.start()
    port = server.getsockname()[1]
    with HomefleetClient(f"http://127.0.0.1:{port}", timeout_s=5) as client, pytest.raises(httpx.HTTPError):
        client.submit("tiny-sd", "txt2img", {"prompt": "x"}, idempotency_key="k-1")
    thread.join(5)
    server.settimeout(0.5)  # a resend would be waiting to be accepted by now
    try:
        again, _ = server.accept()
        connections.append(again.recv(65536))
        again.close()
    except TimeoutError:
        pass
    server.close()
    assert len(connections) == 1
    assert connections[0].startswith(b"POST /v1/jobs")
    assert b"idempotency-key: k-1" in connections[0].lower()
