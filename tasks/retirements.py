"""A model taken out of the registry (``homefleet models retire``, R1) leaves this worker's
memory at once, not at its turn for eviction.

The worker's parent stops advertising it at its next beat (``tasks/verify.py``,
``Verifier.follow_registry``), so nothing new is placed here for it (R4); but the pipeline lives
in the pool process's residency cache (``tasks/runtime.py``), which the parent cannot reach. A
daemon thread of the pool process therefore reads the registry's change mark (one Redis ``GET``
per heartbeat interval) and, when it moved, asks the server for the registered models
(``GET /manifest``) and drops every resident model that is no longer among them: its memory is
freed (``ModelCache.drop``: every reference, a collection, the allocator's cache) and the
heartbeat's ``warm_models`` stop naming it (R12 would price a warm load that cannot happen).

A retired model has no job queued or running (``Registry.retire`` refuses while one is), so the
drop never takes a pipeline from a job; it waits for the cache lock like a job does, which a
job of another model holds while it runs (minutes, on real models). The published warm models
stop naming it at once (:func:`unpublish`): it will never run again here.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Collection
from typing import cast

import httpx
import redis

from app.core.errors import HomefleetError
from tasks import runtime

log = logging.getLogger("homefleet.worker")


def unpublish(rt: runtime.WorkerRuntime, registered: Collection[str]) -> None:
    """Take the models not in ``registered`` out of the published warm models at once, without
    the cache lock (a job of another model may hold it for minutes): the list is read back from
    Redis, not from the cache, and :attr:`WorkerRuntime.retired` keeps every later publication
    (:meth:`WorkerRuntime.record_warm`) from naming them until they are dropped."""
    key = rt.keys.warm(rt.settings.machine)
    published = json.loads(cast("str | None", rt.redis.get(key)) or "[]")
    gone = frozenset(m for m in published if m not in registered)
    if gone:
        rt.retired = rt.retired | gone
        rt.redis.set(key, json.dumps([m for m in published if m not in gone]))


def drop_unregistered(rt: runtime.WorkerRuntime, registered: Collection[str]) -> list[str]:
    """Drop every resident model whose id is not in ``registered`` (the registry's models in
    service) from this process's residency cache, under the cache lock (after the job holding
    it, if any, ends), and publish the warm models left; returns the dropped ids, sorted
    (empty when nothing was resident for them)."""
    with rt.cache_lock:
        gone = sorted({m for m in rt.cache.warm_models() if m not in registered})
        for model_id in gone:
            rt.cache.drop(model_id)
        rt.retired = frozenset(m for m in rt.retired if m not in registered and m in rt.cache.warm_models())
        if gone:
            rt.record_warm()
    return gone


UNREAD = object()
"""The registry's change mark before the first look (a mark is a string, or None: never changed)."""


def follow_retirements(
    rt: runtime.WorkerRuntime, interval_s: float, stop: threading.Event | None = None, since: object = UNREAD
) -> None:
    """Until ``stop`` is set (never, in a worker): every ``interval_s`` seconds read the
    registry's change mark and, when it moved since the last look (``since``: the mark to
    compare the first look with; by default the first look is only read, as nothing retired
    is resident when a pool process starts), drop the resident models the server no longer
    lists (:func:`unpublish`, :func:`drop_unregistered`). A failure to reach Redis or the
    server is logged and the same change is looked at again next time."""
    stop = stop or threading.Event()
    key = rt.keys.registry_changed()
    seen = since
    while True:
        try:
            mark = cast("str | None", rt.redis.get(key))
            if seen is UNREAD:  # the registry as this process started: nothing retired is resident yet
                seen = mark
            elif mark != seen:
                registered = rt.server.manifest()
                unpublish(rt, registered)  # at once, even while a job holds the cache lock
                dropped = drop_unregistered(rt, registered)
                for model_id in dropped:
                    log.info(
                        "%s: model %s is no longer registered (retired); dropped from memory",
                        rt.settings.machine,
                        model_id,
                    )
                seen = mark
        except (HomefleetError, httpx.HTTPError, redis.RedisError, OSError) as error:
            log.warning(
                "%s: the registry's change could not be followed here (%s); trying again", rt.settings.machine, error
            )
        if stop.wait(interval_s):
            return


def start_following(rt: runtime.WorkerRuntime) -> threading.Thread:
    """Run :func:`follow_retirements` in a daemon thread of this (pool) process, at the
    heartbeat's interval."""
    thread = threading.Thread(
        target=follow_retirements,
        args=(rt, rt.settings.heartbeat_interval_s),
        name="homefleet-retirements",
        daemon=True,
    )
    thread.start()
    return thread


__all__ = ["drop_unregistered", "follow_retirements", "start_following"]
