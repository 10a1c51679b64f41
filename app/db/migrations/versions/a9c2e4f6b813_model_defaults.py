"""model record: defaults, the model's own default job params

Revision ID: a9c2e4f6b813
Revises: f6b2d8e4a7c1
Create Date: 2026-12-05 01:30:00

``modelrecord.defaults``: JSON ``{param: value}`` given at registration (``homefleet models add
--default NAME=VALUE``), checked against the param spec of the kinds the model runs and applied
to a job that does not set the param (NULL: none, as for every model registered before).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "a9c2e4f6b813"
down_revision = "f6b2d8e4a7c1"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("modelrecord", schema=None) as batch_op:
        batch_op.add_column(sa.Column("defaults", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("modelrecord", schema=None) as batch_op:
        batch_op.drop_column("defaults")
