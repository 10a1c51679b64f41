"""The newest schema revision this version of Homefleet ships: the head of ``versions/``,
written by ``python -m app.db.migrations revision`` (a test checks it against Alembic's own
reading of the scripts)."""

HEAD = "01ed87cc5871"
