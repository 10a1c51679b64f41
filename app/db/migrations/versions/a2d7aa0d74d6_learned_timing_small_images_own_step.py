"""learned timing: small images' own step

Revision ID: a2d7aa0d74d6
Revises: 51e5abdc5a4d
Create Date: 2026-12-07 10:00:00

``learnedtiming.small_step_s``: seconds a step of one image under ``routing/timings.py``
``MIN_SCALED_SIZE`` (256 x 256), learned from such runs, which price them; 0 until one is
measured. Small images no longer teach the step figure of larger ones, only raise it while it is
still the fleet file's guess. Rows learned before start at 0 (small images priced as before, as
the smallest scaled size, until one runs).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "a2d7aa0d74d6"
down_revision = "51e5abdc5a4d"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("learnedtiming", schema=None) as batch_op:
        batch_op.add_column(sa.Column("small_step_s", sa.Float(), nullable=False, server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("learnedtiming", schema=None) as batch_op:
        batch_op.drop_column("small_step_s")
