"""journal identity: the id that pairs a journal with its Redis (app/fleet/pairing.py)

Revision ID: b7c4e2f19a30
Revises: 6db26082a239
Create Date: 2026-11-30 15:50:00
"""

from __future__ import annotations

import uuid

import sqlalchemy as sa
import sqlmodel.sql.sqltypes
from alembic import op

revision = "b7c4e2f19a30"
down_revision = "6db26082a239"
branch_labels = None
depends_on = None


def upgrade() -> None:
    table = op.create_table(
        "journalidentity",
        sa.Column("id", sqlmodel.sql.sqltypes.AutoString(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    # One row, written once: a journal migrated from an earlier revision gets its identity here.
    op.bulk_insert(table, [{"id": uuid.uuid4().hex}])


def downgrade() -> None:
    op.drop_table("journalidentity")
