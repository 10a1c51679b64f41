"""The one fleet lock (R14), fenced (C04): every change that must not interleave with a
placement (a submission, a sync's reservation, residency commitments, a reconciliation pass)
runs inside :meth:`FleetLock.held`.

A redis-py lock with a TTL (``fleet_lock_ttl_s``) and a bounded wait (``fleet_lock_wait_s``).
A holder that stalls past the TTL loses it to the next one; so before committing, a holder
checks that the lock still holds its token and renews it, in one atomic step: the
:class:`Fence` (the reservation's own Lua step does the same check, ``app/fleet/reservations.py``).
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import redis
from redis.exceptions import LockNotOwnedError

from app.core.errors import PlacementLost
from app.core.keys import Keys

log = logging.getLogger(__name__)

# KEYS[1] the lock, ARGV[1] our token, ARGV[2] TTL (ms): renew only a lock that is still ours.
_HOLDS = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end return 0"


@dataclass(frozen=True)
class Fence:
    """The fleet lock as a fencing check: ``key`` must still hold ``token`` (the token the lock
    was acquired with); a check that passes renews its TTL to ``ttl_ms`` milliseconds."""

    key: str
    token: str
    ttl_ms: int
    _script: Any = field(default=None, repr=False, compare=False)

    def holds(self) -> bool:
        """True, and the TTL renewed, when the lock is still ours (one atomic step)."""
        return bool(self._script(keys=[self.key], args=[self.token, self.ttl_ms]))

    def require(self, what: str) -> None:
        """Go on only while the lock is ours.

        Raises:
            PlacementLost: the lock expired (or another holder took it) before ``what``;
                the caller commits nothing.
        """
        if not self.holds():
            raise PlacementLost(f"the fleet lock expired before {what}; nothing was changed; try again")


class FleetLock:
    """The fleet's placement lock in Redis (``Keys.fleet_lock``)."""

    def __init__(self, client: redis.Redis, keyspace: Keys, ttl_s: float, wait_s: float) -> None:
        self.redis = client
        self.key = keyspace.fleet_lock()
        self.ttl_s = ttl_s
        self.wait_s = wait_s
        self._holds = client.register_script(_HOLDS)

    @contextmanager
    def held(self, purpose: str = "try") -> Iterator[Fence]:
        """Hold the lock for the ``with`` block; yield its :class:`Fence`. On leaving, the lock
        is released if it is still ours (a lost one is logged).

        Raises:
            PlacementLost: the lock was not free within ``wait_s`` (the message ends with
                ``purpose``, e.g. "submit again").
        """
        token = secrets.token_hex(16)
        lock = self.redis.lock(self.key, timeout=self.ttl_s, blocking_timeout=self.wait_s)
        if not lock.acquire(token=token):
            raise PlacementLost(f"the fleet lock was not free within {self.wait_s} s; {purpose}")
        try:
            yield Fence(self.key, token, int(self.ttl_s * 1000), self._holds)
        finally:
            try:
                lock.release()  # atomic: releases only a token that is still ours
            except LockNotOwnedError:
                log.warning("the fleet lock expired before its release (TTL %s s)", self.ttl_s)
