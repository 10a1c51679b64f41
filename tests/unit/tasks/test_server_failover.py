"""A worker given several servers' URLs (standby servers, docs/operations.md "A standby
server") sends a call the current server does not answer to the next one at once (R19: a claim
reaches a server before reconciliation judges its job lost)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import httpx
import pytest

from app.core.config import split_server_urls
from app.devtools.redis_server import free_port
from tasks.server_client import ServerClient


def test_several_server_urls_are_split_and_a_bad_one_is_refused() -> None:
    assert split_server_urls("http://a:1/, https://b:2") == ["http://a:1", "https://b:2"]
    with pytest.raises(ValueError, match="not an http"):
        split_server_urls("http://a:1,ftp://b")
    with pytest.raises(ValueError, match="names no server"):
        split_server_urls(" , ")


class _Manifests(BaseHTTPRequestHandler):
    """A server that answers the manifest call with no models, counting its calls."""

    calls: ClassVar[list[str]] = []

    def do_GET(self) -> None:
        self.calls.append(self.path)
        body = json.dumps({"models": {}}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_: object) -> None:
        pass


def test_a_call_the_first_server_does_not_answer_goes_to_the_next_and_stays_there() -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Manifests)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    down = f"http://127.0.0.1:{free_port()}"  # nothing listens: connection refused
    client = ServerClient([down, f"http://127.0.0.1:{server.server_port}"], "token-123456", 2.0, machine="m1")
    try:
        assert client.manifest() == {}
        assert client.current == 1
        assert client.manifest() == {}  # the next call starts at the server that answered
    finally:
        client.close()
        server.shutdown()
    assert _Manifests.calls == ["/internal/v1/manifest"] * 2


def test_with_no_server_answering_an_impatient_call_tries_each_once_and_raises() -> None:
    urls = [f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"]
    client = ServerClient(urls, "token-123456", 2.0, machine="m1")
    try:
        with pytest.raises(httpx.TransportError):
            client.manifest()
    finally:
        client.close()
