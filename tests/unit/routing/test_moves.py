"""routing.placement.best_move: which queued Auto job moves onto a machine that
has fallen idle, and by how many seconds it gains. Hand-computed figures: load 1 s (2.5 GB at
2.5 GB/s), a run of 10 steps x 1 s per step at speed 1.0 (20 s at speed 0.5)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from routing.estimate import Estimator, MachineProfile, ModelProfile
from routing.finish import WorkItem
from routing.placement import AUTO, JobRequest, MachineView, Move, best_move

FAMILY = "sd1"
COSTS = Estimator(
    {
        "a": MachineProfile("a", 1.0, 2.5e9, "unified", 100_000_000_000),
        "b": MachineProfile("b", 0.5, 2.5e9, "unified", 100_000_000_000),
    },
    {"m1": ModelProfile("m1", FAMILY, 2_500_000_000, 1.0)},
)
JOB = JobRequest("m1", FAMILY, "txt2img", AUTO, 10)
QUEUE = (WorkItem("m1", "txt2img", 10, elapsed_s=2.0), WorkItem("m1", "txt2img", 10), WorkItem("m1", "txt2img", 10))


def views(**changes: object) -> dict[str, MachineView]:
    a = MachineView("a", True, frozenset({FAMILY}), frozenset({"m1"}), len(QUEUE), QUEUE, warm_models=("m1",))
    b = MachineView("b", True, frozenset({FAMILY}), frozenset({"m1"}))
    return {"a": a, "b": replace(b, **changes)}


def test_the_last_queued_job_moves_when_it_would_finish_earlier_on_the_idle_machine() -> None:
    # position 1: 8 s left of the running job + its own 10 s = 18 s where it is; 21 s on b (1 s
    # load + 20 s run): it stays. Position 2: 28 s where it is, 21 s on b: it moves, 7 s earlier.
    move = best_move("b", views(), {"a": [(1, JOB), (2, JOB)]}, COSTS)
    assert move == Move("a", 2, "b", pytest.approx(7.0))


def test_a_job_that_gains_nothing_stays() -> None:
    assert best_move("b", views(), {"a": [(1, JOB)]}, COSTS) is None


def test_pinned_running_and_unrunnable_jobs_never_move() -> None:
    pinned = replace(JOB, target="a")
    assert best_move("b", views(), {"a": [(2, pinned)]}, COSTS) is None  # R10: there or nowhere
    assert best_move("b", views(), {"a": [(0, JOB)]}, COSTS) is None  # running: elapsed_s is set
    assert best_move("b", views(families=frozenset({"sdxl"})), {"a": [(2, JOB)]}, COSTS) is None
    assert best_move("b", views(online=False), {"a": [(2, JOB)]}, COSTS) is None


def test_only_an_idle_machine_takes_a_move() -> None:
    busy = views(backlog=1, queue=(WorkItem("m1", "txt2img", 10),))
    assert best_move("b", busy, {"a": [(2, JOB)]}, COSTS) is None
