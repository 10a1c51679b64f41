"""The journal's engine, and the check of its schema revision.

Creating an engine changes nothing: only ``homefleet db upgrade`` and ``homefleet serve`` (and
the demo and drills, which run a server of their own) migrate the schema
(:func:`app.db.migrations.upgrade`); every other command checks the revision first
(:func:`check_revision`) and refuses a journal that is not at the newest one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sqlalchemy import event
from sqlalchemy.engine import Engine
from sqlmodel import create_engine as sqlmodel_create_engine

from app.core.config import Settings
from app.core.errors import ConfigError


def create_engine(settings: Settings) -> Engine:
    """The journal's SQLAlchemy engine (``settings.journal_url``); connects lazily, migrates nothing.

    SQLite gets WAL mode and a 10 s busy timeout so the API and the CLI can share the file, and
    ``synchronous=NORMAL``: in WAL mode a commit then survives a crash of any process (the
    server's included) and the file never corrupts; only a power loss or OS crash can roll back
    the last commits (sqlite.org/pragma.html#pragma_synchronous, sqlite.org/wal.html). That
    removes an fsync from every submission; PostgreSQL, the production journal, keeps its own
    durability settings.
    """
    url = settings.journal_url
    kwargs: dict[str, Any] = {}
    if url.startswith("sqlite"):
        settings.data_dir.mkdir(parents=True, exist_ok=True)
        kwargs["connect_args"] = {"check_same_thread": False, "timeout": 10}
    engine = sqlmodel_create_engine(url, **kwargs)
    if url.startswith("sqlite"):
        event.listen(engine, "connect", _sqlite_pragmas)
    return engine


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA busy_timeout=10000")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.close()


def check_journal_file(settings: Settings) -> None:
    """Refuse, creating nothing, a SQLite journal whose file is not there (no folder, no file):
    a command run outside the server's folder would otherwise make an empty journal where a
    relative ``HOMEFLEET_DATA_DIR`` points from there. PostgreSQL (``database_url``) is not checked here.

    Raises:
        ConfigError: reason ``journal_outdated`` (the journal has no schema yet), naming the
            folder looked in, the current folder and ``homefleet db upgrade``.
    """
    if settings.database_url:
        return
    path = settings.data_dir / "journal.db"
    if path.exists():
        return
    raise ConfigError(
        f"the journal at {path.absolute()} has no schema yet: no journal is there (HOMEFLEET_DATA_DIR "
        f"{settings.data_dir}, this command run in {Path.cwd()}); run it with the server's HOMEFLEET_DATA_DIR "
        "(a relative one is read from the current folder), or create the journal with `homefleet db upgrade`",
        reason="journal_outdated",
    )


def check_revision(engine: Engine) -> str:
    """The journal's schema revision, when it is the newest one; return it.

    Raises:
        ConfigError: reason ``journal_outdated``: the journal has no schema yet, or an older
            revision; the message names the journal, both revisions and ``homefleet db upgrade``.
            Reason ``journal_down`` is not raised here: a database that does not answer raises
            ``sqlalchemy.exc.OperationalError``.
    """
    from app.db.migrations import current_revision, head_revision

    current, head = current_revision(engine), head_revision()
    if current != head:
        where = engine.url.render_as_string(hide_password=True)
        state = "has no schema yet" if current is None else f"is at revision {current}"
        raise ConfigError(
            f"the journal at {where} {state}; this version of Homefleet needs revision {head}: run "
            "`homefleet db upgrade` (with the server's HOMEFLEET_DATA_DIR / HOMEFLEET_DATABASE_URL)",
            reason="journal_outdated",
        )
    return current


SQLITE_FULL = 13
"""SQLite's primary result code for "database or disk is full" (``SQLITE_FULL``): its disk has no
room, or the database reached ``max_page_count``."""
POSTGRES_DISK_FULL = "53100"
"""PostgreSQL's SQLSTATE ``disk_full``."""


def disk_full(error: BaseException) -> bool:
    """Whether a journal database error (``sqlalchemy.exc.OperationalError``, or the driver's own)
    says the database cannot write for want of room: SQLite's ``SQLITE_FULL``, PostgreSQL's
    ``disk_full``; not an outage (docs/operations.md, "A full disk")."""
    cause = getattr(error, "orig", None) or error
    code = getattr(cause, "sqlite_errorcode", None)
    return (isinstance(code, int) and code & 0xFF == SQLITE_FULL) or getattr(
        cause, "sqlstate", None
    ) == POSTGRES_DISK_FULL
