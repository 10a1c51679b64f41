"""One worker per machine (R7), from the moment a worker starts: its lease in Redis.

The key ``Keys.worker_lease(machine)`` holds the worker's boot id with a TTL of
``heartbeat_ttl_s``, renewed by a thread every ``heartbeat_interval_s``; only its holder writes
the machine's heartbeat, advertised set and warm record (``tasks/heartbeat.py``).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable

import redis

from app.core.config import WorkerSettings
from app.core.keys import Keys

log = logging.getLogger("homefleet.worker")

EX_CONFIG = 78  # sysexits.h: a configuration error (the server refused the token; a second worker)


# KEYS[1] the lease, ARGV[1] our boot id, ARGV[2] TTL (ms). Renew our own (1); take it back when
# it is gone (2: Redis restarted or lost its data, or a stall outlasted the TTL); 0: another
# worker holds it.
_RENEW = """
local holder = redis.call('GET', KEYS[1])
if holder == ARGV[1] then redis.call('PEXPIRE', KEYS[1], ARGV[2]) return 1 end
if not holder then redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2]) return 2 end
return 0
"""
_RELEASE = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0"


class WorkerLease:
    """One worker per machine, from the moment a worker starts (before it consumes anything or
    verifies its files): the Redis key ``machine:<name>:worker`` holds its boot id with a TTL
    of ``heartbeat_ttl_s``, renewed by a thread every ``heartbeat_interval_s`` and deleted at a
    clean stop. A worker that died leaves a lease that lapses within the TTL; a new worker
    waits that long for it, then takes it. A lease that vanished under a running worker (Redis
    restarted or lost its data, or a stall outlasted the TTL) is taken back at the next
    renewal; one that another worker took meanwhile is lost for good: :attr:`lost` is set and
    ``on_lost`` is called (the worker stops: a warm shutdown, then exit 78).

    Raises (:meth:`acquire`):
        SystemExit: ``EX_CONFIG`` (78) when another worker of this machine holds the lease:
            it would take that machine's jobs and replace its verified models with its own
            folder's.
    """

    def __init__(
        self, settings: WorkerSettings, client: redis.Redis, boot_id: str, on_lost: Callable[[], None] | None = None
    ) -> None:
        self.settings, self.redis, self.boot_id = settings, client, boot_id
        self.key = Keys(settings.key_prefix).worker_lease(settings.machine)
        self.ttl_ms = int(settings.heartbeat_ttl_s * 1000)
        self._on_lost = on_lost
        self.lost = False  # another worker of this machine took the lease: this one must stop
        self._told = False  # on_lost was called (once)
        self._guard = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._renew, name="homefleet-lease", daemon=True)

    def acquire(self, poll_s: float = 0.2) -> None:
        deadline = time.monotonic() + self.settings.heartbeat_ttl_s + self.settings.heartbeat_interval_s
        while not self.redis.set(self.key, self.boot_id, nx=True, px=self.ttl_ms):
            if time.monotonic() >= deadline:
                log.critical(
                    "%s: another worker of this machine is running (%s), or still finishing its job "
                    "after a stop; one worker per machine: stop it first (or start this one with its own "
                    "--machine); stopping",
                    self.settings.machine,
                    self.holder(),
                )
                raise SystemExit(EX_CONFIG)
            time.sleep(poll_s)
        self._thread.start()

    def holder(self) -> str:
        """Who holds the lease, for the operator to find and stop it: its boot id, and its pid and
        host as its heartbeat names them (a worker left running on a machine removed and added
        again, say, or on another host); the boot id alone when its heartbeat is gone or unreadable."""
        boot = self.redis.get(self.key)
        boot_id = boot.decode() if isinstance(boot, bytes) else boot
        try:
            beat = json.loads(self.redis.get(Keys(self.settings.key_prefix).heartbeat(self.settings.machine)) or "{}")
        except (redis.RedisError, ValueError):
            beat = {}
        if isinstance(beat, dict) and beat.get("boot_id") == boot_id and beat.get("pid"):
            return f"boot {boot_id}, pid {beat['pid']} on host {beat.get('host', '?')}"
        return f"boot {boot_id}"

    def _renew(self) -> None:
        while not self._stop.wait(self.settings.heartbeat_interval_s):
            try:
                renewed = self.redis.eval(_RENEW, 1, self.key, self.boot_id, self.ttl_ms)
            except redis.RedisError as error:
                log.warning("%s: worker lease not renewed: %s", self.settings.machine, error)
                continue
            if renewed == 2:
                log.warning(
                    "%s: the worker lease was gone (Redis restarted or lost its data, or a stall outlasted "
                    "its %.0f s TTL); taken back",
                    self.settings.machine,
                    self.settings.heartbeat_ttl_s,
                )
            elif renewed == 0:
                log.critical(
                    "%s: another worker of this machine took the worker lease (boot %s) while this one "
                    "could not renew it; one worker per machine: this one stops",
                    self.settings.machine,
                    self.redis.get(self.key),
                )
                with self._guard:
                    self.lost = True
                self._tell()
                return

    def on_lost(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` (once) when the lease is lost; at once if it already was."""
        with self._guard:
            self._on_lost = callback
        self._tell()

    def _tell(self) -> None:
        with self._guard:
            callback = self._on_lost if self.lost and not self._told else None
            self._told = self._told or callback is not None
        if callback is not None:
            callback()

    def release(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=15)  # a renewal under way would take a released lease back
        try:
            self.redis.eval(_RELEASE, 1, self.key, self.boot_id)
        except redis.RedisError as error:
            log.warning(
                "%s: worker lease not released (it lapses in %.0f s): %s",
                self.settings.machine,
                self.settings.heartbeat_ttl_s,
                error,
            )
