"""``python -m app.db.migrations revision "message"``: autogenerate a new schema revision."""

import sys

from app.db.migrations import revision

if len(sys.argv) != 3 or sys.argv[1] != "revision":
    raise SystemExit('usage: python -m app.db.migrations revision "message"')
revision(sys.argv[2])
