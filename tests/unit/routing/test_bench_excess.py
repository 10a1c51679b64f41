"""bench.sim.excess_by_machine: where Auto's mean bounded slowdown exceeds the forced floor
(docs/benchmarks.md, "Where Auto stands on the six traces"). The split must
add up to the policy's distance to the floor."""

from __future__ import annotations

import pytest

from bench.sim import excess_by_machine


def test_excess_is_split_by_machine_and_choice_and_adds_up() -> None:
    bounds = {0: 5.0, 1: 40.0, 2: 20.0, 3: 100.0}  # true fastest runs; job 0 is bounded at 10 s
    floor = {0: (0.5, True), 1: (1.0, True), 2: (3.0, False), 3: (1.0, False)}  # job 3: forced, floor 1.0
    completion = {0: 50.0, 1: 40.0, 2: 100.0, 3: 100.0}
    placed = {0: "mac4", 1: "mac4", 2: "server", 3: "mac5"}

    split = excess_by_machine(completion, placed, bounds, floor, 10.0, jobs=4)

    # job 0: 50 / 10 - 0.5 = 4.5 (choice); job 1: 1 - 1 = 0; job 2: 5 - 3 = 2 (forced); job 3: 0
    assert split == {"mac4": (pytest.approx(4.5 / 4), 0.0), "server": (0.0, pytest.approx(2.0 / 4)), "mac5": (0.0, 0.0)}
    policy = sum(completion[i] / max(bounds[i], 10.0) for i in completion) / 4
    at_floor = sum(value for value, _ in floor.values()) / 4
    assert sum(a + b for a, b in split.values()) == pytest.approx(policy - at_floor)


def test_a_job_missing_at_the_floor_is_left_out() -> None:
    split = excess_by_machine(
        {0: 30.0, 1: 30.0}, {0: "cuda1", 1: "cuda1"}, {0: 10.0, 1: 10.0}, {0: (1.0, True)}, 10.0, jobs=2
    )  # job 1 was refused at the floor
    assert split == {"cuda1": (pytest.approx(1.0), 0.0)}
