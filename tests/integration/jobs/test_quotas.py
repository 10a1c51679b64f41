"""Per-key quotas on a real Redis and journal, through ``Dispatcher.submit``: both
limits, their Retry-After and journaled refusals, concurrent submissions under the fleet lock
(R14), and ``homefleet keys``' figures, on SQLite and on PostgreSQL. No worker runs: jobs stay queued unless a test
claims
and ends them through the journal, as a worker's reports would."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from app.context import ServerContext, build_context
from app.core.config import Settings
from app.core.errors import QuotaExceeded
from app.core.limits import KeyQuota
from app.core.states import JobState
from tests.helpers import bring_online, make_fleet

CI_KEYS = ["ci-key-0123456789abcdef", "ci-key-fedcba9876543210"]
GPU_KEY = "gpu-key-0123456789abcdef"
FREE_KEY = "free-key-0123456789abcdef"
QUOTAS = {
    "ci": KeyQuota(key_prefix="ci-key-", max_queued_jobs=3),
    "gpu": KeyQuota(key_prefix="gpu-key-", max_gpu_seconds_per_hour=100),
}


@pytest.fixture
def quota_ctx(sql_settings: Settings, tiny_models_dir: Path) -> Iterator[tuple[ServerContext, str]]:
    """A fleet whose keys have quotas, its journal on SQLite then PostgreSQL (the check is SQL)."""
    settings = Settings(
        **{
            **sql_settings.model_dump(),
            "api_keys": [*CI_KEYS, GPU_KEY, FREE_KEY],
            "api_key_quotas": {name: quota.model_dump() for name, quota in QUOTAS.items()},
            "retry_after_s": 4,
        }
    )
    context = build_context(settings, make_fleet("m1", "m2"), migrate=True)
    try:
        model = context.registry.add(tiny_models_dir / "tiny-sd").id
        bring_online(context, "m1", {model})
        bring_online(context, "m2", {model})
        yield context, model
    finally:
        context.close()


def submit(ctx: ServerContext, model: str, key: str, target: str = "m1", prompt: str = "x") -> str:
    return ctx.dispatcher.submit(
        model, "txt2img", {"prompt": prompt}, target, api_key_id=ctx.settings.api_key_id(key)
    ).job.id


def ended(ctx: ServerContext, job_id: str, ago_s: float, load_s: float | None, run_s: float | None) -> None:
    """Claim ``job_id`` and end it ``succeeded`` ``ago_s`` seconds ago with these timings, as its
    worker's reports would; its reservation is released."""
    ctx.journal.claim(job_id, "m1")
    at = datetime.now(UTC) - timedelta(seconds=ago_s)
    ctx.endings.finished(ctx.journal.succeed(job_id, "m1", load_s=load_s, run_s=run_s, finished_at=at))


def test_max_queued_jobs_counts_queued_and_running_jobs_of_all_the_keys_of_the_quota(
    quota_ctx: tuple[ServerContext, str],
) -> None:
    ctx, model = quota_ctx
    first = [submit(ctx, model, CI_KEYS[i % 2], target=("m1", "m2")[i % 2]) for i in range(3)]  # two keys, one quota
    ctx.journal.claim(first[0], "m1")  # running: still counts
    with pytest.raises(QuotaExceeded) as refused:
        submit(ctx, model, CI_KEYS[1], prompt="fourth")
    error = refused.value
    assert (error.status_code, error.reason, error.retry_after_s) == (429, "quota_queued", 4)
    assert error.message == (
        "api key 'ci' is over its quota max_queued_jobs=3 (3 queued or running); retry once one of its jobs has ended"
    )
    rejected = ctx.journal.get(str(error.job_id))
    assert (rejected.state, rejected.reason, rejected.api_key_id, rejected.machine) == (
        JobState.rejected,
        "quota_queued",
        "ci",
        None,
    )
    assert rejected.params["prompt"] == "fourth" and rejected.message == error.message
    assert ctx.redis.llen(ctx.keys.queue_list("m1")) + ctx.redis.llen(ctx.keys.queue_list("m2")) == 3
    assert [ctx.journal.get(j).api_key_id for j in first] == ["ci"] * 3  # the quota's name, never a key
    # Other keys are not limited by it; a key under no quota is journaled under its digest.
    free = ctx.journal.get(submit(ctx, model, FREE_KEY))
    assert free.state == JobState.queued and free.api_key_id == ctx.settings.api_key_id(FREE_KEY)
    assert free.api_key_id.startswith("key:") and FREE_KEY not in free.api_key_id
    # A job of the key ends (cancelled here): the next submission passes, and only one.
    ctx.dispatcher.cancel(first[1])
    submit(ctx, model, CI_KEYS[0], prompt="after")
    with pytest.raises(QuotaExceeded):
        submit(ctx, model, CI_KEYS[0], prompt="again")
    assert ctx.journal.count_active_of_key("ci") == 3


