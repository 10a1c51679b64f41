"""Alembic environment: the tables are SQLModel's metadata; the connection is given by
:func:`app.db.migrations.upgrade` (never created here)."""

from __future__ import annotations

from alembic import context
from sqlmodel import SQLModel

import app.db.tables  # noqa: F401  (registers every table with the metadata)

connection = context.config.attributes["connection"]
context.configure(connection=connection, target_metadata=SQLModel.metadata, render_as_batch=True, compare_type=True)
with context.begin_transaction():
    context.run_migrations()
