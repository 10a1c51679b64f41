"""Fault drills at small counts (R19, R20, C01, C02, C08). The same drills run at
larger counts with ``homefleet drill NAME --count N``."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from app.devtools.drills import (
    BACKLOG,
    DRILLS,
    FLEET_OPTIONS,
    HELD_STEPS,
    JOBS_PER_REPEAT,
    DrillFleet,
    DrillResult,
    drill_standby_server,
    drill_visibility,
)

pytestmark = pytest.mark.e2e


VISIBILITY_S = 2
BROKER_PREFIX = "drill:"
HUNG_AFTER_S = 20


@pytest.fixture(scope="module")
def drill_fleet(tmp_path_factory: pytest.TempPathFactory, tiny_models_dir: Path) -> Iterator[DrillFleet]:
    """One private fleet for every drill, with the short broker visibility timeout C01 needs and
    the short hung bound the watchdog drill needs (``homefleet drill`` gives each drill a fleet of
    its own, FLEET_OPTIONS): neither changes the other drills' outcome (messages are acked when
    delivered; every job reports progress at each step). Its broker keys are under a prefix
    (kombu's global_keyprefix), so every drill also shows the prefix honoured."""
    with DrillFleet(
        tmp_path_factory.mktemp("drills"),
        tiny_models_dir / "tiny-sd",
        visibility_timeout_s=VISIBILITY_S,
        hung_after_s=HUNG_AFTER_S,
        broker_key_prefix=BROKER_PREFIX,
        forkserver=True,
    ) as fleet:
        yield fleet


def check(result: DrillResult, jobs: int) -> None:
    print(result.line())
    assert result.double_runs == 0, result.line()
    assert result.lost == 0, result.line()
    assert result.jobs >= jobs, result.line()
    # Every job either ran exactly once or was interrupted/cancelled before it could run.
    assert result.runs <= result.jobs, result.line()


def test_r19_duplicate_delivery_drill(drill_fleet: DrillFleet) -> None:
    result = DRILLS["duplicate"](drill_fleet, 10)
    check(result, 10)
    assert (result.runs, result.interrupted) == (10, 0)


def test_r19_c02_worker_kill_drill(drill_fleet: DrillFleet) -> None:
    result = DRILLS["worker_kill"](drill_fleet, 8)
    check(result, 8)
    assert result.interrupted == 1  # the one job that was running when m1 died
    assert result.runs == result.jobs  # the killed job ran once; every other ran once


def test_r20_server_kill_drill(drill_fleet: DrillFleet) -> None:
    result = DRILLS["server_kill"](drill_fleet, 12)
    check(result, 12)


def test_r19_redis_restart_drill(drill_fleet: DrillFleet) -> None:
    result = DRILLS["redis_restart"](drill_fleet, 6)
    check(result, 6)
    # The queued jobs whose messages vanished are published again and run, once each.
    assert (result.runs, result.interrupted) == (6, 0), result.line()


def test_r19_redis_loss_requeue_drill(drill_fleet: DrillFleet) -> None:
    """Redis loses its data while m1 runs a long job and 7 jobs wait behind it, then
    2 newer jobs come. The 7 are published again and run once each, in journal order and before
    the newer ones; the long job's live worker is not judged lost. Under a broker key prefix."""
    assert drill_fleet.ctx is not None
    assert drill_fleet.ctx.keys.queue_list("m1") == "drill:machine.m1"
    result = DRILLS["redis_loss_requeue"](drill_fleet, 8)
    check(result, 8)
    assert (result.runs, result.interrupted) == (10, 0), result.line()
    assert result.figures == {
        "restarts": 1,
        "queued_at_loss": 7,
        "republished": 7,
        "ran_once": 7,
        "order_kept": 1,
        "worker_lost": 0,
    }, result.line()
    assert drill_fleet.ctx.redis.keys("machine.*") == []  # nothing outside the prefix


def test_r8_r19_redis_loss_backlogs_drill_keeps_each_machines_order(drill_fleet: DrillFleet) -> None:
    """Twice (FLUSHALL, then a restart without persistence), Redis loses its data while m1 runs a
    long job with a backlog behind it and m2, idle, works through its own: every job runs once,
    none is lost, and each machine claims each backlog in submission order (R8).
    ``homefleet drill redis_loss_backlogs --count 130`` runs 10 repeats (docs/benchmarks.md)."""
    assert drill_fleet.ctx is not None
    journal = drill_fleet.ctx.journal
    before = {job.id for job in journal.list()}
    result = DRILLS["redis_loss_backlogs"](drill_fleet, 2 * JOBS_PER_REPEAT)
    check(result, 2 * JOBS_PER_REPEAT)
    # The premise: m1 was busy, its held job running, until that repeat's backlog had been published
    # again (its jobs are the next BACKLOG of m1's, in journal order).
    on_m1 = [job for job in journal.list(machine="m1") if job.id not in before]
    held = [i for i, job in enumerate(on_m1) if job.params["steps"] == HELD_STEPS]
    assert len(held) == 2, [job.params for job in on_m1]
    for i in held:
        backlog = on_m1[i + 1 : i + 1 + BACKLOG]
        republished = [e.at for job in backlog for e in journal.events(job.id) if e.event == "requeued"]
        assert len(republished) == BACKLOG, result.line()
        assert on_m1[i].finished_at is not None and on_m1[i].finished_at > max(republished), result.line()
    assert (result.runs, result.interrupted) == (2 * JOBS_PER_REPEAT, 0), result.line()
    figures = result.figures
    assert (figures["repeats"], figures["backlogs"], figures["order_kept"]) == (2, 4, 4), result.line()
    assert figures["succeeded"] == 2 * JOBS_PER_REPEAT, result.line()
    # at least m1's waiting backlog (behind its long job) was lost with Redis and published again
    assert figures["republished"] >= 2 * BACKLOG, result.line()


def test_c01_visibility_timeout_drill(drill_fleet: DrillFleet) -> None:
    assert FLEET_OPTIONS["visibility"]["visibility_timeout_s"] == VISIBILITY_S  # what `homefleet drill` runs too
    # two jobs of 30 steps at 112x112 (drills.LONG_SIDE: each runs for seconds)
    result = drill_visibility(drill_fleet, 2, steps=30)
    check(result, 2)
    assert (result.runs, result.interrupted) == (2, 0)
    assert drill_fleet.ctx is not None
    ran = [j for j in drill_fleet.ctx.journal.list() if j.params.get("steps") == 30]
    assert len(ran) == 2 and all((j.run_s or 0) > VISIBILITY_S for j in ran)  # the premise: longer than the timeout


def test_r19_watchdog_hang_drill(drill_fleet: DrillFleet) -> None:
    assert FLEET_OPTIONS["hang"]["hung_after_s"] == HUNG_AFTER_S
    result = DRILLS["hang"](drill_fleet, 6)
    assert drill_fleet.ctx is not None
    hung = [j for j in drill_fleet.ctx.journal.list() if j.reason == "hung"]
    check(result, 6)
    assert result.interrupted == 1 and len(hung) == 1
    assert result.runs == result.jobs  # the pool process was replaced and ran every later job


def test_a_drill_stopped_with_sigterm_stops_the_fleet_it_started(tmp_path: Path) -> None:
    """`homefleet drill` started a private fleet (API, workers, Redis); SIGTERM must not orphan it."""
    import signal
    import subprocess
    import sys
    import time

    import psutil

    drill = subprocess.Popen(
        [sys.executable, "-m", "app.cli", "drill", "duplicate", "--count", "5", "--work-dir", str(tmp_path)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )

    def command_line(process: psutil.Process) -> str:
        """The process's command line; "" once it has exited (a zombie's is gone)."""
        try:
            return " ".join(process.cmdline())
        except psutil.NoSuchProcess:  # ZombieProcess too: a child the drill started may exit while we look
            return ""

    parent = psutil.Process(drill.pid)
    deadline = time.monotonic() + 180
    while not any("worker" in command_line(c) for c in parent.children(recursive=True)):
        assert time.monotonic() < deadline, "the drill started no worker"
        time.sleep(0.5)
    fleet = parent.children(recursive=True)
    drill.send_signal(signal.SIGTERM)
    assert drill.wait(timeout=120) == 128 + signal.SIGTERM
    _, alive = psutil.wait_procs(fleet, timeout=30)
    assert not alive, [command_line(p) for p in alive]


def test_r19_r20_sentinel_failover_drill(tmp_path: Path, tiny_models_dir: Path) -> None:
    """The Redis master is SIGKILLed while a job runs on each of three machines with 3 queued
    behind each and a client keeps submitting, and the replica lacks the master's last 2 writes;
    Sentinel promotes the replica (docs/operations.md,
    "Redis Sentinel"). Every job ends exactly once, per-machine order holds, the switch answers
    503 with Retry-After (never 500), and the workers reconnect by themselves. One failover here;
    ``homefleet drill sentinel_failover --count 100`` runs ten."""
    options = FLEET_OPTIONS["sentinel_failover"]
    with DrillFleet(tmp_path, tiny_models_dir / "tiny-sd", forkserver=True, **options) as fleet:
        assert fleet.ctx is not None and fleet.sentinels is not None
        assert fleet.ctx.settings.redis_url.startswith("sentinel://") and fleet.ctx.settings.redis_sentinel_master
        first_master = fleet.sentinels.master_port()
        result = DRILLS["sentinel_failover"](fleet, 10)
        check(result, 12)
        assert fleet.sentinels.master_port() != first_master  # a replica was promoted
    figures = result.figures
    assert figures["failovers"] == 1, result.line()
    assert 0 < figures["accept_again_ms"] < 60_000, result.line()
    assert (figures["errors_500"], figures["no_retry_after"], figures["worker_restarts"]) == (0, 0, 0), result.line()
    assert figures["order_kept"] == 1, result.line()
    # the master's last writes the replica lacked: published again from the journal, run once each (R19)
    assert figures["writes_lost"] == 2 and figures["republished"] >= 2, result.line()
    # every job ran once, or (the long ones running at the kill, a publish cut off) was interrupted
    assert result.runs + result.interrupted >= result.jobs, result.line()


def test_r20_standby_server_drill(tmp_path: Path, tiny_models_dir: Path) -> None:
    """Two servers on one PostgreSQL journal and one Redis; submissions, each with a webhook, over
    both while the current leader is SIGKILLed and started again twice (docs/operations.md, "A
    standby server"): every 202 is a job that ended, no Idempotency-Key made two jobs, the other
    server took the lead within the bound each time, one server leads at the end, and every job's
    webhook was received exactly once."""
    with DrillFleet(tmp_path, tiny_models_dir / "tiny-sd", forkserver=True, **FLEET_OPTIONS["standby_server"]) as fleet:
        assert fleet.ctx is not None and fleet.ctx.settings.journal_url.startswith("postgresql")
        result = drill_standby_server(fleet, 16, repeats=2)
    check(result, 16)
    # the workers know both servers' URLs: a claim made while one is down reaches the other, so
    # no job is judged lost (and interrupted) for want of a server to claim it through; a job a
    # killed server journaled but never published is published by the leader's reconciliation
    assert (result.runs, result.interrupted) == (16, 0), result.line()
    figures = result.figures
    assert figures["accepted"] == 16 and figures["duplicates"] == 0, result.line()
    assert (figures["errors_500"], figures["refused_4xx"]) == (0, 0), result.line()
    assert figures["repeats"] == 2, result.line()
    # leader_poll_s 0.5 s, plus the session's end; -1 would be a kill after which no server led
    assert 0 <= figures["handover_median_ms"] <= figures["handover_ms"] < 10_000, result.line()
    assert figures["leaders"] == 1, result.line()
    assert (figures["webhooks_twice"], figures["webhooks_missing"]) == (0, 0), result.line()
