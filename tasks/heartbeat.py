"""The worker's heartbeat in Redis: a key with a TTL that says the machine is online (R4, R12).

The record (machine, boot id, device, memory, warm models, verified models) is rebuilt from
Redis at every beat, so what the pool child changes (a sync, a withdrawal, a load) shows in the
next beat. A beat is written only while this worker holds its machine's lease
(``tasks/lease.py``), in one step with that check.

The heartbeat's thread also drives the worker's periodic duties, each in its own module: the
start-up verification before the first beat and the registry's changes after
(``tasks/verify.py``), and the watchdog's restart requests (``tasks/watchdog.py``).

The worker starts consuming only after the first beat (:meth:`Heartbeat.wait_first_beat`): a
job is never claimed by a boot that has not beaten yet, which reconciliation would take for a
lost worker (no live heartbeat, no progress: ``worker_lost``, R19), and no message is taken
while the server cannot be reached to claim it.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import threading
import time
from collections.abc import Callable, Sequence
from typing import cast

import httpx
import psutil
import redis

from app.core.config import WorkerSettings
from app.core.errors import HomefleetError, Unauthorized
from app.core.keys import Keys
from tasks.verify import Verifier

log = logging.getLogger("homefleet.worker")


def refused_at_start(machine: str, refusal: Unauthorized) -> str:
    """What a worker the server refused logs as it stops, before its first beat or later (a
    claim or a beat's duty refused with 401: its token was rotated): the server's reason, and
    the setting to fix: ``--machine`` when the fleet has no such machine (reason
    ``unknown_machine``, the server's message says so), else the worker's token."""
    if refusal.reason == "unknown_machine":
        return f"{machine}: the server refused this worker: {refusal.message}; stopping"
    return (
        f"{machine}: the server refused this worker's token ({refusal.message}); set HOMEFLEET_WORKER_TOKEN "
        f"(or HOMEFLEET_WORKER_TOKEN_FILE) to the token of machine {machine!r} in the server's fleet config, or, "
        f"on a host that joined with `homefleet worker join`, run the join command `homefleet machines "
        f"rotate-token {machine}` printed on the server's host; stopping"
    )


# KEYS: the lease, the heartbeat, the advertised set, the warm record, the kept marker. ARGV:
# boot id, heartbeat record, its TTL (ms), 1 when Redis restarted (a new run id), a warm record
# to restore (or ""), 1 when this worker wrote a beat before, then the models it advertises.
# Nothing is written unless the lease holds this boot id (returns false). The advertised set is
# written back when Redis restarted or, for a worker that wrote before, when the kept marker is
# gone (FLUSHALL): checked here, in the same atomic step as the write, since a loss between a
# check made apart and the write would be missed, or the set read empty and kept (R19).
# Returns the advertised set as it stands after the beat.
_BEAT = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return false end
if ARGV[4] == '1' or (ARGV[6] == '1' and redis.call('EXISTS', KEYS[5]) == 0) then
  redis.call('DEL', KEYS[3])
  for i = 7, #ARGV do redis.call('SADD', KEYS[3], ARGV[i]) end
end
if ARGV[5] ~= '' then redis.call('SET', KEYS[4], ARGV[5], 'NX') end
redis.call('SET', KEYS[2], ARGV[2], 'PX', ARGV[3])
redis.call('SET', KEYS[5], ARGV[1])
return {'written', redis.call('SMEMBERS', KEYS[3])}
"""


class Heartbeat:
    """A daemon thread that has ``verifier`` check the model folder once, then writes the
    heartbeat every ``heartbeat_interval_s`` with a TTL of ``heartbeat_ttl_s``, and after each
    beat runs ``duties`` (e.g. the watchdog's restart requests, following the registry)."""

    def __init__(
        self,
        settings: WorkerSettings,
        client: redis.Redis,
        keyspace: Keys,
        boot_id: str,
        device: str,
        verifier: Verifier,
        duties: Sequence[Callable[[], None]] = (),
        on_refused: Callable[[], None] | None = None,
    ) -> None:
        self.settings = settings
        self.redis = client
        self.keys = keyspace
        self.boot_id = boot_id
        self.device = device
        self.verifier = verifier
        self.duties = tuple(duties)
        self.on_refused = on_refused  # called (in this thread) when the server refuses the token after start
        self.verified: set[str] | None = None
        self.refused = False  # the server refused the token: the worker stops (exit 78)
        self.abandoned = False  # another worker of this machine runs it now (abandon)
        self._redis_run_id: str | None = None
        self._warm: str | None = None  # the pool process's warm models as last read (JSON), to restore
        self._written = False  # a beat was written by this boot
        self._stop = threading.Event()
        self._first = threading.Event()  # set at the first beat written, or when the thread ends without one
        self._thread = threading.Thread(target=self._run, name="homefleet-heartbeat", daemon=True)

    def start(self) -> None:
        # A new boot: nothing is warm yet (a pool child records its loads, tasks/runtime.py).
        self.redis.delete(self.keys.warm(self.settings.machine))
        self._thread.start()

    def stop(self) -> None:
        """Stop beating and take the machine offline at once (delete the heartbeat key), unless
        :meth:`abandon` was called: then the key is another worker's."""
        self._stop.set()
        self._thread.join(timeout=5)
        if not self.abandoned:
            self.redis.delete(self.keys.heartbeat(self.settings.machine))

    def wait_first_beat(self, poll_s: float = 1.0) -> bool:
        """Block until the first beat is written (after the start-up verification, which needs
        the server's manifests: an unreachable server is waited for). True once written; False
        when the thread ended without one: the server refused the token (:attr:`refused`), or
        the worker was stopped or abandoned its lease. Polls every ``poll_s`` seconds so a
        signal handler can interrupt the wait."""
        while not self._first.wait(poll_s):
            if not self._thread.is_alive():
                break
        return self._written

    def abandon(self) -> None:
        """Stop writing this machine's heartbeat and verified set, leaving both as they are:
        another worker of this machine took the worker lease (tasks/lease.py)."""
        self.abandoned = True
        self._stop.set()

    def beat(self) -> bool:
        """Write the heartbeat record, in one step with a check that this worker still holds its
        machine's lease: a worker that lost it to another writes nothing of that machine's any
        more. In the same step, restore what Redis lost:

        - the advertised set, when Redis restarted without persistence (its run id changed) or
          lost its data without a restart (``FLUSHALL``: the marker ``Keys.verified_kept``, which
          every beat writes without a TTL, is gone), so the machine stays placeable; otherwise the
          set is remembered as Redis holds it after the beat (syncs add to it, the job-time check
          withdraws from it, R4/R5). The marker is checked inside the write's atomic step: checked
          apart, a loss between the check and the write went unseen and the set, read empty, was
          kept (R19). The record's ``verified_models`` is the set the previous beat left;
        - the pool process's warm models (written by it at its start and after each load), when
          their record is gone, unless the pool process wrote a newer one meanwhile.

        Returns whether the beat was written (False: this worker does not hold the lease).
        """
        machine = self.settings.machine
        run_id = self.redis.info("server").get("run_id")
        restarted = run_id != self._redis_run_id
        warm = cast("str | None", self.redis.get(self.keys.warm(machine)))  # decoded (create_redis)
        restore = self._warm if warm is None and self._warm is not None else None
        warm = warm if restore is None else restore
        memory = psutil.virtual_memory()
        verified = sorted(self.verified or ())
        record = {
            "machine": machine,
            "boot_id": self.boot_id,
            "pid": os.getpid(),
            "host": platform.node(),
            "device": self.device,
            "memory_total_bytes": memory.total,
            "memory_available_bytes": memory.available,
            "warm_models": json.loads(warm) if warm else [],
            "verified_models": verified,
            "at": time.time(),
        }
        written = self.redis.eval(
            _BEAT,
            5,
            self.keys.worker_lease(machine),
            self.keys.heartbeat(machine),
            self.keys.verified(machine),
            self.keys.warm(machine),
            self.keys.verified_kept(machine),
            self.boot_id,
            json.dumps(record),
            int(self.settings.heartbeat_ttl_s * 1000),
            int(restarted),
            restore or "",
            int(self._written),
            *verified,
        )
        if not written:
            log.warning("%s: this worker does not hold the machine's lease now; heartbeat not written", machine)
            return False
        self.verified = set(written[1])  # as Redis holds it now: with syncs' additions, without withdrawals
        self._redis_run_id = run_id
        self._warm = warm
        self._written = True
        self._first.set()
        return True

    def _first_check(self) -> None:
        self.verified = self.verifier.verify()
        self._redis_run_id = self.redis.info("server").get("run_id")

    def _run(self) -> None:
        try:
            self._loop()
        finally:
            self._first.set()  # a waiter learns the thread ended (refused, stopped, abandoned)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                if self.verified is None:
                    self._first_check()
                self.beat()
                for duty in self.duties:
                    duty()
            except Unauthorized as error:
                # A wrong token never becomes right: stop instead of retrying forever. Before the
                # first beat, start_worker exits 78 (wait_first_beat); later (the machine's token
                # was rotated), on_refused stops Celery, which would otherwise take every job and
                # have each claim refused, and the worker exits 78 the same way.
                log.critical("%s", refused_at_start(self.settings.machine, error))
                self.refused = True
                if self.verified is not None and self.on_refused is not None:
                    self.on_refused()
                return
            except (HomefleetError, httpx.HTTPError, redis.RedisError, OSError) as error:
                log.warning(
                    "%s heartbeat: %s (retrying in %.1f s)",
                    self.settings.machine,
                    error,
                    self.settings.heartbeat_interval_s,
                )
            self._stop.wait(self.settings.heartbeat_interval_s)
