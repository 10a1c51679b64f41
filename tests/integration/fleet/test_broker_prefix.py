"""A broker key prefix (kombu's ``global_keyprefix``), set in one setting
(``broker_key_prefix``), is where the server publishes and where status, cancel and
reconciliation read: the machines' lists and kombu's unacked hash are under it, and nothing is
published outside it (R8, R19). Real Redis and journal; the worker's side in
tests/e2e/test_broker.py and the drills."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from app.context import ServerContext, build_context
from app.core.celery_app import create_celery
from app.core.config import Settings
from app.core.secret_files import write_private
from app.core.states import JobState
from tests.helpers import bring_online, make_fleet, run_cli, settings_env

PREFIX = "app2:"


@pytest.fixture
def prefixed(settings: Settings, tmp_path: Path) -> Iterator[ServerContext]:
    fleet = make_fleet("m1")
    fleet_file = tmp_path / "fleet.toml"
    write_private(fleet_file, fleet.to_toml())  # for the CLI
    context = build_context(
        settings.model_copy(update={"broker_key_prefix": PREFIX, "lost_grace_s": 0.0, "fleet_file": fleet_file}),
        fleet,
        migrate=True,
    )
    context.pairing.check()  # the server's journal, as `serve` records it
    context.redis.set(context.keys.redis_seen(), time.time() - 3600)  # a Redis it knows
    yield context
    context.close()


def submit(ctx: ServerContext, model: str) -> str:
    return ctx.dispatcher.submit(model, "txt2img", {"prompt": "x"}, "m1").job.id


def test_the_prefix_is_one_setting_that_the_celery_app_and_the_keys_share(settings: Settings) -> None:
    tuned = settings.model_copy(update={"broker_key_prefix": PREFIX})
    assert create_celery(tuned).conf.broker_transport_options["global_keyprefix"] == PREFIX  # workers, CLI, Flower
    with pytest.raises(ValueError, match="broker_key_prefix"):
        Settings(broker_key_prefix="with space")


def test_r8_under_a_prefix_jobs_are_published_counted_cancelled_and_reconciled_at_the_exact_key(
    prefixed: ServerContext, tiny_models_dir: Path
) -> None:
    ctx = prefixed
    model = ctx.registry.add(tiny_models_dir / "tiny-sd").id
    bring_online(ctx, "m1", {model})
    jobs = [submit(ctx, model) for _ in range(3)]
    assert ctx.keys.queue_list("m1") == "app2:machine.m1"
    assert ctx.redis.llen("app2:machine.m1") == 3 and not ctx.redis.exists("machine.m1")
    row = {r["name"]: r for r in ctx.status()}["m1"]
    assert (row["queued"], row["running"]) == (3, 0) == (ctx.redis.llen("app2:machine.m1"), 0)
    assert ctx.queues.queued_ids("m1") == jobs

    ctx.dispatcher.cancel(jobs[2])  # removed from the prefixed list
    assert ctx.queues.queued_ids("m1") == jobs[:2]

    # A message delivered and unacked sits in the prefixed unacked hash: reconciliation sees it.
    raw = ctx.redis.rpop("app2:machine.m1")
    ctx.redis.hset("app2:unacked", "tag-1", json.dumps([json.loads(raw), "machine.m1", "machine.m1"]))
    assert ctx.keys.unacked() == "app2:unacked" and ctx.queues.unacked_ids() == {jobs[0]}
    report = ctx.reconciler().run_once()
    assert (report.cancelled, report.interrupted) == ({}, {})
    assert ctx.journal.get(jobs[0]).state == JobState.queued

    ctx.redis.delete("app2:unacked", "app2:machine.m1")  # purged, Redis kept its data
    assert ctx.reconciler().run_once().cancelled == {jobs[0]: "purged", jobs[1]: "purged"}


def test_r19_under_a_prefix_redis_data_loss_republishes_to_the_prefixed_list(
    prefixed: ServerContext, tiny_models_dir: Path
) -> None:
    ctx = prefixed
    model = ctx.registry.add(tiny_models_dir / "tiny-sd").id
    bring_online(ctx, "m1", {model})
    jobs = [submit(ctx, model) for _ in range(2)]
    ctx.redis.flushdb()
    report = ctx.reconciler().run_once()
    assert report.requeued == jobs
    assert ctx.queues.queued_ids("m1") == jobs and ctx.redis.llen("app2:machine.m1") == 2
    assert not ctx.redis.exists("machine.m1")


def test_r19_homefleet_purge_ends_the_queued_jobs_cancelled_as_purged_at_once(
    prefixed: ServerContext, tiny_models_dir: Path
) -> None:
    """``homefleet purge MACHINE`` (here under a broker prefix) cancels every queued
    job there, journal first, reason ``purged``, with a message saying its queue was purged."""
    ctx = prefixed
    model = ctx.registry.add(tiny_models_dir / "tiny-sd").id
    bring_online(ctx, "m1", {model})
    jobs = [submit(ctx, model) for _ in range(2)]
    shown = run_cli("purge", "m1", "--yes", env=settings_env(ctx.settings)).stdout
    assert "m1: purged 2 queued jobs" in shown and all(job in shown for job in jobs)
    for job_id in jobs:
        job = ctx.journal.get(job_id)
        assert (job.state, job.reason) == (JobState.cancelled, "purged")
        assert "its queue machine.m1 was purged" in (job.message or "")
    assert ctx.queues.length("m1") == 0 and ctx.machines.reservations.count("m1") == 0
