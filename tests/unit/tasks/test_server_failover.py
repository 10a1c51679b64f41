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


class _Progress(BaseHTTPRequestHandler):
    """A server that takes progress reports and serves one input file, recording the paths."""

    calls: ClassVar[list[str]] = []

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", "0")))
        self.calls.append(self.path)
        self.send_response(204)
        self.end_headers()

    def do_GET(self) -> None:
        from app.core.digest import bytes_digest

        self.calls.append(self.path)
        self.send_response(200)
        self.send_header("Content-Length", "5")
        self.end_headers()
        self.wfile.write(b"input")
        assert self.path.endswith(bytes_digest(b"input"))

    def log_message(self, *_: object) -> None:
        pass


def test_a_running_job_s_progress_and_inputs_follow_the_standby_when_its_server_dies() -> None:
    """The server a worker talks to is killed mid-job: the next progress report goes to the
    standby at once (patient or not: a step never waits), and so do the later ones and the input
    fetches. Dropped at the dead server, the reports stopped and the new leader's reconciliation
    judged the healthy job hung (``hung_after_s``) and killed it."""
    from app.core.digest import bytes_digest

    standby = ThreadingHTTPServer(("127.0.0.1", 0), _Progress)
    threading.Thread(target=standby.serve_forever, daemon=True).start()
    dead = f"http://127.0.0.1:{free_port()}"  # the killed leader: connection refused
    client = ServerClient([dead, f"http://127.0.0.1:{standby.server_port}"], "token-123456", 2.0, retry_s=30.0)
    try:
        client.progress("j1", 2, 6)
        assert client.current == 1  # moved to the standby, and stays there
        client.progress("j1", 3, 6)
        assert client.input_file(bytes_digest(b"input")) == b"input"
    finally:
        client.close()
        standby.shutdown()
    assert _Progress.calls[:2] == ["/internal/v1/jobs/j1/progress"] * 2
    assert _Progress.calls[2].startswith("/internal/v1/files/")


def test_a_progress_report_with_no_server_answering_tries_each_once_without_a_pause(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import tasks.server_client

    def no_pause(seconds: float) -> None:
        raise AssertionError(f"a progress report paused {seconds} s")

    monkeypatch.setattr(tasks.server_client.time, "sleep", no_pause)
    urls = [f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"]
    client = ServerClient(urls, "token-123456", 2.0, retry_s=30.0)  # a patient client: claims wait
    try:
        with pytest.raises(httpx.TransportError):
            client.progress("j1", 1, 6)
        assert client.current == 1  # each tried once, in turn
    finally:
        client.close()
