"""The journal's database: the engine (no side effect), every table, the Alembic migrations."""
