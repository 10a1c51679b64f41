"""A running job's step report from its progress hash (app/fleet/running.py; R13, R14)."""

from __future__ import annotations

import pytest

from app.fleet.running import STEP_FIELDS, step_report
from routing.finish import StepReport


def reply(**fields: object) -> list[str | None]:
    return [None if fields.get(name) is None else str(fields[name]) for name in STEP_FIELDS]


def test_r14_two_step_reports_measure_the_seconds_per_step() -> None:
    # steps 2 -> 12 of 40 in 30 s: 3 s a step; the last report 5 s ago
    found = step_report(reply(step=12, total=40, at=130.0, first_step=2, first_at=100.0), now_s=135.0)
    assert found == StepReport(12, 40, since_s=5.0, step_s=pytest.approx(3.0))


@pytest.mark.parametrize(
    ("fields", "now_s", "expected"),
    [
        ({}, 0.0, None),  # nothing reported
        ({"at": 100.0}, 104.0, StepReport(0, 0, 4.0)),  # claimed, no step yet
        ({"step": 5, "total": 50, "at": 100.0, "first_step": 5, "first_at": 100.0}, 101.0, StepReport(5, 50, 1.0)),
        ({"step": 5, "total": 50, "at": 100.0}, 101.0, StepReport(5, 50, 1.0)),  # written before first_* were kept
        ({"step": 0, "total": 50, "at": 100.0, "first_step": 0, "first_at": 90.0}, 101.0, StepReport(0, 50, 1.0)),
        ({"step": "three", "total": 9, "at": 1.0}, 2.0, None),  # not numbers: ignored, never an error
        ({"step": 12, "total": 10, "at": 100.0, "first_step": 2, "first_at": 90.0}, 99.0, StepReport(10, 10, 0.0, 1.0)),
    ],
)
def test_r14_a_report_without_a_measured_rate_says_what_it_knows(
    fields: dict[str, object], now_s: float, expected: StepReport | None
) -> None:
    assert step_report(reply(**fields), now_s) == expected
