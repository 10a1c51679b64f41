"""Reconciliation (R19): cut ways are marked ``interrupted`` — never re-run — and
nothing vanishes silently. Real Redis and journal; the worker side is what a worker writes."""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import redis

from app.context import ServerContext, build_context
from app.core.config import Settings
from app.core.errors import ConfigError, MachineUnavailable
from app.core.secret_files import write_private
from app.core.states import JobState
from app.db.tables import Job, utcnow
from app.devtools.redis_server import free_port, start_redis_server
from app.jobs.reconcile import ReconcileLoop
from tests.helpers import bring_online, make_fleet, run_cli, settings_env


def known_redis(ctx: ServerContext) -> None:
    """As after the server's reconciliation has run for an hour with this Redis (it kept its data)."""
    ctx.redis.set(ctx.keys.redis_seen(), time.time() - 3600)


@pytest.fixture
def strict_ctx(settings: Settings) -> Iterator[ServerContext]:
    """A context whose reconciliation has no grace and a 2 s hung bound, on a Redis it knows."""
    tight = settings.model_copy(update={"lost_grace_s": 0.0, "hung_after_s": 2.0})
    context = build_context(tight, make_fleet("m1", "m2"), migrate=True)
    known_redis(context)
    yield context
    context.close()


def submit(ctx: ServerContext, model: str, target: str = "m1") -> str:
    return ctx.dispatcher.submit(model, "txt2img", {"prompt": "x"}, target).job.id


def beat(ctx: ServerContext, machine: str, boot_id: str, at_s: float | None = None) -> None:
    record = {"machine": machine, "boot_id": boot_id, "at": time.time() if at_s is None else at_s}
    ctx.redis.set(ctx.keys.heartbeat(machine), json.dumps(record), ex=60)


def test_r19_a_queued_job_whose_message_was_removed_from_its_queue_is_cancelled_as_purged(
    strict_ctx: ServerContext, tiny_models_dir: Path
) -> None:
    """A purge (the list deleted, as ``celery purge`` does) while Redis kept its data
    is reported as a purge, not as a Redis restart."""
    ctx = strict_ctx
    model = ctx.registry.add(tiny_models_dir / "tiny-sd").id
    bring_online(ctx, "m1", {model})
    bring_online(ctx, "m2", {model})
    purged, kept = submit(ctx, model, "m1"), submit(ctx, model, "m2")
    ctx.redis.delete(ctx.keys.queue_list("m1"))
    report = ctx.reconciler().run_once()
    assert (report.cancelled, report.interrupted, report.requeued) == ({purged: "purged"}, {}, [])
    job = ctx.journal.get(purged)
    assert (job.state, job.reason) == (JobState.cancelled, "purged")
    assert "removed from the queue machine.m1" in (job.message or "") and "Redis" not in (job.message or "")
    assert ctx.journal.get(kept).state == JobState.queued
    assert ctx.machines.reservations.count("m1") == 0 and ctx.machines.reservations.count("m2") == 1  # released (R14)
    assert ctx.reconciler().run_once().cancelled == {}  # idempotent


def test_r19_a_queued_job_its_server_never_reserved_nor_published_is_published_in_journal_order(
    strict_ctx: ServerContext, tiny_models_dir: Path
) -> None:
    """A server killed after journaling a job and before reserving and publishing it leaves a
    ``queued`` job with neither a reservation nor a message. With standby servers its client
    holds a 202 for it (a retry with the same Idempotency-Key on the other server is answered
    with it, R20), so reconciliation publishes it, ahead of the machine's later jobs (R8),
    instead of cancelling it as a purge (a purge leaves the reservation)."""
    ctx = strict_ctx
    model = ctx.registry.add(tiny_models_dir / "tiny-sd").id
    bring_online(ctx, "m1", {model})
    unpublished, later = submit(ctx, model, "m1"), submit(ctx, model, "m1")
    ctx.queues.remove("m1", unpublished)  # as if it had never been published...
    assert ctx.machines.reservations.release("m1", unpublished)  # ...nor reserved
    report = ctx.reconciler().run_once()
    assert (report.cancelled, report.interrupted, report.requeued) == ({}, {}, [unpublished])
    assert ctx.journal.get(unpublished).state == JobState.queued
    assert ctx.queues.queued_ids("m1") == [unpublished, later]
    assert [job_id for job_id, _ in ctx.machines.reservations.records("m1")] == [later, unpublished]
    assert any(
        event.event == "requeued" and "stopped before publishing" in event.detail
        for event in ctx.journal.events(unpublished)
    )
    again = ctx.reconciler().run_once()  # idempotent: its message is there now
    assert (again.cancelled, again.requeued) == ({}, [])


