"""One factory per Redis connection (the journal's engine: ``app/db/engine.py``), and the
broker's URL as kombu names it. Nothing connects at import time."""

from __future__ import annotations

import logging
import math
import time
from typing import Any
from urllib.parse import parse_qsl, quote, unquote, urlencode, urlsplit, urlunsplit

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry
from redis.sentinel import Sentinel

from app.core.config import BrokerSettings

SOCKET_TIMEOUT_S = 10  # every connection's (s): a lost master is noticed, never waited on for ever (celery#6348)
OUTAGE_BACKOFF_CAP_S = 1.0  # the longest pause between two tries of a patient client (outage_retry)
REDIS_DOWN: tuple[type[Exception], ...] = (redis.ConnectionError, redis.TimeoutError)
"""What redis-py raises when Redis does not answer (not when it answers with an error): the API
answers it 503 ``redis_down``; a reader that can do without Redis catches it."""


def is_sentinel_url(redis_url: str) -> bool:
    """True when ``redis_url`` names Sentinels (``sentinel://h1:26379;sentinel://h2:26379/0``)."""
    return redis_url.startswith("sentinel://")


def sentinel_nodes(redis_url: str) -> tuple[list[tuple[str, int]], dict[str, Any]]:
    """The Sentinels of a ``sentinel://[user:password@]host[:port][/db];...`` URL, kombu's form, as
    ``([(host, port), ...], master_kwargs)``: port 26379 when none is given; ``master_kwargs`` holds
    ``db`` (the path of the first URL that has one, else 0) and ``username``/``password`` (the
    first URL that has them), which are the master's and replicas' credentials, not the Sentinels'.

    Raises:
        ValueError: a part names no host."""
    nodes: list[tuple[str, int]] = []
    kwargs: dict[str, Any] = {"db": 0}
    db_seen = False
    for part in redis_url.split(";"):
        parts = urlsplit(part.strip())
        if not parts.hostname:
            raise ValueError(f"redis_url: the Sentinel {redacted_url(part)!r} names no host")
        nodes.append((parts.hostname, parts.port or 26379))
        if parts.path.strip("/") and not db_seen:
            kwargs["db"], db_seen = int(parts.path.strip("/")), True
        if parts.password is not None and "password" not in kwargs:
            kwargs["password"] = unquote(parts.password)
            if parts.username:
                kwargs["username"] = unquote(parts.username)
    return nodes, kwargs


def sentinel_options() -> dict[str, Any]:
    """redis-py's keyword arguments for connections to the Sentinels themselves (``sentinel_kwargs``):
    kombu does not pass its transport's socket timeouts to them (celery#7997), so they are set here,
    for the broker and the server's own keys alike."""
    return {"socket_timeout": SOCKET_TIMEOUT_S, "socket_connect_timeout": SOCKET_TIMEOUT_S}


def outage_retry(retry_s: float) -> Retry:
    """redis-py's retry policy for a client that rides out a Redis outage (a restart, a
    failover) for about ``retry_s`` seconds: on ``ConnectionError`` and ``TimeoutError`` each
    command is tried again after an exponential backoff from 0.05 s, capped at
    :data:`OUTAGE_BACKOFF_CAP_S`."""
    tries = max(1, math.ceil(retry_s / OUTAGE_BACKOFF_CAP_S))
    return Retry(ExponentialBackoff(cap=OUTAGE_BACKOFF_CAP_S, base=0.05), tries)


