"""A running job's step figures from its progress hash (app/fleet/running.py; R13, R14)."""

from __future__ import annotations

import pytest

from app.fleet.running import STEP_FIELDS, step_figures


def reply(**fields: object) -> list[str | None]:
    return [None if fields.get(name) is None else str(fields[name]) for name in STEP_FIELDS]


def test_r14_two_step_reports_give_the_share_done_and_what_the_rate_leaves() -> None:
    # steps 2 -> 12 of 40 in 30 s: 3 s a step, 28 steps left, 5 s since the last report
    done, left = step_figures(reply(step=12, total=40, at=130.0, first_step=2, first_at=100.0), now_s=135.0)
    assert done == pytest.approx(0.3)
    assert left == pytest.approx(3.0 * 28 - 5.0)


@pytest.mark.parametrize(
    ("fields", "now_s", "expected"),
    [
        ({}, 0.0, (None, None)),  # nothing reported
        ({"at": 100.0}, 100.0, (None, None)),  # claimed, no step yet
        (
            {"step": 5, "total": 50, "at": 100.0, "first_step": 5, "first_at": 100.0},
            101.0,
            (0.1, None),
        ),  # one step report
        ({"step": 5, "total": 50, "at": 100.0}, 101.0, (0.1, None)),  # written before first_* were kept
        ({"step": 0, "total": 50, "at": 100.0, "first_step": 0, "first_at": 90.0}, 101.0, (None, None)),
        ({"step": 3, "total": 0, "at": 100.0}, 101.0, (None, None)),  # no total: no share
        ({"step": "three", "total": 9, "at": 1.0}, 2.0, (None, None)),  # not numbers: ignored, never an error
        (
            {"step": 9, "total": 10, "at": 100.0, "first_step": 1, "first_at": 92.0},
            500.0,
            (0.9, 0.0),
        ),  # overdue: 0 left
    ],
)
def test_r14_without_a_measured_rate_step_figures_say_what_they_know(
    fields: dict[str, object], now_s: float, expected: tuple[float | None, float | None]
) -> None:
    assert step_figures(reply(**fields), now_s) == expected
