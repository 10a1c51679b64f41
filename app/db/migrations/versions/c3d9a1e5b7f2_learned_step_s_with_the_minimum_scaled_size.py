"""learned step_s with the minimum scaled size: timings learned from jobs under 256x256 replayed

Revision ID: c3d9a1e5b7f2
Revises: b7c4e2f19a30
Create Date: 2026-11-30 16:45:00

``routing/timings.py`` now prices a job smaller than ``MIN_SCALED_SIZE`` (256 x 256) like one
of that size. A ``learnedtiming`` row taught by such jobs under the old rule (run time scaled
by pixels alone) holds a step up to 16 times too dear for the demo's 64x64 jobs under the new
one. Each such row's ``step_s`` is replayed here from the journal's finished runs of that
(machine, model, kind), in the order they finished, with the rule and EMA weight of
``routing.timings``. Rows no small job taught are left as they are; ``load_s`` is unchanged.
"""

from __future__ import annotations

import json
from collections import defaultdict

import sqlalchemy as sa
from alembic import op

from app.core.kinds import job_request
from routing.timings import EMA_WEIGHT, MIN_SCALED_SIZE, REFERENCE_SIZE

revision = "c3d9a1e5b7f2"
down_revision = "b7c4e2f19a30"
branch_labels = None
depends_on = None


def upgrade() -> None:
    connection = op.get_bind()
    runs = connection.execute(
        sa.text(
            "SELECT machine, model_id, kind, params, run_s FROM job WHERE state IN ('succeeded', 'failed') "
            "AND machine IS NOT NULL AND run_s > 0 ORDER BY finished_at, created_at"
        )
    )
    measured: dict[tuple[str, str, str], list[float]] = defaultdict(list)
    small: set[tuple[str, str, str]] = set()
    for machine, model_id, kind, params, run_s in runs:
        params = json.loads(params) if isinstance(params, str) else params
        request = job_request(model_id, "", kind, machine, params)
        key = (machine, model_id, kind)
        measured[key].append(run_s / max(1, request.steps) * REFERENCE_SIZE / max(request.size, MIN_SCALED_SIZE))
        if request.size < MIN_SCALED_SIZE:
            small.add(key)
    for key in sorted(small):
        step_s = None
        for value in measured[key]:
            step_s = value if step_s is None else (1 - EMA_WEIGHT) * step_s + EMA_WEIGHT * value
        connection.execute(
            sa.text(
                "UPDATE learnedtiming SET step_s = :step_s WHERE machine = :machine "
                "AND model_id = :model_id AND kind = :kind"
            ),
            {"step_s": step_s, "machine": key[0], "model_id": key[1], "kind": key[2]},
        )


def downgrade() -> None:
    pass  # the old rule's figures are not kept; timings relearn from the next runs
