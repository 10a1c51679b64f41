"""Two servers on one PostgreSQL journal: exactly one leads (docs/operations.md, "A standby
server"); a leader whose session ends hands over within a poll; SQLite refuses the mode."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from pydantic import ValidationError
from sqlalchemy import text
from sqlalchemy.exc import SQLAlchemyError

from app.core.config import Settings
from app.db.engine import create_engine
from app.db.leadership import LEADER_LOCK, Leadership
from tests.conftest import fresh_postgres_database

POLL_S = 0.2


@pytest.fixture
def postgres_url() -> Iterator[str]:
    yield from fresh_postgres_database("hf_leader")


def test_one_leader_and_a_handover_within_a_poll(tmp_path: Path, postgres_url: str) -> None:
    settings = Settings(data_dir=tmp_path, database_url=postgres_url, leader_election=True, leader_poll_s=POLL_S)
    engines = [create_engine(settings) for _ in range(2)]
    first, second = (Leadership(engine, POLL_S, enabled=True) for engine in engines)
    try:
        first.start()
        second.start()
        assert (first.leads(), second.leads()) == (True, False)
        time.sleep(3 * POLL_S)
        assert (first.leads(), second.leads()) == (True, False)  # the standby keeps trying, in vain
        # the leader's session is ended from outside (as PostgreSQL does for a killed process)
        with engines[1].connect() as admin:
            ended = (
                admin.execute(
                    text(
                        "SELECT pg_terminate_backend(pid) FROM pg_locks WHERE locktype = 'advisory' AND granted "
                        "AND ((classid::bigint << 32) | objid::bigint) = :key "
                        # advisory locks are per database: another test's servers hold the same key in theirs
                        "AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
                    ),
                    {"key": LEADER_LOCK},
                )
                .scalars()
                .all()
            )
        assert ended == [True]
        deadline = time.monotonic() + 10 * POLL_S
        while not second.leads() and time.monotonic() < deadline:
            time.sleep(POLL_S / 4)
        assert second.leads()
        time.sleep(2 * POLL_S)
        assert (first.leads(), second.leads()) == (False, True)  # the old leader found its session gone
    finally:
        first.stop()
        second.stop()
        for engine in engines:
            engine.dispose()


def test_a_single_server_always_leads_and_connects_nowhere(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path)
    engine = create_engine(settings)
    alone = Leadership(engine, POLL_S, enabled=False)
    alone.start()
    assert alone.leads() and alone._connection is None
    alone.stop()


def test_sqlite_refuses_two_servers(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match=r"leader_election .* needs a PostgreSQL journal"):
        Settings(data_dir=tmp_path, leader_election=True)


def test_servers_starting_at_once_migrate_one_after_the_other(tmp_path: Path, postgres_url: str) -> None:
    """Two or three servers started together on a new PostgreSQL journal each migrate it
    (build_context(migrate=True)): the advisory lock makes them take turns, none fails."""
    import threading

    from app.db.engine import check_revision
    from app.db.migrations import upgrade
    from app.db.migrations.head import HEAD

    settings = Settings(data_dir=tmp_path, database_url=postgres_url)
    errors: list[str] = []

    def migrate() -> None:
        engine = create_engine(settings)
        try:
            upgrade(engine)
        except SQLAlchemyError as error:  # counted: the assertion below names it
            errors.append(repr(error))
        finally:
            engine.dispose()

    threads = [threading.Thread(target=migrate) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert errors == []
    engine = create_engine(settings)
    try:
        assert check_revision(engine) == HEAD
    finally:
        engine.dispose()


def test_health_says_which_of_two_servers_leads(
    tmp_path: Path, postgres_url: str, redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Two API servers on one journal: ``GET /health`` of each says whether it leads, and the
    standby says at start that it stands by (an operator's pass: only the leader's log told)."""
    from fastapi.testclient import TestClient

    from app.api.server import create_app
    from app.context import build_context
    from tests.helpers import TEST_API_KEY, make_fleet

    settings = Settings(
        data_dir=tmp_path,
        database_url=postgres_url,
        redis_url=redis_url,
        leader_election=True,
        leader_poll_s=POLL_S,
        api_keys=[TEST_API_KEY],
    )
    fleet = make_fleet("m1")
    first = build_context(settings, fleet, migrate=True)
    second = build_context(settings, fleet, migrate=True)
    with TestClient(create_app(settings, first)) as leader, TestClient(create_app(settings, second)) as standby:
        assert leader.get("/health").json()["leads"] is True
        assert standby.get("/health").json()["leads"] is False
    assert "this server stands by: another leads" in caplog.text
