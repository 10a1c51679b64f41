"""model record: retired_at, when `homefleet models retire` took it out of service

Revision ID: c8e2a4f6d1b9
Revises: a9c2e4f6b813
Create Date: 2026-12-06 10:00:00

``modelrecord.retired_at``: the UTC time the model was retired (``homefleet models retire ID``);
NULL: in service, as every model registered before is. A retired record is kept (its jobs name
it, its id stays taken) but is listed, defaulted to and submitted to no more.
"""

from __future__ import annotations

import sqlalchemy as sa
import sqlmodel.sql.sqltypes
from alembic import op

revision = "c8e2a4f6d1b9"
down_revision = "a9c2e4f6b813"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("modelrecord", schema=None) as batch_op:
        batch_op.add_column(sa.Column("retired_at", sqlmodel.sql.sqltypes.UTCDateTime(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("modelrecord", schema=None) as batch_op:
        batch_op.drop_column("retired_at")
