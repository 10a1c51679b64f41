"""What a worker process holds: its settings, its server client and its model cache.

Clients and caches are created per process (lazily, keyed by pid), so the prefork pool's
children never share a socket with the parent.
"""

from __future__ import annotations

import json
import mmap
import os
import threading
from typing import cast

import redis

from app.core.config import WorkerSettings
from app.core.connections import create_redis
from app.core.keys import Keys
from residency.cache import ModelCache
from residency.device import Device
from tasks.devices import detect_device, device_for
from tasks.pipelines import load_pipeline
from tasks.server_client import ServerClient


class WorkerRuntime:
    def __init__(self, settings: WorkerSettings, boot_id: str) -> None:
        self.settings = settings
        self.boot_id = boot_id  # one per worker start; sent with every claim
        self.keys = Keys(settings.key_prefix)
        self._pid = -1
        self._server: ServerClient | None = None
        self._redis: redis.Redis | None = None
        self._cache: ModelCache | None = None
        self._device: Device | None = None
        self._cache_lock = threading.Lock()
        # models retired while resident here, not yet dropped (tasks/retirements.py); replaced whole, never mutated
        self.retired: frozenset[str] = frozenset()
        # model id -> its files' (size, mtime_ns, inode) when this process last hashed them (tasks/loading.py)
        self.verified_stats: dict[str, dict[str, tuple[int, int, int] | None]] = {}
        # One byte shared by the worker's parent and its forked pool processes (an anonymous
        # shared mapping, made here before any fork): 1 once the server refused this worker's token
        # (tasks/run_job.py at a claim, tasks/heartbeat.py at a beat's duty): the worker exits 78.
        self._token_refused = mmap.mmap(-1, 1)

    def _this_process(self) -> None:
        """Create this process's clients and cache on first use (once, even when the preload
        thread and a job ask at the same moment); the pid is set last, when all exist."""
        if self._pid == os.getpid():
            return
        with _INIT_LOCK:
            if self._pid == os.getpid():
                return
            self._cache_lock = threading.Lock()  # this process's own (never a copy inherited held)
            self._server = ServerClient.for_worker(self.settings, self.boot_id, patient=True)
            # patient, as the server client is: a job's own bookkeeping rides out a Redis restart
            self._redis = create_redis(self.settings, retry_s=self.settings.server_retry_s)
            device = self.device()
            device.guard()  # only the MPS adapter has a memory guard (R18)
            self._cache = ModelCache(load_pipeline, device, capacity_bytes=self.settings.memory_cap_bytes)
            # Applied at worker start (R16); tasks/preload.py then loads them.
            commitments = cast("set[str]", self._redis.smembers(self.keys.residency(self.settings.machine)))
            self._cache.protected = frozenset(commitments)
            self._pid = os.getpid()

    @property
    def server(self) -> ServerClient:
        self._this_process()
        assert self._server is not None
        return self._server

    @property
    def redis(self) -> redis.Redis:
        self._this_process()
        assert self._redis is not None
        return self._redis

    @property
    def cache(self) -> ModelCache:
        self._this_process()
        assert self._cache is not None
        return self._cache

    @property
    def cache_lock(self) -> threading.Lock:
        """Held while the model cache changes: by a job from claim to end, and by the start-up
        preload of committed models (tasks/preload.py), so a job never runs beside a load."""
        self._this_process()
        return self._cache_lock

    def device(self) -> Device:
        """This worker's device adapter (cpu, cuda or mps, as detected; ``tasks/devices.py``)."""
        if self._device is None:
            self._device = device_for(detect_device())
        return self._device

    @property
    def token_refused(self) -> bool:
        """Whether the server refused this worker's token since it started, in any of its
        processes (:meth:`refuse_token`)."""
        return self._token_refused[0] == 1

    def refuse_token(self) -> None:
        """Record, for the worker's parent and every pool process, that the server refused this
        worker's token (401): the worker stops and exits ``EX_CONFIG`` (78, tasks/worker.py)."""
        self._token_refused[0] = 1

    def commitments(self) -> frozenset[str]:
        """The machine's residency commitments (R16) as the server stored them in Redis."""
        return frozenset(cast("set[str]", self.redis.smembers(self.keys.residency(self.settings.machine))))

    def withdraw(self, model_id: str) -> None:
        """Stop advertising ``model_id`` on this machine until it is verified again (R4, R5)."""
        self.redis.srem(self.keys.verified(self.settings.machine), model_id)

    def record_warm(self) -> None:
        """Publish the models resident in this process, for the heartbeat's ``warm_models``,
        but those known retired (:attr:`retired`: resident until the cache lock lets them go,
        never used again; ``tasks/retirements.py``)."""
        warm = [m for m in self.cache.warm_models() if m not in self.retired]
        self.redis.set(self.keys.warm(self.settings.machine), json.dumps(warm))


_runtime: WorkerRuntime | None = None
_INIT_LOCK = threading.Lock()  # taken only inside a process after it forked, never held across a fork


def install(runtime: WorkerRuntime) -> None:
    """Set the process's runtime (done once, by the worker's entry point, before forking)."""
    global _runtime
    _runtime = runtime


def current() -> WorkerRuntime:
    if _runtime is None:
        raise RuntimeError("no worker runtime installed: start workers with `homefleet worker --machine NAME`")
    return _runtime