def test_r19_a_message_a_worker_took_and_never_claimed_is_lost(
    strict_ctx: ServerContext, tiny_models_dir: Path
) -> None:
    """The message reached a worker (its delivery mark, written before the ack) that stopped
    before claiming the job: ``interrupted`` (``lost``), not a purge."""
    ctx = strict_ctx
    model = ctx.registry.add(tiny_models_dir / "tiny-sd").id
    bring_online(ctx, "m1", {model})
    job = submit(ctx, model, "m1")
    ctx.redis.rpop(ctx.keys.queue_list("m1"))
    ctx.redis.set(ctx.keys.delivered(job), "m1", ex=60)
    assert ctx.reconciler().run_once().interrupted == {job: "lost"}
    message = ctx.journal.get(job).message or ""
    assert "delivered to m1's worker, which stopped before claiming it" in message
    assert f"homefleet jobs requeue {job}" in message  # what the operator can do, as for worker_lost


def test_r19_after_redis_lost_its_data_queued_jobs_are_published_again_in_journal_order_ahead_of_newer_ones(
    strict_ctx: ServerContext, tiny_models_dir: Path
) -> None:
    """Redis restarted without persistence (here: flushed). The journal's queued jobs
    are published again, oldest first, ahead of a job submitted since; their reservations are
    written again in journal order; a second pass publishes nothing more."""
    ctx = strict_ctx
    model = ctx.registry.add(tiny_models_dir / "tiny-sd").id
    bring_online(ctx, "m1", {model})
    older = [submit(ctx, model, "m1") for _ in range(3)]
    ctx.redis.flushdb()
    bring_online(ctx, "m1", {model})
    newer = submit(ctx, model, "m1")  # placed before reconciliation saw the loss
    report = ctx.reconciler().run_once()
    assert report.redis_lost and report.requeued == older and report.interrupted == {} == report.cancelled
    assert ctx.queues.queued_ids("m1") == [*older, newer]  # the order the worker takes them
    assert ctx.queues.length("m1") == 4
    assert [job_id for job_id, _ in ctx.machines.reservations.records("m1")] == [*older, newer]
    again = ctx.reconciler().run_once()
    assert (again.redis_lost, again.requeued) == (False, [])
    assert ctx.queues.queued_ids("m1") == [*older, newer]
    assert "published 3 queued jobs again" in str(report)


def test_a_drain_outlives_a_redis_that_lost_its_data_and_its_undo_does_too(
    strict_ctx: ServerContext, tiny_models_dir: Path, tmp_path: Path
) -> None:
    """An operator drained m1 (`homefleet drain m1`, before maintenance) and Redis lost its data
    (restarted without persistence; here flushed). The drain lived only in Redis: m1 took pinned
    jobs (and Auto's) again without a word. Reconciliation now writes the flag back from the
    journal's database, as it does residency commitments; `drain --undo` is durable alike."""
    ctx = strict_ctx
    model = ctx.registry.add(tiny_models_dir / "tiny-sd").id
    bring_online(ctx, "m1", {model})
    fleet_file = tmp_path / "fleet.toml"
    write_private(fleet_file, ctx.fleet.to_toml())
    operator = {**settings_env(ctx.settings), "HOMEFLEET_FLEET_FILE": str(fleet_file)}
    run_cli("drain", "m1", env=operator)
    ctx.redis.flushdb()
    bring_online(ctx, "m1", {model})
    report = ctx.reconciler().run_once()
    with pytest.raises(MachineUnavailable) as refused:
        submit(ctx, model, "m1")
    assert refused.value.reason == "machine_draining"
    assert report.drains_restored == ["m1"] and "drained again: m1" in str(report)
    assert ctx.reconciler().run_once().drains_restored == []  # written once

    run_cli("drain", "m1", "--undo", env=operator)
    ctx.redis.flushdb()
    bring_online(ctx, "m1", {model})
    assert ctx.reconciler().run_once().drains_restored == []
    assert ctx.journal.get(submit(ctx, model, "m1")).state == JobState.queued


def test_r19_a_redis_that_lost_its_data_gives_workers_time_to_beat_again_before_judging_them(
    strict_ctx: ServerContext, tiny_models_dir: Path
) -> None:
    """A Redis restart loses no running job (2 of 8 Redis restarts once marked a running job
    ``worker_lost`` while its worker ran it): the heartbeat and the progress record are lost with
    the data, and the worker writes its lease, then its heartbeat, again only at its next beats. No
    worker is judged until it had ``heartbeat_ttl_s`` since reconciliation saw the loss."""
    ctx = strict_ctx
    job = running_on_m1(ctx, tiny_models_dir, boot_id="boot-A")
    ctx.redis.flushdb()  # heartbeat, lease and progress gone; the worker still runs the job
    report = ctx.reconciler().run_once()
    assert report.redis_lost and report.interrupted == {} and report.requeued == []
    assert ctx.journal.get(job).state == JobState.running
    assert ctx.machines.reservations.records("m1")[0][0] == job  # its reservation is back, running
    assert ctx.reconciler().run_once().interrupted == {}  # still within heartbeat_ttl_s
    beat(ctx, "m1", "boot-A")  # it beats again: left alone for good
    ctx.redis.set(ctx.keys.redis_seen(), time.time() - ctx.settings.heartbeat_ttl_s - 1)
    assert ctx.reconciler().run_once().interrupted == {}
    ctx.redis.delete(ctx.keys.heartbeat("m1"))  # a worker that never came back is judged after the grace
    assert ctx.reconciler().run_once().interrupted == {job: "worker_lost"}


