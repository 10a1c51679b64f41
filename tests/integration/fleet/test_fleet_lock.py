"""Select + reserve + enqueue under one fleet lock (R14, C04) on a real Redis: many
processes submitting Auto jobs at once; a placer that stalls past the lock's TTL while alive
(renewed, it keeps the lock) and one that stops running (it loses the lock, commits nothing)."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from app.context import ServerContext, build_context
from app.core.config import Settings
from app.core.errors import PlacementLost
from app.core.states import JobState
from app.db.tables import Job
from app.fleet.machines import MachineStates
from routing.placement import MachineView
from tests.helpers import bring_online, make_fleet

MODEL = "tiny-sd"
WORKING = ("server", "m1", "m2", "m3")  # online, model verified
PROCESSES = 8
JOBS_EACH = 50


def submitter(settings_json: str, worker: int, start_at: float) -> list[str]:
    """One submitting process: JOBS_EACH Auto jobs as fast as it can; returns their ids."""
    settings = Settings.model_validate_json(settings_json)
    ctx = build_context(settings, make_fleet("m1", "m2", "m3", "m4", "m5"))
    try:
        ctx.dispatcher.validator.tokenizers.counter(MODEL)  # the model's tokenizer, loaded before the start
        while time.time() < start_at:
            time.sleep(0.005)
        return [
            ctx.dispatcher.submit(MODEL, "txt2img", {"prompt": f"w{worker}-{i}"}, "auto").job.id
            for i in range(JOBS_EACH)
        ]
    finally:
        ctx.close()


def queue_ids(ctx: ServerContext, machine: str) -> list[str]:
    """Job ids in a machine's list in the order they will run (BRPOP takes from the right)."""
    return [json.loads(raw)["headers"]["id"] for raw in reversed(ctx.redis.lrange(ctx.keys.queue_list(machine), 0, -1))]


@pytest.mark.timeout(600)
def test_r14_eight_processes_place_400_auto_jobs_each_exactly_once_in_fifo_order(
    settings: Settings, tiny_models_dir: Path
) -> None:
    settings = settings.model_copy(
        update={
            "fleet_lock_wait_s": 120.0,
            "fleet_lock_ttl_s": 30.0,
            "max_queued_per_machine": 1000,
            "max_pending_total": 1000,
        }
    )  # no worker drains them
    ctx = build_context(settings, make_fleet("m1", "m2", "m3", "m4", "m5"), migrate=True)
    try:
        ctx.registry.add(tiny_models_dir / MODEL, MODEL)
        for machine in WORKING:
            bring_online(ctx, machine, {MODEL})
        bring_online(ctx, "m5", set())  # online, model not verified; m4 is offline
        start_at = time.time() + 4.0
        # Forked: the submitters start with the test's modules imported (transformers included), so
        # they are all placing jobs at start_at, at once; each builds its own connections.
        fork = multiprocessing.get_context("fork")
        samples = []
        with fork.Pool(PROCESSES) as pool:
            pending = pool.starmap_async(
                submitter, [(settings.model_dump_json(), w, start_at) for w in range(PROCESSES)]
            )
            while not pending.ready():
                # Under the fleet lock, reservations must equal what is queued (nothing runs here).
                with ctx.redis.lock(ctx.keys.fleet_lock(), timeout=30, blocking_timeout=120):
                    samples.append(
                        {
                            m: (ctx.machines.reservations.count(m), ctx.redis.llen(ctx.keys.queue_list(m)))
                            for m in WORKING
                        }
                    )
                time.sleep(0.2)
            per_process = pending.get(timeout=600)

        submitted = [job_id for ids in per_process for job_id in ids]
        assert len(submitted) == len(set(submitted)) == PROCESSES * JOBS_EACH
        placed: list[str] = []
        for machine in WORKING:
            in_list = queue_ids(ctx, machine)
            placed += in_list
            reserved = [job_id for job_id, _ in ctx.machines.reservations.records(machine)]
            assert in_list == reserved, f"{machine}: list order differs from reservation (FIFO) order"
            journal_order = [j.id for j in ctx.journal.list(states=[JobState.queued], machine=machine)]
            assert in_list == journal_order, f"{machine}: list order differs from submission order"
        assert sorted(placed) == sorted(submitted)  # each exactly once, nowhere else
        for machine in ("m4", "m5"):
            assert ctx.redis.llen(ctx.keys.queue_list(machine)) == 0 and ctx.machines.reservations.count(machine) == 0
        assert all(len(ctx.journal.list(machine=m)) > 0 for m in WORKING)  # Auto spread the work
        assert samples and all(r == q for sample in samples for r, q in sample.values())
    finally:
        ctx.close()


