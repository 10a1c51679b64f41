"""The one fleet lock (R14), fenced (C04): every change that must not interleave with a
placement (a submission, a sync's reservation, residency commitments, a reconciliation pass)
runs inside :meth:`FleetLock.held`.

A redis-py lock with a TTL (``fleet_lock_ttl_s``) and a bounded wait (``fleet_lock_wait_s``).
A holder that stops running past the TTL loses it to the next one; so before committing, a holder
checks that the lock still holds its token and renews it, in one atomic step: the
:class:`Fence` (the reservation's own Lua step does the same check, ``app/fleet/reservations.py``).

A holder that is alive keeps the lock: while the ``with`` block runs, a daemon thread renews it
every ``ttl_s / 3`` through the same fenced step (:class:`_Renewal`), so a slow but live holder
(a loaded host, a slow journal commit) is not overtaken. Only a holder that stops running (a
frozen or dead process, whose thread stops too) loses the lock at its TTL; its next fenced
write then fails with :class:`PlacementLost`, as before. Each hold's seconds, from acquired to
released, go to ``observe`` (the server's ``homefleet_fleet_lock_hold_seconds``, app/metrics.py).
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable, Iterator
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


class _Renewal:
    """Renews a held lock every ``every_s`` seconds from a daemon thread, through its fence (so
    only a lock still ours is renewed), until :meth:`stop`; it stops by itself once the fence
    fails (the lock is lost: the holder's next fenced write raises) or Redis cannot be reached
    (the holder's own writes will tell)."""

    def __init__(self, fence: Fence, every_s: float) -> None:
        self.fence = fence
        self.every_s = every_s
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="homefleet-fleet-lock-renewal", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop renewing and wait for the thread (at most one renewal in flight)."""
        self._stopped.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stopped.wait(self.every_s):
            try:
                if not self.fence.holds():
                    log.warning(
                        "the fleet lock was lost while held (TTL %s ms); its holder commits nothing", self.fence.ttl_ms
                    )
                    return
            except redis.RedisError as error:
                log.warning("the fleet lock could not be renewed: %s", error)
                return


class FleetLock:
    """The fleet's placement lock in Redis (``Keys.fleet_lock``). ``observe``: called with each
    hold's seconds (acquired to released) on every release."""

    def __init__(
        self,
        client: redis.Redis,
        keyspace: Keys,
        ttl_s: float,
        wait_s: float,
        observe: Callable[[float], None] | None = None,
    ) -> None:
        self.redis = client
        self.key = keyspace.fleet_lock()
        self.ttl_s = ttl_s
        self.wait_s = wait_s
        self.observe = observe
        self._holds = client.register_script(_HOLDS)

    @contextmanager
    def held(self, purpose: str = "try") -> Iterator[Fence]:
        """Hold the lock for the ``with`` block, renewed every ``ttl_s / 3`` seconds while the
        block runs (:class:`_Renewal`); yield its :class:`Fence`. On leaving, renewal stops, the
        lock is released if it is still ours (a lost one is logged) and the hold's seconds are
        observed.

        Raises:
            PlacementLost: the lock was not free within ``wait_s`` (the message ends with
                ``purpose``, e.g. "submit again").
        """
        token = secrets.token_hex(16)
        lock = self.redis.lock(self.key, timeout=self.ttl_s, blocking_timeout=self.wait_s)
        if not lock.acquire(token=token):
            raise PlacementLost(f"the fleet lock was not free within {self.wait_s} s; {purpose}")
        acquired = time.perf_counter()
        fence = Fence(self.key, token, int(self.ttl_s * 1000), self._holds)
        renewal = _Renewal(fence, self.ttl_s / 3)
        renewal.start()
        try:
            yield fence
        finally:
            renewal.stop()
            try:
                lock.release()  # atomic: releases only a token that is still ours
            except LockNotOwnedError:
                log.warning("the fleet lock expired before its release (TTL %s s)", self.ttl_s)
            finally:
                if self.observe is not None:
                    self.observe(time.perf_counter() - acquired)
