"""Every command but ``db upgrade`` and ``serve`` checks the journal's revision with
one query against ``HEAD``, loading neither Alembic nor the version scripts (they
were 0.86-1.05 s of ``homefleet status``); an outdated journal is still refused."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from app.core.config import Settings
from app.core.errors import ConfigError
from app.db.engine import check_revision, create_engine
from app.db.migrations import head_revision, upgrade

ROOT = Path(__file__).resolve().parents[2]


def test_the_revision_check_loads_no_alembic_and_refuses_an_outdated_journal(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path / "server")
    engine = create_engine(settings)
    try:
        with pytest.raises(ConfigError, match=r"has no schema yet.*homefleet db upgrade"):
            check_revision(engine)
        upgrade(engine, "e5a7c3d9b214")  # the revision before the head
        with pytest.raises(ConfigError, match=r"is at revision e5a7c3d9b214.*homefleet db upgrade"):
            check_revision(engine)
        upgrade(engine)
    finally:
        engine.dispose()
    script = (
        "import sys\n"
        "from app.core.config import Settings\n"
        "from app.db.engine import check_revision, create_engine\n"
        f"print(check_revision(create_engine(Settings(data_dir={str(settings.data_dir)!r}))))\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'alembic', 'mako'}))"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT, check=True
    )
    assert done.stdout.split("\n")[:2] == [head_revision(), "[]"], done.stdout + done.stderr
