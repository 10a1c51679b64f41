"""learned timing: the size exponent (size_exp, size_samples) and the run it was learned from

Revision ID: b1f7d3a9c5e2
Revises: c8e2a4f6d1b9
Create Date: 2026-12-06 17:00:00

``routing/timings.py`` now scales a step's seconds with the job's size to a learned power
(``size_exp``, 1 until two runs at least 2x apart in size teach it) instead of linearly. The
new columns hold it, how many pairs of runs taught it (``size_samples``) and the last run's
size and seconds per step (``anchor_size``, ``anchor_step_s``: the other half of the next
pair). Rows learned before keep their ``step_s`` and start linear, as they were.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "b1f7d3a9c5e2"
down_revision = "c8e2a4f6d1b9"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("learnedtiming", schema=None) as batch_op:
        batch_op.add_column(sa.Column("size_exp", sa.Float(), nullable=False, server_default="1"))
        batch_op.add_column(sa.Column("size_samples", sa.Integer(), nullable=False, server_default="0"))
        batch_op.add_column(sa.Column("anchor_size", sa.BigInteger(), nullable=False, server_default="0"))
        batch_op.add_column(sa.Column("anchor_step_s", sa.Float(), nullable=False, server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("learnedtiming", schema=None) as batch_op:
        for name in ("anchor_step_s", "anchor_size", "size_samples", "size_exp"):
            batch_op.drop_column(name)
