"""A claim that the journal took while the server's Redis failed under it (R19; found by the
``redis_restart`` drill in CI): the server answers 503 ``redis_down`` after the journal's
``queued -> running``, and the same delivery claims again with its claim id once Redis is
back, getting the job. Before, the worker gave the delivery up at the 503 and the job stayed
``running`` with nobody running it until reconciliation judged its worker lost minutes later.
Real parts: the API served by uvicorn, a private redis-server stopped and started again on its
port, the journal, the worker's ``ServerClient``."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from app.context import ServerContext, build_context
from app.core.config import Settings
from app.core.errors import HomefleetError
from app.core.states import JobState
from app.devtools.redis_server import RedisProcess, free_port, start_redis_server
from tasks.server_client import ServerClient
from tests.helpers import bring_online, make_fleet, served_api


@pytest.fixture
def outage(tmp_path: Path, settings: Settings) -> Iterator[tuple[str, ServerContext, RedisProcess, int]]:
    """The real API on a free port over a Redis of its own (stopped and started by the test)."""
    port = free_port()
    redis_process = start_redis_server(tmp_path / "redis", port=port)
    settings = settings.model_copy(update={"redis_url": redis_process.url})
    ctx = build_context(settings, make_fleet("m1"), migrate=True)
    try:
        with served_api(ctx) as url:
            yield url, ctx, redis_process, port
    finally:
        ctx.close()
        redis_process.stop()


def test_r19_a_claim_answered_503_by_a_redis_outage_is_taken_again_by_the_same_delivery(
    outage: tuple[str, ServerContext, RedisProcess, int], tmp_path: Path, tiny_models_dir: Path
) -> None:
    url, ctx, redis_process, port = outage
    model = ctx.registry.add(tiny_models_dir / "tiny-sd").id
    bring_online(ctx, "m1", {model})
    job_id = ctx.dispatcher.submit(model, "txt2img", {"prompt": "during an outage"}, "m1").job.id
    token = ctx.fleet.machines["m1"].token

    redis_process.stop()  # the journal answers, Redis does not
    # Each request may take 30 s: the server's Redis client gives up on its own retries first,
    # which on a starved host (taskset -c 0) took longer than 5 s
    impatient = ServerClient(url, token, 30.0, machine="m1")  # retry_s=0: one attempt
    with pytest.raises(HomefleetError) as refused:
        impatient.claim(job_id, claim_id="delivery-1")
    assert (refused.value.status_code, refused.value.reason) == (503, "redis_down")
    assert ctx.journal.get(job_id).state == JobState.running  # the journal took it before Redis failed

    restarted: list[RedisProcess] = []
    restart = threading.Timer(1.5, lambda: restarted.append(start_redis_server(tmp_path / "redis2", port=port)))
    restart.start()
    patient = ServerClient(url, token, 30.0, retry_s=30, machine="m1")  # the worker's: server_retry_s
    try:
        started_s = time.monotonic()
        claim = patient.claim(job_id, claim_id="delivery-1")  # 503s until Redis is back, then the job
        assert claim.job_id == job_id and claim.manifest.model_id == model
        assert time.monotonic() - started_s >= 1.0  # it did wait for Redis
        job = ctx.journal.get(job_id)
        assert (job.state, job.claim_id) == (JobState.running, "delivery-1")
        with pytest.raises(HomefleetError) as other:  # another delivery is still refused
            patient.claim(job_id, claim_id="delivery-2")
        assert other.value.status_code == 409
        assert [e.event for e in ctx.journal.events(job_id)].count("running") == 1
    finally:
        # the API's client may reconnect before start_redis_server returns: wait for it, or the
        # restarted server would outlive the test
        restart.join()
        for process in restarted:
            process.stop()
