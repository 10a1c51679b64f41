"""model record: a Hugging Face cache snapshot's repository and commit

Revision ID: 263ffe16fd24
Revises: b1f7d3a9c5e2
Create Date: 2026-12-07 06:00:56

``modelrecord.source_repo`` and ``source_revision``: for a model registered from a Hugging Face
cache snapshot (``source_format`` ``hf-cache``), the repository (``org/name``) and the commit of
the snapshot taken, so that a later download of the same repository can be told apart. NULL for
other sources and for snapshots registered before.
"""

from __future__ import annotations

import sqlalchemy as sa
import sqlmodel.sql.sqltypes
from alembic import op

revision = "263ffe16fd24"
down_revision = "b1f7d3a9c5e2"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("modelrecord", schema=None) as batch_op:
        batch_op.add_column(sa.Column("source_repo", sqlmodel.sql.sqltypes.AutoString(), nullable=True))
        batch_op.add_column(sa.Column("source_revision", sqlmodel.sql.sqltypes.AutoString(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("modelrecord", schema=None) as batch_op:
        batch_op.drop_column("source_revision")
        batch_op.drop_column("source_repo")
