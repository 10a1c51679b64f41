"""The join command ``homefleet machines add`` and ``rotate-token`` print is warned about when it
hands the new host this host's loopback address (tests/e2e/test_join.py runs the whole command),
and ``homefleet worker join`` given a URL that is not the server's API says so."""

from __future__ import annotations

import http.server
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from app.cli.machines import _on_loopback, _server_url
from app.context import ServerContext
from app.devtools.redis_server import free_port
from app.fleet.live import JoinTokens
from tests.helpers import run_cli, served_api


@pytest.mark.parametrize(
    ("url", "loopback"),
    [
        ("http://127.0.0.1:8787", True),
        ("http://127.8.9.10:8787", True),
        ("http://localhost:8787", True),
        ("http://[::1]:8787", True),
        ("redis://:secret@127.0.0.1:6379/0", True),
        ("http://server.lan:8787", False),
        ("http://192.168.1.20:8787", False),
        ("http://0.0.0.0:8787", False),
        ("rediss://redis.example:6380/0", False),
    ],
)
def test_a_loopback_address_is_told_from_one_another_host_reaches(url: str, loopback: bool) -> None:
    assert _on_loopback(url) is loopback


@pytest.mark.parametrize(
    ("host", "public", "expected"),
    [
        ("127.0.0.1", None, "http://127.0.0.1:8787"),
        ("0.0.0.0", None, f"http://{socket.getfqdn()}:8787"),  # a wildcard is no address to reach
        ("::", None, f"http://{socket.getfqdn()}:8787"),
        ("fd00::5", None, "http://[fd00::5]:8787"),
        ("0.0.0.0", "https://fleet.example/", "https://fleet.example"),
    ],
)
def test_the_join_command_names_the_server_as_another_host_reaches_it(
    host: str, public: str | None, expected: str
) -> None:
    from app.core.config import Settings

    settings = Settings(api_host=host, api_port=8787, public_base_url=public)
    assert _server_url(SimpleNamespace(settings=settings), None) == expected  # type: ignore[arg-type]
    assert _server_url(SimpleNamespace(settings=settings), "http://given:1/") == "http://given:1"  # type: ignore[arg-type]


@pytest.fixture
def other_web_server() -> Iterator[str]:
    """``http://127.0.0.1:PORT`` of a web server that is not Homefleet's (Flower's port, say):
    every request is 404 with an HTML page."""

    class Pages(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            page = b"<!doctype html><html><title>Flower</title>" + b"<p>not here</p>" * 100 + b"</html>"
            self.send_response(404)
            self.send_header("content-type", "text/html")
            self.send_header("content-length", str(len(page)))
            self.end_headers()
            self.wfile.write(page)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Pages)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        thread.join(timeout=10)


def test_a_join_to_a_url_that_is_not_the_servers_api_names_the_url_not_a_key_or_a_page(
    ctx: ServerContext, other_web_server: str, tmp_path: Path
) -> None:
    """The OpenAI base URL (``…/v1``) was refused ``invalid_api_key``, another web server's port
    printed its HTML page; each now names the URL to give. The server's own URL still answers
    the join token's refusal."""
    bogus = "hfj_" + "x" * 43
    env: dict[str, str | None] = {"HOMEFLEET_REDIS_URL": None, "COLUMNS": "200"}
    with served_api(ctx) as url:
        for wrong in (f"{url}/v1", other_web_server):
            done = run_cli(
                "worker", "join", wrong, bogus, "--models-dir", str(tmp_path / "models"), env=env, check=False
            )
            said = " ".join(done.stderr.split())
            assert done.returncode == 2, done.stdout + done.stderr
            assert said.startswith(f"error (not_a_homefleet_server): '{wrong}' is not the address of"), said
            assert "without a path such as /v1" in said and "<html" not in said, said
        right = run_cli("worker", "join", url, bogus, "--models-dir", str(tmp_path / "models"), env=env, check=False)
        assert right.returncode == 2 and "error (join_token_unknown)" in right.stderr, right.stderr
    assert not (tmp_path / "worker-token").exists()


def test_a_join_while_the_server_is_down_says_so_and_the_same_command_joins_once_it_answers(
    ctx: ServerContext, tmp_path: Path
) -> None:
    """Joining while the server restarts: the answer said only "give the URL `homefleet machines
    add` printed", the very URL given; it now says the token was not spent and to run the same
    command again, which then joins."""
    machine_token = ctx.fleet.machines["m1"].token
    token = JoinTokens(ctx.redis, ctx.keys, ttl_s=900).issue("m1", machine_token)
    port = free_port()  # the server's port, while nothing listens on it
    command = ("worker", "join", f"http://127.0.0.1:{port}", token, "--models-dir", str(tmp_path / "models"))
    env: dict[str, str | None] = {"HOMEFLEET_REDIS_URL": None, "COLUMNS": "200"}
    down = run_cli(*command, "--print-systemd-unit", env=env, check=False)
    said = " ".join(down.stderr.split())
    assert down.returncode == 2 and "error (server_unreachable):" in said, said
    assert "the join token was not spent" in said and "run this same command again" in said, said
    with served_api(ctx, port=port):
        up = run_cli(*command, "--print-systemd-unit", env=env, check=False)
    assert up.returncode == 0, up.stdout + up.stderr
    assert "joined as machine m1" in " ".join(up.stderr.split()), up.stderr
    assert (tmp_path / "worker-token").read_text().strip() == machine_token
