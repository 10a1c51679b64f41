"""One factory per Redis connection (the journal's engine: ``app/db/engine.py``), and the
broker's URL as kombu names it. Nothing connects at import time."""

from __future__ import annotations

from urllib.parse import parse_qsl, quote, urlencode, urlsplit, urlunsplit

import redis

from app.core.config import BrokerSettings


def create_redis(settings: BrokerSettings) -> redis.Redis:
    """A Redis client for Homefleet's own keys (decoded strings). Connects lazily."""
    return redis.Redis.from_url(settings.redis_url, decode_responses=True, socket_timeout=10)


def broker_url(redis_url: str, transport: str = "redis") -> str:
    """``redis_url`` as kombu names the same Redis. redis-py's unix-socket form
    ``unix://[user:password@]/run/redis.sock?db=2&password=...`` is kombu's
    ``<transport>+socket://user:password@/run/redis.sock?virtual_host=2`` (kombu has no ``unix``
    transport, takes the credentials from the address only, and would pass other options of
    the query to redis-py untyped: they are left out; the broker's timeouts are its transport
    options, app/core/celery_app.py). ``transport``: ``redis`` (kombu's), or the workers'
    dead-lettering one (``TRANSPORT_ALIAS``, app/core/dead_letters.py). ``redis://`` and
    ``rediss://`` URLs are the same in both."""
    parts = urlsplit(redis_url)
    if parts.scheme != "unix":
        return redis_url
    query = dict(parse_qsl(parts.query))
    user = parts.username or query.get("username", "")
    password = parts.password or query.get("password")
    userinfo = quote(user, safe="") + (f":{quote(password, safe='')}" if password else "")
    credentials = f"{userinfo}@" if userinfo else ""
    return f"{transport}+socket://{credentials}{parts.path}?{urlencode({'virtual_host': query.get('db', '0')})}"


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
