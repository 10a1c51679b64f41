"""A running job's reported steps reach placement's snapshot (R13, R14): its step report (steps
done, the seconds since, the measured seconds per step) is set on its work item, read in the
same Redis command as the rest of the fleet at most once per ``STEPS_EVERY_S``, and priced by
``routing.finish.remaining_s``."""

from __future__ import annotations

import time

import pytest

from app.context import ServerContext
from app.fleet.lock import Fence
from app.fleet.machines import STEPS_EVERY_S
from routing.estimate import Estimator, MachineProfile, ModelProfile
from routing.finish import StepReport, drain


class Clock:
    """``time.time`` held still and moved by hand, for every module that reads it."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, at_s: float) -> None:
        self.at_s = at_s
        monkeypatch.setattr(time, "time", lambda: self.at_s)


def test_r14_reported_steps_set_a_running_job_s_step_report_and_its_price(
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
    assert (running.elapsed_s, running.report) == (40.0, None)  # nothing reported: the estimate
    assert queued.elapsed_s is None and queued.report is None

    ctx.progress.report("job-a")  # claimed, no step yet
    clock.at_s += STEPS_EVERY_S  # reports are read into a snapshot at most this often
    assert ctx.machines.view("m1").queue[0].report == StepReport(0, 0, since_s=STEPS_EVERY_S)
    ctx.progress.report("job-a", 1, 30)  # the first step: the rate's start
    clock.at_s += STEPS_EVERY_S
    running = ctx.machines.view("m1").queue[0]
    assert running.report == StepReport(1, 30, since_s=STEPS_EVERY_S)  # one step report: no rate yet

    clock.at_s += 20.0 - STEPS_EVERY_S
    ctx.progress.report("job-a", 6, 30)  # 5 steps in 20 s: 4 s a step, 24 steps left
    clock.at_s += 2.0  # 2 s since that report
    [running, queued] = ctx.machines.view("m1").queue
    assert running.elapsed_s == 63.0
    assert running.report == StepReport(6, 30, since_s=2.0, step_s=pytest.approx(4.0))
    assert queued.report is None

    ctx.progress.report("job-a", 7, 30)  # read at the next refresh only
    clock.at_s += STEPS_EVERY_S / 2
    again = ctx.machines.view("m1").queue[0]
    assert again.report == StepReport(6, 30, since_s=2.0 + STEPS_EVERY_S / 2, step_s=pytest.approx(4.0))  # aged
    clock.at_s += STEPS_EVERY_S
    assert ctx.machines.view("m1").queue[0].report.step == 7  # type: ignore[union-attr]

    # priced as placement prices it: 24 steps left at the measured 4 s, less the 2.5 s of the step under way
    estimator = Estimator({"m1": MachineProfile("m1", speed=1.0)}, {"model-a": ModelProfile("model-a", "sd1", 1)})
    run_s = estimator.run_s("m1", "model-a", "txt2img", 30, 4096)
    ahead_s, _ = drain("m1", warm_models=("model-a",), queue=(again,), protected=frozenset(), costs=estimator)
    assert ahead_s == pytest.approx(4.0 * 24 - 2.0 - STEPS_EVERY_S / 2)
    assert ahead_s > 0.05 * run_s  # unreported, 63 s past a shorter estimate: 5 % of it
