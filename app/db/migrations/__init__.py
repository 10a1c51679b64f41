"""Schema migrations of the journal's database (Alembic), applied by :func:`upgrade`: by
``homefleet db upgrade`` and ``homefleet serve`` only (``app/db/engine.py``). A new migration::

    .venv/bin/python -m app.db.migrations revision "what changed"

autogenerates the difference between the tables (SQLModel metadata) and the last revision,
and records the new head in ``head.py``.

Alembic is imported only by what migrates: every other command checks the journal's revision
(:func:`current_revision` against :data:`HEAD`) with one query, without loading Alembic and the
version scripts (0.86-1.05 s of ``homefleet status`` on a 2-core host, docs/benchmarks.md).
"""

from __future__ import annotations

import re
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from sqlalchemy import create_engine, inspect, text
from sqlalchemy.engine import Engine

from app.db.leadership import MIGRATION_LOCK
from app.db.migrations.head import HEAD

if TYPE_CHECKING:
    from alembic.config import Config

SCRIPTS = Path(__file__).resolve().parent


def alembic_config(engine: Engine) -> Config:
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(SCRIPTS))
    # Alembic's config interpolates "%": a URL-escaped password (p%40ss) or a data folder named
    # "100%" would fail to parse.
    config.set_main_option("sqlalchemy.url", engine.url.render_as_string(hide_password=False).replace("%", "%%"))
    return config


INITIAL = "41151008d433"  # the first revision: the schema journals had before migrations existed
PRE_MIGRATION_TABLES = frozenset({"job", "jobevent", "learnedtiming", "modelfile", "modelrecord"})


def upgrade(engine: Engine, revision: str = "head") -> None:
    """Bring the database to ``revision`` (default: the newest). Idempotent.

    A journal created before migrations existed (its tables made directly from the models, no
    ``alembic_version``) has exactly the first revision's tables: it is stamped with that
    revision first, then migrated (operator pass: "table job already exists"). On PostgreSQL
    under a transaction-level advisory lock: two servers starting at once on one journal
    (docs/operations.md, "A standby server") migrate one after the other."""
    from alembic import command

    config = alembic_config(engine)
    with engine.begin() as connection:
        if connection.dialect.name == "postgresql":  # servers starting at once on one journal: one at a time
            connection.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": MIGRATION_LOCK})
        config.attributes["connection"] = connection
        tables = set(inspect(connection).get_table_names())
        if "alembic_version" not in tables and tables == PRE_MIGRATION_TABLES:
            command.stamp(config, INITIAL)
        command.upgrade(config, revision)


def revision(message: str) -> None:
    """Autogenerate a new revision against a scratch SQLite database at head, and record it as
    :data:`HEAD` (``head.py``)."""
    from alembic import command

    with tempfile.TemporaryDirectory() as scratch:
        engine = create_engine(f"sqlite:///{scratch}/schema.db")
        upgrade(engine)
        config = alembic_config(engine)
        with engine.begin() as connection:
            config.attributes["connection"] = connection
            script = command.revision(config, message=message, autogenerate=True)
    assert script is not None and not isinstance(script, list)
    head_file = SCRIPTS / "head.py"
    head_file.write_text(re.sub(r'^HEAD = ".*"$', f'HEAD = "{script.revision}"', head_file.read_text(), flags=re.M))


def current_revision(engine: Engine) -> str | None:
    """The revision the journal's schema is at (None: no schema, or from before migrations):
    Alembic's ``alembic_version`` row, read with one query."""
    with engine.connect() as connection:
        if not inspect(connection).has_table("alembic_version"):
            return None
        return connection.execute(text("SELECT version_num FROM alembic_version")).scalar()


def head_revision() -> str:
    """The newest revision this version of Homefleet ships (:data:`HEAD`)."""
    return HEAD