def test_concurrent_submissions_cannot_pass_the_queued_quota_together(quota_ctx: tuple[ServerContext, str]) -> None:
    ctx, model = quota_ctx
    start = threading.Barrier(12)

    def attempt(index: int) -> str:
        start.wait()
        try:
            return submit(ctx, model, CI_KEYS[index % 2], target=("m1", "m2")[index % 2], prompt=f"p{index}")
        except QuotaExceeded as refused:
            return refused.reason

    with ThreadPoolExecutor(12) as pool:
        outcomes = list(pool.map(attempt, range(12)))
    accepted = [o for o in outcomes if o != "quota_queued"]
    assert len(accepted) == 3 and outcomes.count("quota_queued") == 9
    assert sorted(j.id for j in ctx.journal.list([JobState.queued])) == sorted(accepted)
    assert [j.reason for j in ctx.journal.list([JobState.rejected])] == ["quota_queued"] * 9
    queued = ctx.redis.llen(ctx.keys.queue_list("m1")) + ctx.redis.llen(ctx.keys.queue_list("m2"))
    reserved = len(ctx.machines.reservations.records("m1")) + len(ctx.machines.reservations.records("m2"))
    assert (queued, reserved) == (3, 3)


def test_max_gpu_seconds_counts_the_last_hours_ended_jobs_and_says_when_enough_has_expired(
    quota_ctx: tuple[ServerContext, str],
) -> None:
    ctx, model = quota_ctx
    old, a, b, c = (submit(ctx, model, GPU_KEY, prompt=p) for p in ("old", "a", "b", "c"))
    ended(ctx, old, ago_s=3700, load_s=0.0, run_s=900.0)  # ended over an hour ago: not counted
    ended(ctx, a, ago_s=3000, load_s=10.0, run_s=30.0)  # 40 s, leaves the window in 600 s
    ended(ctx, b, ago_s=1000, load_s=None, run_s=59.0)  # 59 s: 99 in all, under 100
    submit(ctx, model, GPU_KEY, prompt="under")  # 99 < 100: accepted
    # c held its machine 5 s and was interrupted (no timings reported): its claim-to-end counts.
    ctx.journal.transition(
        c, [JobState.queued], JobState.running, machine="m1", started_at=datetime.now(UTC) - timedelta(seconds=5)
    )  # claimed 5 s ago
    ctx.endings.finished(ctx.journal.interrupt(c, [JobState.running], "worker_lost", "no heartbeat"))
    before = time.time()
    with pytest.raises(QuotaExceeded) as refused:
        submit(ctx, model, GPU_KEY, prompt="over")
    error = refused.value
    assert (error.status_code, error.reason) == (429, "quota_gpu_seconds")
    # 40 + 59 + ~5 >= 100; once a's 40 s leave (in 600 s), 64 < 100.
    assert 599 <= error.retry_after_s <= 601, error.retry_after_s
    assert error.message.startswith("api key 'gpu' is over its quota max_gpu_seconds_per_hour=100 (104.")
    assert "GPU-seconds used by its jobs that ended in the last 3600 s); retry in" in error.message
    rejected = ctx.journal.get(str(error.job_id))
    assert (rejected.state, rejected.reason, rejected.api_key_id) == (JobState.rejected, "quota_gpu_seconds", "gpu")
    # The rolling hour moves on: seen 601 s later, a's usage has left and the key is under its limit.
    ctx.dispatcher.quotas.check("gpu", now_s=before + 601)
    with pytest.raises(QuotaExceeded):
        ctx.dispatcher.quotas.check("gpu", now_s=before + 590)
    # A key under no quota, or no key at all (open API, the server's own jobs), is never refused.
    ctx.dispatcher.quotas.check(None)
    ctx.dispatcher.quotas.check(ctx.settings.api_key_id(FREE_KEY))


def test_keys_figures_per_key_queued_running_gpu_seconds_and_limits(quota_ctx: tuple[ServerContext, str]) -> None:
    ctx, model = quota_ctx
    queued = [submit(ctx, model, CI_KEYS[0], prompt=p) for p in "ab"]
    ctx.journal.claim(queued[0], "m1")
    done = submit(ctx, model, GPU_KEY)
    ended(ctx, done, ago_s=10, load_s=1.25, run_s=2.5)
    free_id = ctx.settings.api_key_id(FREE_KEY)
    rows = {row.key_id: row.as_dict() for row in ctx.dispatcher.quotas.by_key()}
    assert list(rows) == ["ci", "gpu", free_id]  # quota names in configuration order, then the unnamed keys
    assert rows["ci"] == {
        "key_id": "ci",
        "keys": 2,
        "queued": 1,
        "running": 1,
        "gpu_s_last_hour": 0.0,
        "max_queued_jobs": 3,
        "max_gpu_seconds_per_hour": None,
    }
    assert rows["gpu"] == {
        "key_id": "gpu",
        "keys": 1,
        "queued": 0,
        "running": 0,
        "gpu_s_last_hour": 3.75,
        "max_queued_jobs": None,
        "max_gpu_seconds_per_hour": 100.0,
    }
    assert rows[free_id]["keys"] == 1 and rows[free_id]["max_queued_jobs"] is None
