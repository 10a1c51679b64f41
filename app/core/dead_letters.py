"""Dead letters: a message a machine's queue held that kombu cannot decode is moved aside, and
the worker goes on consuming (R8).

kombu's Redis transport pops a message with ``BRPOP`` and then decodes it: ``loads`` of the
list item (``kombu/transport/redis.py``, ``Channel._brpop_read``), then the body per its
``body_encoding`` (``kombu/transport/virtual/base.py``, ``Message.__init__``: base64). Either
raising escapes the consumer, and Celery exits with "Unrecoverable error" (celery/celery#4308,
celery/kombu#2421): one ``LPUSH machine.server 'not json {'`` took a machine offline.

:class:`Transport` is kombu's Redis transport with one change, in its channel: those two
decoding steps are guarded. A message that fails either is pushed, as
``{"queue", "raw", "raw_bytes", "raw_digest", "error", "at"}`` JSON (``raw``: the message's
head, :data:`RAW_HEAD_CHARS`), onto the dead-letter list (``Keys.dead_letters``,
the ``dead_letter_key`` transport option; the newest first, at most :data:`MAX_DEAD_LETTERS`
kept), logged, and consumption goes on. ``raw`` is the item as kombu read it (UTF-8;
invalid bytes as U+FFFD, kombu's ``bytes_to_str``) or, when the JSON parsed but its body did
not decode, that JSON. ``homefleet status`` counts them; ``homefleet deadletter`` lists and
clears them (``app/fleet/queues.py``).

The transport is registered as :data:`TRANSPORT_ALIAS` (``hfredis``), a new name in kombu's
``TRANSPORT_ALIASES``, so that the ``hfredis+socket://`` URL form selects it too
(``app/core/connections.py``); kombu's own ``redis`` transport is unchanged.
"""

from __future__ import annotations

import binascii
import json
import logging
import time
from queue import Empty
from typing import Any

import redis
from kombu.transport import TRANSPORT_ALIASES, virtual
from kombu.transport import redis as kombu_redis

from app.core.digest import bytes_digest

log = logging.getLogger(__name__)

TRANSPORT_ALIAS = "hfredis"
SENTINEL_TRANSPORT_ALIAS = "hfsentinel"  # the same with kombu's Sentinel transport
MAX_DEAD_LETTERS = 1000  # a flood of garbage cannot fill Redis: older dead letters are dropped
RAW_HEAD_CHARS = 4096  # of a dead letter's message kept in its record (with the whole message's size and digest)
DECODE_ERRORS = (ValueError, TypeError, KeyError, AttributeError, binascii.Error)
"""What decoding a malformed message raises: JSON (``JSONDecodeError`` is a ``ValueError``),
base64 (``binascii.Error``), a payload of the wrong shape (a list, no ``properties``)."""


class Undecodable(Exception):
    """Raised inside the channel when a popped message cannot become a kombu message."""

    def __init__(self, raw: str, error: Exception) -> None:
        super().__init__(f"{type(error).__name__}: {error}")
        self.raw, self.error = raw, error


def dead_letter(raw: str, queue: str | None, error: Exception) -> str:
    """The dead-letter record of one message, as JSON: ``{queue, raw, raw_bytes, raw_digest,
    error, at}`` (``at``: unix s). ``raw`` keeps the message's first :data:`RAW_HEAD_CHARS`
    characters only, so a dead letter costs Redis at most a few KiB whatever was pushed (a 20 MB
    message once cost 20 MB); ``raw_bytes`` (UTF-8 bytes) and ``raw_digest`` (BLAKE3 of those
    bytes) identify the whole message."""
    data = raw.encode("utf-8", "replace")
    return json.dumps(
        {
            "queue": queue,
            "raw": raw[:RAW_HEAD_CHARS],
            "raw_bytes": len(data),
            "raw_digest": bytes_digest(data),
            "error": f"{type(error).__name__}: {error}"[:500],
            "at": time.time(),
        }
    )


class Message(virtual.Message):
    """kombu's Redis message; a payload whose body does not decode raises :class:`Undecodable`."""

    def __init__(self, payload: Any, channel: Any = None, **kwargs: Any) -> None:
        try:
            super().__init__(payload, channel=channel, **kwargs)  # type: ignore[no-untyped-call]
        except DECODE_ERRORS as error:
            raise Undecodable(json.dumps(payload, default=repr), error) from error


class Channel(kombu_redis.Channel):
    """kombu's Redis channel, moving undecodable messages to ``dead_letter_key``."""

    dead_letter_key = "hf:deadletters"
    from_transport_options = (*kombu_redis.Channel.from_transport_options, "dead_letter_key")  # type: ignore[assignment]

    Message = Message

    def _brpop_read(self, **options: Any) -> bool:
        try:
            return bool(super()._brpop_read(**options))  # type: ignore[no-untyped-call]
        except json.JSONDecodeError as error:  # the popped item is not JSON: error.doc holds it
            self._move_aside(error.doc, error)
        except Undecodable as error:
            self._move_aside(error.raw, error.error)
        return True

    def _get(self, queue: str) -> Any:  # type: ignore[override]  # kombu's takes a timeout this channel never gets
        try:
            return super()._get(queue)  # type: ignore[no-untyped-call]
        except json.JSONDecodeError as error:
            self._move_aside(error.doc, error, queue)
            raise Empty() from error

    def _last_queue(self) -> str | None:
        """The queue the last ``BRPOP`` answered from: kombu rotates it to the end of its cycle."""
        items = getattr(getattr(self, "_queue_cycle", None), "items", None)
        return items[-1] if items else None

    def _move_aside(self, raw: str, error: Exception, queue: str | None = None) -> None:
        queue = queue or self._last_queue()
        with self.conn_or_acquire() as client:
            # a plain client on the channel's pool: the dead-letter key is Homefleet's own, never
            # under the broker's global_keyprefix (kombu's prefixing client would prefix LPUSH only)
            plain = redis.Redis(connection_pool=client.connection_pool)
            with plain.pipeline(transaction=True) as pipe:
                pipe.lpush(self.dead_letter_key, dead_letter(raw, queue, error))
                pipe.ltrim(self.dead_letter_key, 0, MAX_DEAD_LETTERS - 1)
                pipe.execute()
        log.error(
            "queue %s held a message that cannot be decoded (%s: %s); moved to %s, consuming on",
            queue,
            type(error).__name__,
            error,
            self.dead_letter_key,
        )


class Transport(kombu_redis.Transport):
    """kombu's Redis transport with :class:`Channel`."""

    Channel = Channel


class SentinelChannel(Channel, kombu_redis.SentinelChannel):
    """kombu's Sentinel channel (it finds the master through the Sentinels on every new
    connection) moving undecodable messages aside like :class:`Channel`."""

    from_transport_options = tuple(
        dict.fromkeys(  # type: ignore[assignment]
            (*Channel.from_transport_options, *kombu_redis.SentinelChannel.from_transport_options)
        )
    )


class SentinelTransport(kombu_redis.SentinelTransport):
    """kombu's Sentinel transport with :class:`SentinelChannel`: a worker's, for a ``sentinel://``
    redis_url (docs/operations.md, "Redis Sentinel")."""

    Channel = SentinelChannel


TRANSPORT_ALIASES.setdefault(TRANSPORT_ALIAS, f"{__name__}:Transport")
TRANSPORT_ALIASES.setdefault(SENTINEL_TRANSPORT_ALIAS, f"{__name__}:SentinelTransport")
