"""job results (n images per job) and requeued_from

Revision ID: d4e8b2c6a1f3
Revises: c3d9a1e5b7f2
Create Date: 2026-12-02 16:30:00
"""

from __future__ import annotations

import sqlalchemy as sa
import sqlmodel.sql.sqltypes
from alembic import op

revision = "d4e8b2c6a1f3"
down_revision = "c3d9a1e5b7f2"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("job", schema=None) as batch_op:
        # every result of a job in order (n images per request); NULL for jobs stored before: their one result_*
        batch_op.add_column(sa.Column("results", sa.JSON(), nullable=True))
        # the job this one was requeued from (POST /v1/jobs/{id}/requeue)
        batch_op.add_column(sa.Column("requeued_from", sqlmodel.sql.sqltypes.AutoString(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("job", schema=None) as batch_op:
        batch_op.drop_column("requeued_from")
        batch_op.drop_column("results")
