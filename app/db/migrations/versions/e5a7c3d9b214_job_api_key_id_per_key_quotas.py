"""job api_key_id: who submitted it, for per-key quotas

Revision ID: e5a7c3d9b214
Revises: d4e8b2c6a913
Create Date: 2026-12-03 08:00:00

Each job records the id of the API key that submitted it: the name of the key's quota, or a
short digest of the key (``key:<12 hex>``), never the key itself. Two indexes: the quota check
counts a key's queued and running jobs, and its GPU-seconds of the last hour, under the fleet
lock. Jobs journaled before have none (NULL) and count against no key.
"""

from __future__ import annotations

import sqlalchemy as sa
import sqlmodel.sql.sqltypes
from alembic import op

revision = "e5a7c3d9b214"
down_revision = "d4e8b2c6a913"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("job", schema=None) as batch_op:
        batch_op.add_column(sa.Column("api_key_id", sqlmodel.sql.sqltypes.AutoString(), nullable=True))
        batch_op.create_index("ix_job_api_key_id_state", ["api_key_id", "state"], unique=False)
        batch_op.create_index("ix_job_api_key_id_finished_at", ["api_key_id", "finished_at"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("job", schema=None) as batch_op:
        batch_op.drop_index("ix_job_api_key_id_finished_at")
        batch_op.drop_index("ix_job_api_key_id_state")
        batch_op.drop_column("api_key_id")
