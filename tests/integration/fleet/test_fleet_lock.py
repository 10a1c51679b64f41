"""Select + reserve + enqueue under one fleet lock (R14, C04) on a real Redis: many
processes submitting Auto jobs at once, and a placer that stalls past the lock's TTL."""

from __future__ import annotations

import json
import multiprocessing
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
        return [ctx.dispatcher.submit(MODEL, "txt2img", {"prompt": f"w{worker}-{i}"}, "auto").job.id
                for i in range(JOBS_EACH)]
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
    """Real machine states whose first read takes ``stall_s`` seconds (a placer stuck mid-decision)."""

    stall_s = 0.0

    def snapshot(self, names: list[str] | None = None, also: Sequence[tuple[str, str]] = (),
                 max_queued: int | None = None) -> tuple[dict[str, MachineView], list[Any]]:
        found = super().snapshot(names, also, max_queued)
        if self.stall_s:
            stall, self.stall_s = self.stall_s, 0.0
            time.sleep(stall)
        return found


def test_c04_a_placer_that_loses_the_lock_commits_nothing(settings: Settings, tiny_models_dir: Path) -> None:
    settings = settings.model_copy(update={"fleet_lock_ttl_s": 0.5, "fleet_lock_wait_s": 5.0})
    fleet = make_fleet("m1")
    stalled = build_context(settings, fleet, migrate=True)
    other = build_context(settings, fleet, migrate=True)
    try:
        stalled.registry.add(tiny_models_dir / MODEL, MODEL)
        for machine in ("server", "m1"):
            bring_online(stalled, machine, {MODEL})
        slow = StallingMachineStates(stalled.redis, stalled.keys, fleet, stalled.journal)
        slow.stall_s = 1.5  # three TTLs
        stalled.dispatcher.machines = slow
        outcome: dict[str, object] = {}

        def stalled_submit() -> None:
            try:
                stalled.dispatcher.submit(MODEL, "txt2img", {"prompt": "slow"}, "auto")
            except PlacementLost as error:
                outcome["error"] = error

        thread = threading.Thread(target=stalled_submit)
        thread.start()
        time.sleep(0.9)  # the stalled placer's lock has expired; another placer takes it
        placed = other.dispatcher.submit(MODEL, "txt2img", {"prompt": "fast"}, "auto").job
        thread.join(timeout=30)

        error = outcome.get("error")
        assert isinstance(error, PlacementLost) and error.status_code == 503 and "submit again" in error.message
        jobs = {j.params["prompt"]: j for j in other.journal.list()}
        assert jobs["slow"].state == JobState.interrupted and jobs["slow"].reason == "placement_lock_lost"
        assert jobs["fast"].id == placed.id and jobs["fast"].state == JobState.queued
        everywhere = [job_id for m in ("server", "m1") for job_id in queue_ids(other, m)]
        assert everywhere == [placed.id]  # the stalled job was never published; the other exactly once
        reserved = [job_id for m in ("server", "m1") for job_id, _ in other.machines.reservations.records(m)]
        assert reserved == [placed.id]
    finally:
        stalled.close()
        other.close()
