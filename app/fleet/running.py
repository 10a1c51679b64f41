"""What placement reads of a running job's progress (R13, R14): its steps done, its steps, the
seconds since its last report and its measured seconds per step, from the progress hash its
worker's reports keep (``app/jobs/progress.py``, ``Keys.progress``), read in placement's
snapshot of the fleet (app/fleet/multiread.py ``PROGRESS``) and given to
``routing.finish.remaining_s`` as ``WorkItem.report``.
"""

from __future__ import annotations

from collections.abc import Sequence

from routing.finish import StepReport

STEP_FIELDS = ("step", "total", "at", "first_step", "first_at")
"""The fields placement reads of a running job's progress (app/fleet/multiread.py ``PROGRESS``)."""


def step_report(reply: Sequence[str | None] | None, now_s: float) -> StepReport | None:
    """The :class:`~routing.finish.StepReport` of a running job from the :data:`STEP_FIELDS` of
    its progress hash (``reply``, in that order; Nones when nothing is kept), ``now_s`` unix
    seconds; None when nothing usable is there (no report at all, or not numbers).

    A claim's report (``at`` alone) is step 0; the step rate is measured between the first step
    report and the last (``at - first_at`` over ``step - first_step`` steps: the load before the
    first step is not in it), once there are two (R13, R14)."""
    if not reply or reply[2] is None:
        return None
    try:
        at_s = float(reply[2])
        step = int(reply[0]) if reply[0] is not None else 0
        total = int(reply[1]) if reply[1] is not None else 0
        first_step = int(reply[3]) if reply[3] is not None else step
        first_at = float(reply[4]) if reply[4] is not None else at_s
    except ValueError:
        return None
    since_s = max(now_s - at_s, 0.0)
    if step <= 0 or total <= 0:
        return StepReport(0, max(total, 0), since_s)
    step_s = (at_s - first_at) / (step - first_step) if step > first_step and at_s > first_at else None
    return StepReport(min(step, total), total, since_s, step_s)


__all__ = ["STEP_FIELDS", "step_report"]