def create_redis(settings: BrokerSettings, retry_s: float = 0.0) -> redis.Redis:
    """A Redis client for Homefleet's own keys (decoded strings). Connects lazily. With a
    ``sentinel://`` URL, redis-py's ``Sentinel(...).master_for(settings.redis_sentinel_master)``: each
    new connection asks the Sentinels where the master is now, so after a failover the client's
    next command (after one ``ConnectionError``/``TimeoutError`` on the old master) reaches the
    promoted replica (docs/operations.md, "Redis Sentinel"). ``retry_s`` > 0: each command rides
    out an outage for about that long (:func:`outage_retry`: a job's own bookkeeping in a pool
    process, which would otherwise leave a claimed job unreported, R19); 0: redis-py's default
    (a few quick retries), so that the API answers 503 at once (R20)."""
    patience: dict[str, Any] = {"retry": outage_retry(retry_s)} if retry_s > 0 else {}
    if is_sentinel_url(settings.redis_url):
        nodes, master = sentinel_nodes(settings.redis_url)
        sentinel = Sentinel(
            nodes,
            sentinel_kwargs=sentinel_options(),
            socket_timeout=SOCKET_TIMEOUT_S,
            socket_connect_timeout=SOCKET_TIMEOUT_S,
        )
        client: redis.Redis = sentinel.master_for(
            settings.redis_sentinel_master, decode_responses=True, **master, **patience
        )
        return client
    return redis.Redis.from_url(settings.redis_url, decode_responses=True, socket_timeout=SOCKET_TIMEOUT_S, **patience)


def broker_url(redis_url: str, transport: str = "redis") -> str:
    """``redis_url`` as kombu names the same Redis. redis-py's unix-socket form
    ``unix://[user:password@]/run/redis.sock?db=2&password=...`` is kombu's
    ``<transport>+socket://user:password@/run/redis.sock?virtual_host=2`` (kombu has no ``unix``
    transport, takes the credentials from the address only, and would pass other options of
    the query to redis-py untyped: they are left out; the broker's timeouts are its transport
    options, app/core/celery_app.py). ``transport``: ``redis`` (kombu's), or the workers'
    dead-lettering one (``TRANSPORT_ALIAS``, app/core/dead_letters.py). ``redis://`` and
    ``rediss://`` URLs are the same in both, and so are ``sentinel://`` ones (kombu's Sentinel
    transport; the consumer's dead-lettering variant is chosen by ``broker_transport``, app/core/celery_app.py)."""
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
    messages and logs that clients or operators read. Each part of a ``;``-separated list of
    Sentinels is redacted alike."""
    if ";" in url:
        return ";".join(redacted_url(part) for part in url.split(";"))
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    port = f":{parts.port}" if parts.port is not None else ""
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}{port}"))


class RedisOutageLog:
    """Says a Redis outage in ``logger`` once, for a loop that meets it at every turn: a warning
    naming ``redis_down`` and the URL (:func:`redacted_url`) when Redis stops answering
    (:meth:`failed`), nothing while it stays down, and one line when it answers again
    (:meth:`answered`). ``what``: who met it (``reconciliation``, ``job changes``); ``meanwhile``:
    what that loop does until Redis answers. Not thread-safe: one per loop."""

    def __init__(self, logger: logging.Logger, what: str, redis_url: str, meanwhile: str) -> None:
        self.logger = logger
        self.what = what
        self.url = redacted_url(redis_url)
        self.meanwhile = meanwhile
        self.down_since: float | None = None  # monotonic seconds of the first failure, None while it answers

    def failed(self, error: Exception) -> None:
        """Redis did not answer (``error``: redis-py's ConnectionError or TimeoutError, or an
        OSError): the warning, unless this outage was said already."""
        if self.down_since is not None:
            return
        self.down_since = time.monotonic()
        self.logger.warning(
            "%s: Redis at %s does not answer (redis_down: %s); %s until it answers again",
            self.what,
            self.url,
            error,
            self.meanwhile,
        )

    def answered(self, after: str = "") -> None:
        """Redis answered: one line if it had not (``after``: what follows now, appended), else nothing."""
        if self.down_since is None:
            return
        down_s = time.monotonic() - self.down_since
        self.down_since = None
        self.logger.warning("%s: Redis at %s answers again (down about %.0f s)%s", self.what, self.url, down_s, after)
