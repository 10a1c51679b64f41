"""Schema migrations with Alembic (issue 8), on SQLite and PostgreSQL."""

from __future__ import annotations

from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect
from sqlmodel import SQLModel

import app.tables  # noqa: F401
from app.config import Settings
from app.connections import create_engine
from app.migrations import SCRIPTS, upgrade
from tests.conftest import run_cli, settings_env


def test_migrations_build_exactly_the_tables_the_code_declares(settings: Settings) -> None:
    engine = create_engine(settings)  # runs every migration on an empty database
    try:
        upgrade(engine)  # a second run changes nothing
        with engine.connect() as connection:
            diffs = compare_metadata(MigrationContext.configure(connection), SQLModel.metadata)
            revision = MigrationContext.configure(connection).get_current_revision()
        assert diffs == []
        assert {"job", "jobevent", "modelrecord", "modelfile", "learnedtiming"} <= set(inspect(engine).get_table_names())
        heads = [p.name.split("_")[0] for p in (SCRIPTS / "versions").glob("*.py") if not p.name.startswith("__")]
        assert revision in heads
    finally:
        engine.dispose()


def test_homefleet_db_upgrade_reports_the_revision(settings: Settings) -> None:
    out = run_cli("db", "upgrade", env=settings_env(settings)).stdout
    assert "at revision" in out and "None" not in out
