"""learned timing: large misses in a row

Revision ID: 51e5abdc5a4d
Revises: 263ffe16fd24
Create Date: 2026-12-07 08:17:01

``learnedtiming.misses``: how many runs in a row missed the learned estimate by more than
``routing/timings.py`` ``SHIFT_RATIO``, signed (+ slower, - faster). ``SHIFT_RUNS`` of them in the
same direction make the latest run the figure outright (a change of regime) instead of being
folded into the moving average. Rows learned before start at 0.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "51e5abdc5a4d"
down_revision = "263ffe16fd24"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("learnedtiming", schema=None) as batch_op:
        batch_op.add_column(sa.Column("misses", sa.Integer(), nullable=False, server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("learnedtiming", schema=None) as batch_op:
        batch_op.drop_column("misses")