class StallingMachineStates(MachineStates):
    """Real machine states whose first read stalls (a placer stuck mid-decision): it sets
    ``stalling``, then waits ``stall_s`` seconds, or until ``resume`` is set when one is given."""

    stall_s = 0.0
    stalling: Any = None  # threading.Event or multiprocessing.Event
    resume: Any = None

    def snapshot(
        self, names: list[str] | None = None, also: Sequence[tuple[str, str]] = (), max_queued: int | None = None
    ) -> tuple[dict[str, MachineView], list[Any]]:
        found = super().snapshot(names, also, max_queued)
        if self.stall_s:
            stall, self.stall_s = self.stall_s, 0.0
            if self.stalling is not None:
                self.stalling.set()
            if self.resume is not None:
                assert self.resume.wait(stall)
            else:
                time.sleep(stall)
        return found


def _online(ctx: ServerContext, tiny_models_dir: Path) -> None:
    ctx.registry.add(tiny_models_dir / MODEL, MODEL)
    for machine in ("server", "m1"):
        bring_online(ctx, machine, {MODEL})


def test_c04_a_slow_placer_alive_keeps_the_lock_past_its_ttl(settings: Settings, tiny_models_dir: Path) -> None:
    """The holder's block takes 2.7 TTLs; its renewal (every ttl/3) keeps the lock: its job is
    placed and published, and another placer waits for it rather than overtaking it."""
    settings = settings.model_copy(update={"fleet_lock_ttl_s": 1.5, "fleet_lock_wait_s": 60.0})
    fleet = make_fleet("m1")
    slow_ctx = build_context(settings, fleet, migrate=True)
    other = build_context(settings, fleet, migrate=True)
    try:
        _online(slow_ctx, tiny_models_dir)
        slow = StallingMachineStates(slow_ctx.redis, slow_ctx.keys, fleet, slow_ctx.journal, slow_ctx.residency)
        slow.stall_s, slow.stalling = 4.0, threading.Event()
        slow_ctx.dispatcher.machines = slow
        outcome: dict[str, object] = {}

        def slow_submit() -> None:
            try:
                outcome["job"] = slow_ctx.dispatcher.submit(MODEL, "txt2img", {"prompt": "slow"}, "m1").job
            except PlacementLost as error:
                outcome["error"] = error

        thread = threading.Thread(target=slow_submit)
        thread.start()
        assert slow.stalling.wait(60)  # the slow placer holds the lock and has started its stall
        placed = other.dispatcher.submit(MODEL, "txt2img", {"prompt": "fast"}, "m1").job  # waits for the lock
        thread.join(timeout=60)

        assert "error" not in outcome, outcome
        slow_job = outcome["job"]
        assert isinstance(slow_job, Job) and slow_job.state == JobState.queued
        assert queue_ids(other, "m1") == [slow_job.id, placed.id]  # the slow one first: never overtaken
        assert [job_id for job_id, _ in other.machines.reservations.records("m1")] == [slow_job.id, placed.id]
        assert {j.params["prompt"]: j.state for j in other.journal.list()} == {
            "slow": JobState.queued,
            "fast": JobState.queued,
        }
        # homefleet_fleet_lock_hold_seconds: the slow placer's one hold, at least its stall
        hold = slow_ctx.metrics.registry.get_sample_value
        assert hold("homefleet_fleet_lock_hold_seconds_count") == 1.0
        assert 4.0 <= (hold("homefleet_fleet_lock_hold_seconds_sum") or 0.0) < 60.0
        assert hold("homefleet_fleet_lock_hold_seconds_bucket", {"le": "2.5"}) == 0.0
    finally:
        slow_ctx.close()
        other.close()


