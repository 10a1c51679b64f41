"""durable machine drains

Revision ID: 01ed87cc5871
Revises: a2d7aa0d74d6
Create Date: 2026-12-07 20:40:45

``machinedrain``: the machines drained by ``homefleet drain`` (or ``machines remove``), the
durable copy of their ``Keys.draining`` flag in Redis, written back by reconciliation when Redis
lost its data (app/fleet/drains.py). Drains made before this revision are in Redis only until
drained again.
"""

from __future__ import annotations

import sqlalchemy as sa
import sqlmodel.sql.sqltypes
from alembic import op

revision = "01ed87cc5871"
down_revision = "a2d7aa0d74d6"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "machinedrain",
        sa.Column("machine", sqlmodel.sql.sqltypes.AutoString(), nullable=False),
        sa.Column("since_s", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("machine"),
    )


def downgrade() -> None:
    op.drop_table("machinedrain")
