"""The journal's revision check reads ``HEAD`` (app/db/migrations/head.py) instead of loading
Alembic and every version script (``homefleet status``); that constant must be the
head Alembic itself finds in ``versions/``, or every command but ``db upgrade`` and ``serve``
would refuse a migrated journal, or accept an outdated one."""

from __future__ import annotations

from alembic.config import Config
from alembic.script import ScriptDirectory

from app.db.migrations import SCRIPTS, head_revision


def test_head_is_the_one_head_of_the_version_scripts() -> None:
    config = Config()
    config.set_main_option("script_location", str(SCRIPTS))
    heads = ScriptDirectory.from_config(config).get_heads()
    assert heads == [head_revision()]
