"""Only ``homefleet db upgrade`` and ``homefleet serve`` migrate the journal; every other command
checks its revision and refuses one that is not the newest, naming ``homefleet db upgrade``,
and changes nothing (no table is created)."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from tests.helpers import run_cli


@pytest.mark.parametrize(
    "command",
    [["status"], ["models", "list"], ["reconcile"], ["residency", "show"], ["oom", "list"], ["db", "pair"], ["keys"]],
)
def test_a_command_refuses_a_journal_without_the_newest_schema_and_creates_nothing(
    command: list[str], tmp_path: Path, redis_url: str
) -> None:
    env = {"HOMEFLEET_DATA_DIR": str(tmp_path / "data"), "HOMEFLEET_REDIS_URL": redis_url}
    done = run_cli(*command, env=env, check=False)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "error (journal_outdated)" in done.stdout and "has no schema yet" in done.stdout
    assert "homefleet db upgrade" in done.stdout
    journal = tmp_path / "data" / "journal.db"
    if journal.exists():  # SQLite may create the empty file; never a table
        tables = sqlite3.connect(journal).execute("SELECT name FROM sqlite_master WHERE type='table'").fetchall()
        assert tables == []


def test_after_db_upgrade_the_same_command_runs(tmp_path: Path, redis_url: str) -> None:
    env = {"HOMEFLEET_DATA_DIR": str(tmp_path / "data"), "HOMEFLEET_REDIS_URL": redis_url}
    assert "migrated from no schema to revision" in run_cli("db", "upgrade", env=env).stdout
    listed = run_cli("models", "list", env=env)
    assert "error" not in listed.stdout and "id" in listed.stdout
