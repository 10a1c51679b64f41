"""webhooks: a job's webhook_url, and the webhook deliveries

Revision ID: e5a1c7d93b20
Revises: e5a7c3d9b214
Create Date: 2026-12-03 08:00:00

``job.webhook_url``: where the job's record is POSTed when it ends, signed with the secret of its
``api_key_id`` (added by ``e5a7c3d9b214``); NULL for the jobs before. ``webhookdelivery``: the
deliveries, written with the terminal transition and resumed by the server after a restart.
"""

from __future__ import annotations

import sqlalchemy as sa
import sqlmodel.sql.sqltypes
from alembic import op

revision = "e5a1c7d93b20"
down_revision = "e5a7c3d9b214"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("job", schema=None) as batch_op:
        batch_op.add_column(sa.Column("webhook_url", sqlmodel.sql.sqltypes.AutoString(), nullable=True))
    op.create_table(
        "webhookdelivery",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("job_id", sqlmodel.sql.sqltypes.AutoString(), nullable=False),
        sa.Column("url", sqlmodel.sql.sqltypes.AutoString(), nullable=False),
        sa.Column("job_state", sqlmodel.sql.sqltypes.AutoString(), nullable=False),
        sa.Column("state", sqlmodel.sql.sqltypes.AutoString(), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("due_s", sa.Float(), nullable=False),
        sa.Column("lease_s", sa.Float(), nullable=True),
        sa.Column("created_at", sqlmodel.sql.sqltypes.UTCDateTime(), nullable=False),
        sa.Column("finished_at", sqlmodel.sql.sqltypes.UTCDateTime(), nullable=True),
        sa.Column("detail", sqlmodel.sql.sqltypes.AutoString(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("webhookdelivery", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_webhookdelivery_job_id"), ["job_id"], unique=False)
        batch_op.create_index(batch_op.f("ix_webhookdelivery_state"), ["state"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("webhookdelivery", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_webhookdelivery_state"))
        batch_op.drop_index(batch_op.f("ix_webhookdelivery_job_id"))
    op.drop_table("webhookdelivery")
    with op.batch_alter_table("job", schema=None) as batch_op:
        batch_op.drop_column("webhook_url")
