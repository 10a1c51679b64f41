"""A running job's reported steps reach placement's snapshot (R13, R14): the share done and
the seconds its measured step rate leaves are set on its work item, read in the same Redis
command as the rest of the fleet, and priced by ``routing.finish.remaining_s``."""

from __future__ import annotations

import time

import pytest

from app.context import ServerContext
from app.fleet.lock import Fence
from app.fleet.machines import STEPS_EVERY_S
from routing.estimate import Estimator, MachineProfile, ModelProfile
from routing.finish import drain


class Clock:
    """``time.time`` held still and moved by hand, for every module that reads it."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, at_s: float) -> None:
        self.at_s = at_s
        monkeypatch.setattr(time, "time", lambda: self.at_s)


def test_r14_reported_steps_set_a_running_job_s_share_done_and_measured_seconds_left(
    ctx: ServerContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = Clock(monkeypatch, 1_000_000.0)
    reservations = ctx.machines.reservations
    ctx.redis.set(ctx.keys.fleet_lock(), "ours", px=60_000)
    held = Fence(ctx.keys.fleet_lock(), "ours", ttl_ms=60_000)
    assert reservations.add("m1", "job-a", "model-a", "txt2img", 30, 4096, held)
    assert reservations.add("m1", "job-b", "model-b", "txt2img", 30, 4096, held)
    assert reservations.start("m1", "job-a")
    clock.at_s += 40.0  # loading its model
    [running, queued] = ctx.machines.view("m1").queue
    assert (running.elapsed_s, running.done, running.left_s) == (40.0, None, None)  # no report: the estimate
    assert queued.elapsed_s is None and queued.done is None

    ctx.progress.report("job-a")  # claimed, no step yet
    ctx.progress.report("job-a", 1, 30)  # the first step: the rate's start
    clock.at_s += STEPS_EVERY_S  # reports are read into a snapshot at most this often
    running = ctx.machines.view("m1").queue[0]
    assert (running.done, running.left_s) == (pytest.approx(1 / 30), None)  # one report: no rate yet

    clock.at_s += 20.0 - STEPS_EVERY_S
    ctx.progress.report("job-a", 6, 30)  # 5 steps in 20 s: 4 s a step, 24 steps left
    clock.at_s += 2.0  # 2 s since that report
    [running, queued] = ctx.machines.view("m1").queue
    assert running.elapsed_s == 62.0
    assert running.done == pytest.approx(0.2)
    assert running.left_s == pytest.approx(4.0 * 24 - 2.0)
    assert queued.done is None and queued.left_s is None

    ctx.progress.report("job-a", 7, 30)  # read at the next refresh only
    clock.at_s += STEPS_EVERY_S / 2
    again = ctx.machines.view("m1").queue[0]
    assert again.done == pytest.approx(0.2)  # the figures read half a refresh ago
    assert again.left_s == pytest.approx(4.0 * 24 - 2.0 - STEPS_EVERY_S / 2)  # less the time since
    clock.at_s += STEPS_EVERY_S
    assert ctx.machines.view("m1").queue[0].done == pytest.approx(7 / 30)
    running = again

    # priced as placement prices it: the estimate's run there, blended with the measured rate
    estimator = Estimator({"m1": MachineProfile("m1", speed=1.0)}, {"model-a": ModelProfile("model-a", "sd1", 1)})
    run_s = estimator.run_s("m1", "model-a", "txt2img", 30, 4096)
    ahead_s, _ = drain("m1", warm_models=("model-a",), queue=(running,), protected=frozenset(), costs=estimator)
    assert ahead_s == pytest.approx(0.2 * (94.0 - STEPS_EVERY_S / 2) + 0.8 * (0.8 * run_s))
    assert ahead_s > 0.2 * 90.0 > 0.05 * run_s  # unreported, 62 s past a shorter estimate: 5 % of it
