"""The join command ``homefleet machines add`` and ``rotate-token`` print is warned about when it
hands the new host this host's loopback address (tests/e2e/test_join.py runs the whole command)."""

from __future__ import annotations

import socket
from types import SimpleNamespace

import pytest

from app.cli.machines import _on_loopback, _server_url


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
