"""Schema migrations of the journal's database (Alembic), applied by :func:`upgrade`: by
``homefleet db upgrade`` and ``homefleet serve`` only (``app/db/engine.py``). A new migration::

    .venv/bin/python -m app.db.migrations revision "what changed"

autogenerates the difference between the tables (SQLModel metadata) and the last revision.
"""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import create_engine, inspect
from sqlalchemy.engine import Engine

SCRIPTS = Path(__file__).resolve().parent


def alembic_config(engine: Engine) -> Config:
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
    revision first, then migrated (operator pass: "table job already exists")."""
    config = alembic_config(engine)
    with engine.begin() as connection:
        config.attributes["connection"] = connection
        tables = set(inspect(connection).get_table_names())
        if "alembic_version" not in tables and tables == PRE_MIGRATION_TABLES:
            command.stamp(config, INITIAL)
        command.upgrade(config, revision)


def revision(message: str) -> None:
    """Autogenerate a new revision against a scratch SQLite database at head."""
    with tempfile.TemporaryDirectory() as scratch:
        engine = create_engine(f"sqlite:///{scratch}/schema.db")
        upgrade(engine)
        config = alembic_config(engine)
        with engine.begin() as connection:
            config.attributes["connection"] = connection
            command.revision(config, message=message, autogenerate=True)



def current_revision(engine: Engine) -> str | None:
    """The revision the journal's schema is at (None: no schema, or from before migrations)."""
    with engine.connect() as connection:
        return MigrationContext.configure(connection).get_current_revision()


@functools.cache
def head_revision() -> str:
    """The newest revision this version of Homefleet ships."""
    config = Config()
    config.set_main_option("script_location", str(SCRIPTS))
    head = ScriptDirectory.from_config(config).get_current_head()
    assert head is not None
    return head
