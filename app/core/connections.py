"""One factory per external connection. Nothing connects at import time."""

from __future__ import annotations

from typing import Any
from urllib.parse import parse_qsl, quote, urlencode, urlsplit, urlunsplit

import redis
from sqlalchemy import event
from sqlalchemy.engine import Engine
from sqlmodel import create_engine as sqlmodel_create_engine

from app.core.config import BrokerSettings, Settings


def create_redis(settings: BrokerSettings) -> redis.Redis:
    """A Redis client for Homefleet's own keys (decoded strings). Connects lazily."""
    return redis.Redis.from_url(settings.redis_url, decode_responses=True, socket_timeout=10)


def broker_url(redis_url: str) -> str:
    """``redis_url`` as kombu names the same Redis. redis-py's unix-socket form
    ``unix://[user:password@]/run/redis.sock?db=2&password=...`` is kombu's
    ``redis+socket://user:password@/run/redis.sock?virtual_host=2`` (kombu has no ``unix``
    transport, takes the credentials from the address only, and would pass other options of
    the query to redis-py untyped: they are left out; the broker's timeouts are its transport
    options, app/core/celery_app.py). ``redis://`` and ``rediss://`` URLs are the same in both."""
    parts = urlsplit(redis_url)
    if parts.scheme != "unix":
        return redis_url
    query = dict(parse_qsl(parts.query))
    user = parts.username or query.get("username", "")
    password = parts.password or query.get("password")
    userinfo = quote(user, safe="") + (f":{quote(password, safe='')}" if password else "")
    credentials = f"{userinfo}@" if userinfo else ""
    return f"redis+socket://{credentials}{parts.path}?{urlencode({'virtual_host': query.get('db', '0')})}"


def redacted_url(url: str) -> str:
    """``url`` with its password replaced by ``***`` (``redis://:***@host:6379/0``): for
    messages and logs that clients or operators read."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    port = f":{parts.port}" if parts.port is not None else ""
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}{port}"))


def create_engine(settings: Settings) -> Engine:
    """The journal's SQLAlchemy engine; creates or migrates the schema (Alembic, app/migrations).

    SQLite gets WAL mode and a 10 s busy timeout so the API and the CLI can share the file, and
    ``synchronous=NORMAL``: in WAL mode a commit then survives a crash of any process (the
    server's included) and the file never corrupts; only a power loss or OS crash can roll back
    the last commits (sqlite.org/pragma.html#pragma_synchronous, sqlite.org/wal.html). That
    removes an fsync from every submission (bench/placement.py's submit_vs_bare); PostgreSQL,
    the production journal, keeps its own durability settings.
    """
    url = settings.journal_url
    kwargs: dict[str, Any] = {}
    if url.startswith("sqlite"):
        settings.data_dir.mkdir(parents=True, exist_ok=True)
        kwargs["connect_args"] = {"check_same_thread": False, "timeout": 10}
    engine = sqlmodel_create_engine(url, **kwargs)
    if url.startswith("sqlite"):
        event.listen(engine, "connect", _sqlite_pragmas)
    from app.db.migrations import upgrade

    upgrade(engine)  # Alembic: creates or migrates the schema to the newest revision
    return engine


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA busy_timeout=10000")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.close()
