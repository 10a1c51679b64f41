"""Only ``homefleet db upgrade`` and ``homefleet serve`` migrate the journal; every other command
checks its revision and refuses one that is not the newest, naming ``homefleet db upgrade``,
and changes nothing (no table is created)."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import run_cli

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "command",
    [
        ["status"],
        ["models", "list"],
        ["reconcile"],
        ["residency", "show"],
        ["oom", "list"],
        ["timings", "list"],
        ["db", "pair"],
        ["keys"],
    ],
)
def test_a_command_refuses_a_journal_without_the_newest_schema_and_creates_nothing(
    command: list[str], tmp_path: Path, redis_url: str
) -> None:
    env = {"HOMEFLEET_DATA_DIR": str(tmp_path / "data"), "HOMEFLEET_REDIS_URL": redis_url}
    done = run_cli(*command, env=env, check=False)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "error (journal_outdated)" in done.stderr and "has no schema yet" in done.stderr
    assert "homefleet db upgrade" in done.stderr
    assert not (tmp_path / "data").exists()  # no folder, no empty journal where the command was run


def test_a_command_outside_the_server_s_folder_says_where_it_looked_and_creates_nothing(
    tmp_path: Path, redis_url: str
) -> None:
    """A relative HOMEFLEET_DATA_DIR (the default, var/homefleet) read from the wrong folder:
    the refusal names the folder it looked in and the current one."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {"HOMEFLEET_DATA_DIR": "var/homefleet", "HOMEFLEET_REDIS_URL": redis_url}
    done = subprocess.run(  # a real process started in that folder (the fork server keeps its own)
        [sys.executable, "-m", "app.cli", "status"],
        cwd=elsewhere,
        env={**os.environ, **env, "PYTHONPATH": str(ROOT), "COLUMNS": "400"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"{elsewhere}/var/homefleet/journal.db has no schema yet" in done.stderr
    assert f"this command run in {elsewhere})" in done.stderr
    assert list(elsewhere.iterdir()) == []


def test_an_empty_journal_file_is_refused_and_gets_no_table(tmp_path: Path, redis_url: str) -> None:
    (tmp_path / "data").mkdir()
    journal = tmp_path / "data" / "journal.db"
    sqlite3.connect(journal).close()  # the file, no schema
    env = {"HOMEFLEET_DATA_DIR": str(tmp_path / "data"), "HOMEFLEET_REDIS_URL": redis_url}
    done = run_cli("status", env=env, check=False)
    assert done.returncode == 2 and "has no schema yet" in done.stderr, done.stdout + done.stderr
    assert sqlite3.connect(journal).execute("SELECT name FROM sqlite_master WHERE type='table'").fetchall() == []


def test_after_db_upgrade_the_same_command_runs(tmp_path: Path, redis_url: str) -> None:
    env = {"HOMEFLEET_DATA_DIR": str(tmp_path / "data"), "HOMEFLEET_REDIS_URL": redis_url}
    assert "migrated from no schema to revision" in run_cli("db", "upgrade", env=env).stdout
    listed = run_cli("models", "list", env=env)
    assert "error" not in listed.stdout and "id" in listed.stdout


def test_status_on_a_redis_no_server_ran_with_says_so(tmp_path: Path, redis_url: str) -> None:
    """A shell that forgot the server's HOMEFLEET_REDIS_URL reads an empty fleet: ``status`` says
    that this Redis records no journal, until a server (here ``db pair``) has recorded one."""
    prefix = f"t{os.getpid()}{tmp_path.name[-6:]}".replace("_", "")
    env = {
        "HOMEFLEET_DATA_DIR": str(tmp_path / "data"),
        "HOMEFLEET_REDIS_URL": redis_url,
        "HOMEFLEET_KEY_PREFIX": prefix,
    }
    run_cli("db", "upgrade", env=env)
    status = run_cli("status", env=env)
    shown = " ".join(status.stderr.split())  # a warning: stdout keeps the table for a script
    assert f"(key prefix '{prefix}') records no journal: no server has run with it" in shown, shown
    assert "records no journal" not in status.stdout and "dead letters: 0" in status.stdout, status.stdout
    run_cli("db", "pair", env=env)
    assert "records no journal" not in run_cli("status", env=env).stderr
