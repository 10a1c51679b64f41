"""A worker the server refuses at start stops with exit 78 and one message naming what to fix
(tasks/worker.py ``check_token``, the heartbeat's first beat): a machine the fleet does not
have is ``--machine`` to fix, not the token; a token the server does not take is the token."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from app.core.errors import Unauthorized
from tasks import heartbeat, worker
from tasks.lease import EX_CONFIG
from tests.helpers import worker_settings

UNKNOWN = (
    "the worker names machine 'nosuch', which is not in this fleet (m1, m2, server); fix --machine "
    "(HOMEFLEET_MACHINE) or add it to the fleet file"
)


class RefusingServer:
    def __init__(self, refusal: Unauthorized) -> None:
        self.refusal = refusal

    def manifest(self) -> None:
        raise self.refusal

    def close(self) -> None:
        pass


@pytest.mark.parametrize(
    ("refusal", "said"),
    [
        (
            Unauthorized(UNKNOWN, reason="unknown_machine"),
            f"nosuch: the server refused this worker: {UNKNOWN}; stopping",
        ),
        (
            Unauthorized("the token belongs to no machine of this fleet"),
            "nosuch: the server refused this worker's token (the token belongs to no machine of this fleet); set "
            "HOMEFLEET_WORKER_TOKEN (or HOMEFLEET_WORKER_TOKEN_FILE) to the token of machine 'nosuch' in the "
            "server's fleet config, or, on a host that joined with `homefleet worker join`, run the join command "
            "`homefleet machines rotate-token nosuch` printed on the server's host; stopping",
        ),
    ],
    ids=["unknown_machine", "wrong_token"],
)
def test_a_refused_worker_exits_78_with_one_message_naming_what_to_fix(
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    tmp_path: Path,
    refusal: Unauthorized,
    said: str,
) -> None:
    settings = worker_settings("redis://127.0.0.1:6379/15", tmp_path).model_copy(update={"machine": "nosuch"})
    monkeypatch.setattr(worker.ServerClient, "for_worker", lambda _settings: RefusingServer(refusal))
    with caplog.at_level(logging.CRITICAL, logger="homefleet.worker"), pytest.raises(SystemExit) as stopped:
        worker.check_token(settings)
    assert stopped.value.code == EX_CONFIG
    assert [record.getMessage() for record in caplog.records] == [said]
    assert heartbeat.refused_at_start("nosuch", refusal) == said  # the heartbeat's first beat logs the same


def test_a_worker_on_the_servers_host_finds_the_server_at_its_api_port(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Without HOMEFLEET_SERVER_URL a worker asks 127.0.0.1 at the port the server's
    HOMEFLEET_API_PORT names (8787 when unset), the environment they share on one host."""
    from app.core.config import WorkerSettings

    monkeypatch.delenv("HOMEFLEET_SERVER_URL", raising=False)
    kwargs = {"machine": "server", "models_dir": tmp_path, "worker_token": "a-machine-token-0123456789"}
    monkeypatch.delenv("HOMEFLEET_API_PORT", raising=False)
    assert WorkerSettings(**kwargs).server_url == "http://127.0.0.1:8787"
    monkeypatch.setenv("HOMEFLEET_API_PORT", "28791")
    assert WorkerSettings(**kwargs).server_url == "http://127.0.0.1:28791"
    monkeypatch.setenv("HOMEFLEET_SERVER_URL", "http://box:9000")
    assert WorkerSettings(**kwargs).server_url == "http://box:9000"
