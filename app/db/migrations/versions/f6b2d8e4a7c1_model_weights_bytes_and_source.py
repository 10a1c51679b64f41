"""model record: weights_bytes priced at registration, source_format and source_digest

Revision ID: f6b2d8e4a7c1
Revises: e5a1c7d93b20
Create Date: 2026-12-04 22:30:00

``modelrecord.weights_bytes``: the bytes the loaded variant holds, priced once at registration
from the files taken (NULL for a model registered before: priced from its files when asked).
``source_format`` and ``source_digest``: what a model was registered from (a folder, a Hugging
Face cache snapshot, a single-file checkpoint or a LoRA file) and that file's digest.
"""

from __future__ import annotations

import sqlalchemy as sa
import sqlmodel.sql.sqltypes
from alembic import op

revision = "f6b2d8e4a7c1"
down_revision = "e5a1c7d93b20"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("modelrecord", schema=None) as batch_op:
        batch_op.add_column(sa.Column("weights_bytes", sa.BigInteger(), nullable=True))
        batch_op.add_column(sa.Column("source_format", sqlmodel.sql.sqltypes.AutoString(), nullable=True))
        batch_op.add_column(sa.Column("source_digest", sqlmodel.sql.sqltypes.AutoString(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("modelrecord", schema=None) as batch_op:
        batch_op.drop_column("source_digest")
        batch_op.drop_column("source_format")
        batch_op.drop_column("weights_bytes")