def test_r19_after_a_redis_restart_that_kept_its_data_workers_get_time_to_beat_again(
    settings: Settings, tiny_models_dir: Path, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """Redis stopped with its data saved and started again: the heartbeat keys whose TTL ran out
    meanwhile are gone, the marker ``redis_seen`` is kept. The reconciler's passes failed while
    Redis was down, so no worker is judged lost until ``heartbeat_ttl_s`` after it answered
    again (a live worker beats again meanwhile); one that never beats again is then."""
    port = free_port()
    own = start_redis_server(tmp_path / "redis", port=port)
    servers = [own]
    request.addfinalizer(lambda: servers[-1].stop())
    tight = settings.model_copy(update={"redis_url": own.url, "lost_grace_s": 0.0, "hung_after_s": 600.0})
    ctx = build_context(tight, make_fleet("m1", "m2"), migrate=True)
    request.addfinalizer(ctx.close)
    known_redis(ctx)
    job = running_on_m1(ctx, tiny_models_dir, boot_id="boot-A")
    bring_online(ctx, "m2")  # its heartbeat outlives the outage: not every one lapsed
    ctx.redis.hset(ctx.keys.progress(job), "at", time.time() - ctx.settings.heartbeat_ttl_s - 1)  # a long step
    record = {"machine": "m1", "boot_id": "boot-A", "at": time.time()}
    ctx.redis.set(ctx.keys.heartbeat("m1"), json.dumps(record), px=1500)  # expires while Redis is down
    expires = time.time() + 1.5
    reconciler = ctx.reconciler()  # the server's loop: one reconciler for every pass
    assert reconciler.run_once().interrupted == {}
    ctx.redis.save()  # `redis-cli shutdown save`
    own.stop()
    with pytest.raises((redis.ConnectionError, redis.TimeoutError)):
        reconciler.run_once()
    time.sleep(max(0.0, expires - time.time()) + 0.2)
    servers.append(start_redis_server(tmp_path / "redis", port=port))  # the same dump
    assert ctx.redis.exists(ctx.keys.redis_seen()) and not ctx.redis.exists(ctx.keys.heartbeat("m1"))
    # as a Redis that keeps its replication id across a restart, or refuses INFO: only the
    # failed passes tell of the outage
    ctx.redis.delete(ctx.keys.redis_replid())
    answered = time.time()
    report = reconciler.run_once()
    assert report.interrupted == {} and not report.redis_lost
    assert ctx.journal.get(job).state == JobState.running
    assert float(ctx.redis.get(ctx.keys.redis_seen()) or 0) >= answered - 1  # the grace counts from now
    assert ctx.reconciler().run_once().interrupted == {}  # any reconciler's pass keeps the grace
    ctx.redis.set(ctx.keys.redis_seen(), time.time() - ctx.settings.heartbeat_ttl_s - 1)  # as the grace later
    assert reconciler.run_once().interrupted == {job: "worker_lost"}  # it never beat again


def test_r19_when_every_live_heartbeat_lapses_at_once_workers_get_time_to_beat_again(
    settings: Settings, tiny_models_dir: Path, request: pytest.FixtureRequest
) -> None:
    """Every heartbeat the last pass found live is gone at the next (Redis paused, or the host
    asleep, longer than heartbeat_ttl_s while no pass failed): Redis was out of reach for every
    worker, so none is judged lost within heartbeat_ttl_s; a worker that beats again is left
    alone after it."""
    ctx = build_context(settings.model_copy(update={"hung_after_s": 600.0}), make_fleet("m1", "m2"), migrate=True)
    request.addfinalizer(ctx.close)
    known_redis(ctx)
    job = running_on_m1(ctx, tiny_models_dir, boot_id="boot-A")
    ctx.redis.hset(ctx.keys.progress(job), "at", time.time() - ctx.settings.heartbeat_ttl_s - 1)
    beat(ctx, "m1", "boot-A")
    beat(ctx, "m2", "boot-B")
    reconciler = ctx.reconciler()
    assert reconciler.run_once().interrupted == {}
    ctx.redis.delete(ctx.keys.heartbeat("m1"), ctx.keys.heartbeat("m2"))  # expired together
    assert reconciler.run_once().interrupted == {}
    assert ctx.journal.get(job).state == JobState.running
    beat(ctx, "m1", "boot-A")  # it beats again within the grace
    ctx.redis.set(ctx.keys.redis_seen(), time.time() - ctx.settings.heartbeat_ttl_s - 1)
    assert reconciler.run_once().interrupted == {}
    assert ctx.journal.get(job).state == JobState.running


def test_r19_a_missing_message_gets_a_grace_period(
    settings: Settings, tiny_models_dir: Path, request: pytest.FixtureRequest
) -> None:
    ctx = build_context(settings.model_copy(update={"lost_grace_s": 30.0}), make_fleet("m1"), migrate=True)
    request.addfinalizer(ctx.close)
    known_redis(ctx)
    model = ctx.registry.add(tiny_models_dir / "tiny-sd").id
    bring_online(ctx, "m1", {model})
    job = submit(ctx, model)
    ctx.redis.delete(ctx.keys.queue_list("m1"))
    assert ctx.reconciler().run_once().interrupted == {}
    assert ctx.journal.get(job).state == JobState.queued  # a worker may be between BRPOP and claim
    ctx.redis.hset(ctx.keys.missing(), job, time.time() - 31)
    assert ctx.reconciler().run_once().cancelled == {job: "purged"}


@pytest.mark.parametrize(
    ("heartbeat_boot", "progress_age_s", "reason"),
    [(None, 10, "worker_lost"), ("boot-B", 0, "worker_restarted"), ("boot-A", 10, "hung")],
)
def test_r19_a_running_job_whose_worker_is_gone_restarted_or_hung_is_interrupted(
    strict_ctx: ServerContext, tiny_models_dir: Path, heartbeat_boot: str | None, progress_age_s: float, reason: str
) -> None:
    ctx = strict_ctx
    model = ctx.registry.add(tiny_models_dir / "tiny-sd").id
    bring_online(ctx, "m1", {model})
    job = submit(ctx, model)
    ctx.redis.rpop(ctx.keys.queue_list("m1"))  # the worker took the message...
    ctx.journal.claim(job, "m1", worker_boot_id="boot-A")  # ...and claimed it
    ctx.redis.hset(ctx.keys.progress(job), "at", time.time() - progress_age_s)
    ctx.redis.delete(ctx.keys.heartbeat("m1"))
    if heartbeat_boot is not None:
        beat(ctx, "m1", heartbeat_boot)
    assert ctx.reconciler().run_once().interrupted == {job: reason}
    ended = ctx.journal.get(job)
    assert ended.state == JobState.interrupted
    if reason == "worker_lost":  # claimed: it had started, and says it will not run again by itself
        assert ended.message is not None and "the job had started there" in ended.message
        assert "not run again by itself" in ended.message
        assert f"`homefleet jobs requeue {job}`" in ended.message  # what to do about it, with the job's id
    assert ctx.machines.reservations.count("m1") == 0  # released when it ended (R14)
    assert (ctx.redis.get(ctx.keys.restart("m1")) == job) == (reason == "hung")  # watchdog restarts the pool
    assert ctx.redis.llen(ctx.keys.queue_list("m1")) == 0  # never re-queued


def test_r19_a_running_job_whose_worker_stopped_for_a_refused_token_is_interrupted_in_its_words(
    strict_ctx: ServerContext, tiny_models_dir: Path
) -> None:
    """The machine's token changed by hand in the fleet file: the worker's progress report got
    401, it stopped the run, marked the job (``Keys.token_refused``) and exited. The job ends
    ``token_refused`` with the worker's words, not a bare ``worker_lost``; never re-queued."""
    ctx = strict_ctx
    job = running_on_m1(ctx, tiny_models_dir, boot_id="boot-A")
    ctx.redis.hset(ctx.keys.progress(job), "at", time.time() - 10)
    ctx.redis.delete(ctx.keys.heartbeat("m1"))
    words = "m1's worker stopped the job: the server refused that worker's token at its progress report (unknown token)"
    ctx.redis.set(ctx.keys.token_refused(job), words)
    assert ctx.reconciler().run_once().interrupted == {job: "token_refused"}
    ended = ctx.journal.get(job)
    assert (ended.state, ended.reason) == (JobState.interrupted, "token_refused")
    assert ended.message is not None and ended.message.startswith(words + ", and stopped; the job had started there")
    assert ctx.redis.llen(ctx.keys.queue_list("m1")) == 0  # never re-queued


def running_on_m1(ctx: ServerContext, tiny_models_dir: Path, boot_id: str) -> str:
    """A job submitted to m1, taken off its queue and claimed by the worker of ``boot_id``."""
    model = ctx.registry.add(tiny_models_dir / "tiny-sd").id
    bring_online(ctx, "m1", {model})
    job = submit(ctx, model)
    ctx.redis.rpop(ctx.keys.queue_list("m1"))
    ctx.journal.claim(job, "m1", worker_boot_id=boot_id)
    return job


def test_r19_a_running_job_with_a_live_worker_is_left_alone(strict_ctx: ServerContext, tiny_models_dir: Path) -> None:
    ctx = strict_ctx
    job = running_on_m1(ctx, tiny_models_dir, boot_id="boot-A")
    ctx.redis.hset(ctx.keys.progress(job), "at", time.time())
    beat(ctx, "m1", "boot-A")
    assert ctx.reconciler().run_once().interrupted == {}
    assert ctx.journal.get(job).state == JobState.running


def test_r20_idempotency_keys_are_kept_a_day_then_forgotten(ctx: ServerContext, tiny_models_dir: Path) -> None:
    model = ctx.registry.add(tiny_models_dir / "tiny-sd").id
    old = ctx.journal.add(
        Job(
            state=JobState.rejected,
            model_id=model,
            kind="txt2img",
            target="server",
            idempotency_key="old",
            created_at=utcnow() - timedelta(hours=25),
        )
    )
    ctx.journal.add(
        Job(
            state=JobState.rejected,
            model_id=model,
            kind="txt2img",
            target="server",
            idempotency_key="recent",
            created_at=utcnow() - timedelta(hours=23),
        )
    )
    assert ctx.reconciler().run_once().forgotten_idempotency_keys == 1
    assert ctx.journal.by_idempotency_key("old") is None
    assert ctx.journal.by_idempotency_key("recent") is not None
    assert ctx.journal.get(old.id).state == JobState.rejected


def test_r19_a_worker_whose_heartbeat_lapses_while_steps_still_report_is_not_lost(
    strict_ctx: ServerContext, tiny_models_dir: Path
) -> None:
    ctx = strict_ctx
    job = running_on_m1(ctx, tiny_models_dir, boot_id="boot-A")
    ctx.redis.delete(ctx.keys.heartbeat("m1"))  # e.g. its heartbeat thread starved of CPU
    ctx.redis.hset(ctx.keys.progress(job), "at", time.time())  # but a step just reported
    assert ctx.reconciler().run_once().interrupted == {}
    ctx.redis.hset(ctx.keys.progress(job), "at", time.time() - ctx.settings.heartbeat_ttl_s - 1)
    assert ctx.reconciler().run_once().interrupted == {job: "worker_lost"}


def test_r19_a_job_claimed_by_a_new_boot_before_its_first_heartbeat_is_not_interrupted(
    strict_ctx: ServerContext, tiny_models_dir: Path
) -> None:
    """A worker killed and started again can claim a job before its first heartbeat replaces
    the previous boot's (found by the worker_kill drill): that stale record proves nothing."""
    ctx = strict_ctx
    beat(ctx, "m1", "boot-old", at_s=time.time() - 1)  # written before the claim below
    job = running_on_m1(ctx, tiny_models_dir, boot_id="boot-new")
    beat(ctx, "m1", "boot-old", at_s=time.time() - 1)
    ctx.redis.hset(ctx.keys.progress(job), "at", time.time())
    assert ctx.reconciler().run_once().interrupted == {}
    beat(ctx, "m1", "boot-other")  # a heartbeat after the claim, of yet another boot: restarted
    assert ctx.reconciler().run_once().interrupted == {job: "worker_restarted"}


def test_r19_reconciling_with_another_journal_beside_the_fleets_redis_changes_nothing(
    settings: Settings, tiny_models_dir: Path, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """``homefleet reconcile`` (or ``status``, or a second server) run from another directory
    opens another journal (``data_dir`` is relative to the working directory). That journal
    knows none of the fleet's jobs: trusting it would release every live reservation and
    judge jobs it never saw. The Redis records the server's journal; every other one is
    refused (``journal_mismatch``) before anything changes, until ``homefleet db pair``."""
    server = build_context(settings, make_fleet("m1"), migrate=True)
    request.addfinalizer(server.close)
    model = server.registry.add(tiny_models_dir / "tiny-sd").id
    bring_online(server, "m1", {model})
    server.reconciler().run_once()  # the server's first pass records its journal
    queued = [submit(server, model) for _ in range(3)]

    elsewhere = {
        **settings_env(settings),
        "HOMEFLEET_DATA_DIR": str(tmp_path / "elsewhere"),
        "HOMEFLEET_DATABASE_URL": f"sqlite:///{tmp_path / 'elsewhere.db'}",
    }
    run_cli("db", "upgrade", env=elsewhere)  # another journal, up to date: only its identity differs
    for command in (["reconcile"], ["status"]):
        done = run_cli(*command, env=elsewhere, check=False)
        assert done.returncode == 2, done.stdout + done.stderr
        assert "error (journal_mismatch)" in done.stderr and "belongs to another journal" in done.stderr, done.stderr
        assert "HOMEFLEET_DATA_DIR" in done.stderr and "homefleet db pair" in done.stderr
        said = " ".join(done.stderr.split())  # where the server's journal and data folder are, to go there
        assert f"data folder {settings.data_dir.resolve()}" in said, said
    assert server.machines.reservations.count("m1") == 3  # nothing released
    assert [server.journal.get(job).state for job in queued] == [JobState.queued] * 3

    other = build_context(
        settings.model_copy(
            update={"data_dir": tmp_path / "elsewhere", "database_url": f"sqlite:///{tmp_path / 'elsewhere.db'}"}
        ),
        make_fleet("m1"),
        migrate=True,
    )
    request.addfinalizer(other.close)
    with pytest.raises(ConfigError) as refused:
        other.reconciler().run_once()
    assert refused.value.reason == "journal_mismatch"
    assert server.machines.reservations.count("m1") == 3

    run_cli("db", "pair", env=elsewhere)  # on purpose: this journal replaces the server's
    assert other.reconciler().run_once().released_reservations == 3  # jobs it does not know
    with pytest.raises(ConfigError):
        server.reconciler().run_once()  # and now the old one is refused


FLEET_COMMANDS = (
    ["drain", "m1"],
    ["residency", "set", "m1"],
    ["oom", "clear", "m1"],
    ["models", "list"],
    ["sync", "m1"],
)


def test_r19_fleet_commands_with_another_journal_are_refused(
    settings: Settings, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """Every CLI command that reads or changes the fleet checks the pairing first: a drain,
    a residency commitment, an OOM clear or a sync from another directory would act on a
    journal the server does not read."""
    server = build_context(settings, make_fleet("m1"), migrate=True)
    request.addfinalizer(server.close)
    server.reconciler().run_once()
    elsewhere = {
        **settings_env(settings),
        "HOMEFLEET_DATA_DIR": str(tmp_path / "elsewhere"),
        "HOMEFLEET_DATABASE_URL": f"sqlite:///{tmp_path / 'elsewhere.db'}",
    }
    run_cli("db", "upgrade", env=elsewhere)  # another journal, up to date: only its identity differs
    for command in FLEET_COMMANDS:
        done = run_cli(*command, env=elsewhere, check=False)
        assert done.returncode == 2, (command, done.stdout + done.stderr)
        assert "error (journal_mismatch)" in done.stderr, (command, done.stderr)
        assert not server.redis.exists(server.keys.draining("m1"))


def test_r19_the_demo_never_takes_over_the_redis_of_another_journal(redis_url: str, tmp_path: Path) -> None:
    """``homefleet demo`` with HOMEFLEET_REDIS_URL naming a fleet's Redis (or an earlier demo's
    whose folder was deleted) stops before starting anything, naming the way out, and leaves
    the recorded journal alone: taking it over would stop the fleet's reconciliation."""
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    client.set("hf:journal", "the-fleets-journal")
    env: dict[str, str | None] = {k: None for k in os.environ if k.startswith("HOMEFLEET_")}  # unset
    env["HOMEFLEET_REDIS_URL"] = redis_url
    done = run_cli("demo", "--data-dir", str(tmp_path / "demo"), env=env, check=False)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "error (journal_mismatch)" in done.stderr and "unset HOMEFLEET_REDIS_URL" in done.stderr, done.stderr
    assert client.get("hf:journal") == "the-fleets-journal"
    assert not (tmp_path / "demo" / "tiny").exists()  # nothing built, nothing started


def test_r19_a_borrowed_redis_is_unpaired_as_found_and_another_journals_pairing_is_left_alone(
    settings: Settings, request: pytest.FixtureRequest
) -> None:
    """The demo pairs the Redis it was pointed at (``HOMEFLEET_REDIS_URL``, no journal recorded
    there) and unpairs it at its end (``app.fleet.pairing.unpair``): a fleet's server started
    there later records its own journal instead of being refused ``journal_mismatch``. A pairing
    that another journal took meanwhile (``homefleet db pair``) is left as it is."""
    from app.fleet.pairing import unpair

    demo = build_context(settings, make_fleet("m1"), migrate=True)
    request.addfinalizer(demo.close)
    mine = demo.pairing.check()
    assert demo.redis.get(demo.keys.journal()) == mine and demo.redis.exists(demo.keys.journal_where())
    assert unpair(demo.redis, demo.keys, mine)
    assert not demo.redis.exists(demo.keys.journal()) and not demo.redis.exists(demo.keys.journal_where())
    other = settings.model_copy(update={"data_dir": settings.data_dir.parent / "fleet"})
    fleet = build_context(other, make_fleet("m1"), migrate=True)
    request.addfinalizer(fleet.close)
    theirs = fleet.pairing.check()  # the fleet's server, started on that Redis afterwards
    assert theirs != mine and fleet.redis.get(fleet.keys.journal()) == theirs
    assert not unpair(demo.redis, demo.keys, mine)  # a demo ending now takes nothing away
    assert fleet.redis.get(fleet.keys.journal()) == theirs and fleet.redis.exists(fleet.keys.journal_where())


def test_r19_homefleet_reconcile_never_records_a_journal_and_refuses_while_none_is(
    settings: Settings, tiny_models_dir: Path, request: pytest.FixtureRequest
) -> None:
    """Only the server records its journal. Run before the server (after an upgrade, or while
    Redis just lost its data), ``homefleet reconcile`` cannot tell whether its journal is the
    server's: it refuses (``journal_unpaired``) and records nothing; once the server's pass has
    recorded it, the CLI's pass runs."""
    server = build_context(settings, make_fleet("m1"), migrate=True)
    request.addfinalizer(server.close)
    done = run_cli("reconcile", env=settings_env(settings), check=False)
    assert done.returncode == 2 and "error (journal_unpaired)" in done.stderr, done.stdout + done.stderr
    assert "start `homefleet serve`" in done.stderr
    assert server.redis.get(server.keys.journal()) is None
    server.reconciler().run_once()  # the server's own pass records it
    assert "interrupted 0" in run_cli("reconcile", env=settings_env(settings)).stdout


def test_r19_a_command_with_the_servers_journal_but_another_data_folder_is_refused(
    settings: Settings, tiny_models_dir: Path, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """With a shared journal (PostgreSQL, or the server's SQLite file named by URL), a command
    run with another HOMEFLEET_DATA_DIR registered models into a folder the server never reads
    (operator pass: the workers' manifest then failed). The server marks its data folder; a
    command whose folder lacks the mark is refused once a server has run."""
    server = build_context(settings, make_fleet("m1"), migrate=True)
    request.addfinalizer(server.close)
    server.reconciler().run_once()  # the server: records its journal, marks its data folder
    assert (settings.data_dir / "journal-id").read_text().strip() == server.redis.get(server.keys.journal())
    other = {
        **settings_env(settings),
        "HOMEFLEET_DATA_DIR": str(tmp_path / "other"),
        "HOMEFLEET_DATABASE_URL": settings.journal_url,
    }
    done = run_cli("models", "add", str(tiny_models_dir / "tiny-sd"), env=other, check=False)
    assert done.returncode == 2, done.stdout + done.stderr
    said = " ".join(done.stderr.split())  # one line, wrapped by the console
    assert "error (journal_mismatch)" in said and "has no journal-id file" in said, said
    assert server.registry.list() == []
    assert "tiny-sd" in run_cli("models", "add", str(tiny_models_dir / "tiny-sd"), env=settings_env(settings)).stdout


def test_r19_a_queued_job_of_a_machine_removed_from_the_fleet_is_interrupted_as_such_and_released(
    settings: Settings, tiny_models_dir: Path, request: pytest.FixtureRequest
) -> None:
    """A machine taken out of the fleet config while jobs wait on it: no worker will take them.
    They were reported ``lost`` ("its message is no longer in m2's queue") although the
    messages were still there, and their reservations stayed until the machine came back. Now
    they end ``machine_removed``, their messages are removed, their reservations released."""
    before = build_context(settings, make_fleet("m1", "m2"), migrate=True)
    request.addfinalizer(before.close)
    model = before.registry.add(tiny_models_dir / "tiny-sd").id
    bring_online(before, "m2", {model})
    waiting = submit(before, model, "m2")
    after = build_context(settings, make_fleet("m1"), migrate=True)  # the server restarted without m2
    request.addfinalizer(after.close)
    report = after.reconciler().run_once()
    assert report.interrupted == {waiting: "machine_removed"}
    journaled = after.journal.get(waiting)
    assert (journaled.state, journaled.reason) == (JobState.interrupted, "machine_removed")
    assert "'m2' is no longer in the fleet config" in (journaled.message or "")
    assert after.redis.llen(after.keys.queue_list("m2")) == 0
    assert report.released_reservations == 1 and after.machines.reservations.count("m2") == 0


def test_r19_a_running_job_whose_progress_redis_lost_is_hung_after_the_bound_from_then(
    strict_ctx: ServerContext, tiny_models_dir: Path
) -> None:
    """Redis lost the claimed job's progress record (a restart without persistence just after
    the claim) and its task died before its first step: the hung bound counts from the first
    pass that finds no record, so the job is interrupted ``hung``, not left ``running`` for as
    long as its worker lives. A job with a record is judged by it as before."""
    ctx = strict_ctx
    job = running_on_m1(ctx, tiny_models_dir, "boot-A")
    beat(ctx, "m1", "boot-A")
    ctx.redis.delete(ctx.keys.progress(job))  # lost with Redis's data
    assert ctx.reconciler().run_once().interrupted == {}  # the clock starts here
    assert ctx.progress.last_at(job) == 0.0  # no sign of life was made up
    since = float(ctx.redis.hget(ctx.keys.progress(job), "watched") or 0)
    assert abs(since - time.time()) < 60
    assert ctx.reconciler().run_once().interrupted == {}  # within the bound: the first pass's time kept
    assert float(ctx.redis.hget(ctx.keys.progress(job), "watched") or 0) == since
    ctx.redis.hset(ctx.keys.progress(job), "watched", since - ctx.settings.hung_after_s - 1)  # as the bound later
    beat(ctx, "m1", "boot-A")
    assert ctx.reconciler().run_once().interrupted == {job: "hung"}
    assert ctx.journal.get(job).state == JobState.interrupted


def test_r19_the_reconciliation_loop_says_a_redis_outage_once_and_when_redis_answers_again(
    settings: Settings, tmp_path: Path, request: pytest.FixtureRequest, caplog: pytest.LogCaptureFixture
) -> None:
    """While Redis does not answer, the server's loop says so once (redis_down, the URL without
    its password), not with a traceback at every pass; and once when it answers again."""
    port = free_port()
    servers = [start_redis_server(tmp_path / "redis", port=port, password="s3cret")]
    request.addfinalizer(lambda: servers[-1].stop())
    ctx = build_context(settings.model_copy(update={"redis_url": servers[0].url}), make_fleet("m1"), migrate=True)
    request.addfinalizer(ctx.close)
    loop = ReconcileLoop(ctx.reconciler(), interval_s=0.05)
    request.addfinalizer(loop.stop)
    caplog.set_level(logging.INFO, logger="app.jobs.reconcile")
    servers[0].stop()
    loop.start()
    deadline = time.monotonic() + 10
    while not caplog.records and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(1.0)  # some twenty passes more, all failing
    said = [record for record in caplog.records if record.name == "app.jobs.reconcile"]
    assert len(said) == 1, [record.getMessage() for record in said]
    line = said[0].getMessage()
    assert said[0].levelno == logging.WARNING and said[0].exc_info is None
    assert "redis_down" in line and f"redis://:***@127.0.0.1:{port}/0" in line and "s3cret" not in line
    caplog.clear()
    servers.append(start_redis_server(tmp_path / "redis", port=port, password="s3cret"))
    deadline = time.monotonic() + 10
    while not any("answers again" in r.getMessage() for r in caplog.records) and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)  # a few passes more, all answered
    again = [r.getMessage() for r in caplog.records if r.name == "app.jobs.reconcile" and "Redis at" in r.getMessage()]
    assert len(again) == 1 and "answers again" in again[0] and "s3cret" not in again[0], again
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


@pytest.mark.parametrize("pool_runs_it", [True, False])
def test_r19_a_running_job_still_running_cancel_grace_s_after_its_cancel_is_cancelled_saying_what_was_killed(
    strict_ctx: ServerContext, tiny_models_dir: Path, pool_runs_it: bool
) -> None:
    """A cancel asked ``cancel_grace_s`` ago of a job still ``running``: reconciliation ends it
    ``cancelled`` and asks the watchdog to restart the pool (the watchdog kills only the process
    whose running record names the job). The message says a pool process was killed only when
    the running record names the job; with none (its run ended and its result waits in the
    worker's spool after a failed upload, R2) it says that nothing runs it."""
    ctx = strict_ctx
    job = running_on_m1(ctx, tiny_models_dir, boot_id="boot-A")
    ctx.redis.hset(ctx.keys.progress(job), "at", time.time())
    beat(ctx, "m1", "boot-A")
    if pool_runs_it:
        ctx.redis.set(ctx.keys.running("m1"), json.dumps({"job_id": job, "pid": os.getpid()}))
    assert ctx.dispatcher.request_cancel(job).state == JobState.running
    ctx.redis.set(ctx.keys.cancel(job), repr(time.time() - ctx.settings.cancel_grace_s - 1))
    assert ctx.reconciler().run_once().cancelled == {job: "cancelled"}
    ended = ctx.journal.get(job)
    assert (ended.state, ended.reason) == (JobState.cancelled, "cancelled")
    assert ended.message is not None and ended.message.startswith("cancelled by request while running, after 0 steps; ")
    assert ("its pool process was killed" in ended.message) == pool_runs_it, ended.message
    assert ("no pool process of m1 runs it" in ended.message) != pool_runs_it, ended.message
    assert ctx.redis.get(ctx.keys.restart("m1")) == job
