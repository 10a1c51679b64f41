"""A model retired while a job of another model runs (tasks/retirements.py, R1, R12): the
published warm models stop naming it at once, though the running job holds the cache lock; the
pipeline is dropped when the lock is free. Real parts: the API served by uvicorn, its Redis,
journal and registry, the worker's runtime and server client; the residents stand in for loaded
pipelines (what is dropped is the cache's entry, whatever it holds)."""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from app.context import ServerContext
from app.core.config import WorkerSettings
from residency.cache import Resident
from tasks import runtime
from tasks.retirements import follow_retirements
from tests.helpers import served_api

KEEP, GOING = "tiny-keep", "tiny-going"


def until(condition: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


@pytest.fixture
def worker(ctx: ServerContext, tiny_models_dir: Path, tmp_path: Path) -> Iterator[tuple[runtime.WorkerRuntime, str]]:
    """Machine m1's runtime (this process) with both models resident, served by the real API."""
    for model_id in (KEEP, GOING):
        ctx.registry.add(tiny_models_dir / "tiny-sd", model_id)
    with served_api(ctx) as url:
        settings = WorkerSettings(
            machine="m1",
            models_dir=tmp_path / "m1-models",
            server_url=url,
            worker_token=ctx.fleet.machines["m1"].token,
            redis_url=ctx.settings.redis_url,
        )
        rt = runtime.WorkerRuntime(settings, uuid.uuid4().hex)
        for model_id in (GOING, KEEP):  # least recently used first
            rt.cache.residents[f"{model_id}\x00key"] = Resident(model_id, "key", pipeline=object(), bytes=1)
        rt.record_warm()
        yield rt, ctx.keys.warm("m1")


def test_r1_a_model_retired_during_another_models_job_leaves_the_warm_models_at_once(
    ctx: ServerContext, worker: tuple[runtime.WorkerRuntime, str]
) -> None:
    rt, warm_key = worker
    published = lambda: json.loads(ctx.redis.get(warm_key) or "[]")  # noqa: E731
    assert published() == [GOING, KEEP]
    stop = threading.Event()
    mark = ctx.redis.get(ctx.keys.registry_changed())  # the registry as the follower starts
    follower = threading.Thread(target=follow_retirements, args=(rt, 0.05, stop, mark), daemon=True)
    rt.cache_lock.acquire()  # a job of KEEP runs
    try:
        follower.start()
        ctx.registry.retire(GOING)
        assert until(lambda: published() == [KEEP])  # while the job still holds the lock
        assert rt.cache.warm_models() == [GOING, KEEP]  # resident until the job ends
        rt.record_warm()  # what the job publishes as it ends
        assert published() == [KEEP]
    finally:
        rt.cache_lock.release()
    try:
        # dropped once the lock is free, and no longer held back from publication: the follower
        # sets both under the cache lock, one after the other, so wait for both
        assert until(lambda: rt.cache.warm_models() == [KEEP] and rt.retired == frozenset())
        assert published() == [KEEP]
    finally:
        stop.set()
        follower.join(timeout=5)
