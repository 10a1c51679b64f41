"""Residency commitments applied at worker start (R16): the machine's committed models are
loaded into the pool process's model cache, as its protected set, before any job runs there.

Order, in the pool process (the cache lives there, ``tasks/runtime.py``):

1. wait until this boot's heartbeat is in Redis: the parent has hashed the model folder
   against the manifest (R4) and advertised the verified set;
2. read the commitments and the verified set; a committed model that is not verified here is
   skipped with a warning naming the ``homefleet sync`` to run;
3. under the runtime's cache lock (a job waits for it, ``tasks/run_job.py``): hash each
   committed model resident as a job would (``tasks/loading.py``: its files hashed again
   against the server's current manifest on any machine but the server, R5; loaded by the
   residency policy; the warm models published for the heartbeat).

A load the policy refuses, or a file that no longer matches, is logged and skipped: the
worker still serves jobs, and the next job for that model loads it cold as usual.
"""

from __future__ import annotations

import json
import logging
import threading
import time

import httpx
import redis

from app.core.errors import HomefleetError, IntegrityFailure
from residency.errors import ResidencyRefused
from tasks import runtime
from tasks.loading import make_resident

log = logging.getLogger("homefleet.worker")

POLL_S = 0.2  # how often the pool process looks for this boot's heartbeat (seconds)


def wait_for_verified_boot(rt: runtime.WorkerRuntime) -> None:
    """Block until the heartbeat in Redis carries this worker's boot id: its files were verified
    at start (R4). Polls every ``POLL_S`` seconds; an unreachable Redis is logged and retried."""
    key = rt.keys.heartbeat(rt.settings.machine)
    while True:
        try:
            raw = rt.redis.get(key)
        except redis.RedisError as error:
            log.warning("%s preload: Redis unreachable (%s); retrying", rt.settings.machine, error)
            raw = None
        if raw and json.loads(raw).get("boot_id") == rt.boot_id:
            return
        time.sleep(POLL_S)


def preload_commitments(rt: runtime.WorkerRuntime) -> list[str]:
    """Load the machine's committed, verified models into the cache as protected (R16);
    returns the model ids now warm because of it. Call it once the start-up verification is
    done (:func:`wait_for_verified_boot`).

    Raises:
        redis.RedisError, httpx.HTTPError, HomefleetError: Redis or the server (its manifest)
            could not be read; nothing was loaded.
    """
    machine = rt.settings.machine
    committed = rt.commitments()
    if not committed:
        return []
    verified = set(rt.redis.smembers(rt.keys.verified(machine)))
    for model_id in sorted(committed - verified):
        log.warning(
            "%s: committed model %s is not verified here; not preloaded (`homefleet sync %s %s`)",
            machine,
            model_id,
            machine,
            model_id,
        )
    wanted = sorted(committed & verified)
    if not wanted:
        return []
    manifests = rt.server.manifest()
    loaded_ids: list[str] = []
    with rt.cache_lock:
        rt.cache.protected = committed
        for model_id in wanted:
            manifest = manifests.get(model_id)
            if manifest is None:
                log.warning("%s: committed model %s is no longer registered; not preloaded", machine, model_id)
                continue
            try:
                loaded = make_resident(rt, manifest)
            except IntegrityFailure as mismatch:  # withdrawn until it is synced again (R4, R5)
                log.warning("%s: committed model %s not preloaded: %s", machine, model_id, mismatch.message)
                continue
            except ResidencyRefused as refusal:  # only evicting another protected model fits it
                log.warning("%s: committed model %s not preloaded: %s", machine, model_id, refusal.message)
                continue
            if loaded.cold:
                log.info(
                    "%s: committed model %s preloaded in %.2f s (protected, R16)", machine, model_id, loaded.load_s
                )
            loaded_ids.append(model_id)
        rt.record_warm()
    return loaded_ids


def start_preload(rt: runtime.WorkerRuntime) -> threading.Thread:
    """Run the start-up preload in a daemon thread of this (pool) process; see the module docstring."""

    def run() -> None:
        wait_for_verified_boot(rt)
        while True:
            try:
                preload_commitments(rt)
                return
            except (HomefleetError, httpx.HTTPError, redis.RedisError, OSError) as error:
                log.warning(
                    "%s preload of committed models failed: %s (retrying in %.1f s)",
                    rt.settings.machine,
                    error,
                    rt.settings.heartbeat_interval_s,
                )
                time.sleep(rt.settings.heartbeat_interval_s)

    thread = threading.Thread(target=run, name="homefleet-preload", daemon=True)
    thread.start()
    return thread