def dead_placer(settings_json: str, stalling: Any, resume: Any, outcome: Any) -> None:
    """A placer in a process of its own that stalls mid-decision until ``resume`` is set; puts
    how its submission ended on ``outcome``."""
    settings = Settings.model_validate_json(settings_json)
    fleet = make_fleet("m1")
    ctx = build_context(settings, fleet)
    try:
        slow = StallingMachineStates(ctx.redis, ctx.keys, fleet, ctx.journal, ctx.residency)
        slow.stall_s, slow.stalling, slow.resume = 120.0, stalling, resume
        ctx.dispatcher.machines = slow
        try:
            ctx.dispatcher.submit(MODEL, "txt2img", {"prompt": "slow"}, "auto")
            outcome.put(("placed", 0, ""))
        except PlacementLost as error:
            outcome.put(("PlacementLost", error.status_code, error.message))
    finally:
        ctx.close()


def test_c04_a_frozen_placer_loses_the_lock_and_commits_nothing(settings: Settings, tiny_models_dir: Path) -> None:
    """A holder that stops running (SIGSTOP: its renewal thread stops with it) loses the lock at
    its TTL; another placer takes it; the first, resumed, commits nothing (the fenced
    reservation fails: PlacementLost, its job ``interrupted``)."""
    settings = settings.model_copy(update={"fleet_lock_ttl_s": 1.0, "fleet_lock_wait_s": 30.0})
    fleet = make_fleet("m1")
    other = build_context(settings, fleet, migrate=True)
    fork = multiprocessing.get_context("fork")
    stalling, resume, outcome = fork.Event(), fork.Event(), fork.Queue()
    placer = fork.Process(target=dead_placer, args=(settings.model_dump_json(), stalling, resume, outcome))
    try:
        _online(other, tiny_models_dir)
        placer.start()
        assert stalling.wait(120)  # it holds the lock, stalled
        assert placer.pid is not None
        os.kill(placer.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 60
        while other.redis.exists(other.keys.fleet_lock()):  # no renewal: it expires at its TTL
            assert time.monotonic() < deadline, "the frozen placer's lock never expired"
            time.sleep(0.1)
        placed = other.dispatcher.submit(MODEL, "txt2img", {"prompt": "fast"}, "auto").job
        os.kill(placer.pid, signal.SIGCONT)
        resume.set()
        ended, status, message = outcome.get(timeout=120)
        placer.join(timeout=60)

        assert (ended, status) == ("PlacementLost", 503) and "submit again" in message
        jobs = {j.params["prompt"]: j for j in other.journal.list()}
        assert jobs["slow"].state == JobState.interrupted and jobs["slow"].reason == "placement_lock_lost"
        assert jobs["fast"].id == placed.id and jobs["fast"].state == JobState.queued
        everywhere = [job_id for m in ("server", "m1") for job_id in queue_ids(other, m)]
        assert everywhere == [placed.id]  # the frozen placer's job was never published; the other exactly once
        reserved = [job_id for m in ("server", "m1") for job_id, _ in other.machines.reservations.records(m)]
        assert reserved == [placed.id]
    finally:
        if placer.is_alive() and placer.pid is not None:
            os.kill(placer.pid, signal.SIGCONT)
            resume.set()
            placer.join(timeout=30)
        other.close()
