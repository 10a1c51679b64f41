"""``python -m app.migrations revision "message"``: autogenerate a new schema revision."""

import sys

from app.migrations import revision

if len(sys.argv) != 3 or sys.argv[1] != "revision":
    raise SystemExit('usage: python -m app.migrations revision "message"')
revision(sys.argv[2])
