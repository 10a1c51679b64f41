"""learned text timings per token: prompt_s, and text rows relearned

Revision ID: d4e8b2c6a913
Revises: d4e8b2c6a1f3
Create Date: 2026-12-02 17:50:00

``routing/timings.py`` now prices a ``text`` job per token: ``step_s`` seconds per new
token and the new ``prompt_s`` seconds per prompt token. A text row learned before held a step
at the reference size of a one-pixel job (16 x a token's seconds, no prompt term), so text rows
are dropped: the next finished text job on that (machine, model) teaches them again.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "d4e8b2c6a913"
down_revision = "d4e8b2c6a1f3"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("learnedtiming", schema=None) as batch_op:
        batch_op.add_column(sa.Column("prompt_s", sa.Float(), nullable=False, server_default="0"))
    op.execute("DELETE FROM learnedtiming WHERE kind = 'text'")


def downgrade() -> None:
    op.execute("DELETE FROM learnedtiming WHERE kind = 'text'")
    with op.batch_alter_table("learnedtiming", schema=None) as batch_op:
        batch_op.drop_column("prompt_s")
