"""What placement reads of a running job's progress (R13, R14): the share of its steps done
and the seconds its measured step rate leaves, from the progress hash its worker's reports keep
(``app/jobs/progress.py``, ``Keys.progress``), read in placement's snapshot of the fleet
(app/fleet/multiread.py ``PROGRESS``) and given to ``routing.finish.remaining_s`` through
``WorkItem.done`` and ``WorkItem.left_s``.
"""

from __future__ import annotations

from collections.abc import Sequence

STEP_FIELDS = ("step", "total", "at", "first_step", "first_at")
"""The fields placement reads of a running job's progress (app/fleet/multiread.py ``PROGRESS``)."""


def step_figures(reply: Sequence[str | None] | None, now_s: float) -> tuple[float | None, float | None]:
    """(share of its steps done, seconds the measured step rate leaves) of a running job, from
    the :data:`STEP_FIELDS` of its progress hash (``reply``, in that order; None or Nones when
    nothing is reported), ``now_s`` unix seconds; each None when unknown.

    The rate is measured between the first step report and the last (``at - first_at`` over
    ``step - first_step`` steps: the load before the first step is not in it); what it leaves is
    that rate times the steps left, less the seconds since the last report, at least 0. A
    single report gives the share done and no rate (R13, R14: placement's estimate of the
    running job, ``routing.finish.remaining_s``)."""
    if not reply or reply[0] is None or reply[1] is None:
        return None, None
    try:
        step, total = int(reply[0]), int(reply[1])
        at_s = float(reply[2] or 0.0)
        first_step = int(reply[3]) if reply[3] is not None else step
        first_at = float(reply[4]) if reply[4] is not None else at_s
    except ValueError:
        return None, None
    if total <= 0 or step <= 0:
        return None, None
    done = min(step / total, 1.0)
    if step <= first_step or at_s <= first_at:
        return done, None
    per_step_s = (at_s - first_at) / (step - first_step)
    return done, max(per_step_s * (total - step) - max(now_s - at_s, 0.0), 0.0)


__all__ = ["STEP_FIELDS", "step_figures"]
