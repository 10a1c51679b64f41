"""A failed fleet test's report carries its fleet's logs (tests/conftest.py ``fleet_log_tails``):
CI keeps only its output, so the worker's last lines are the evidence of a stuck job."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

from app.core.config import Settings
from app.devtools.localfleet import LocalFleet
from tests.conftest import LOG_TAIL_LINES, fleet_log_tails
from tests.helpers import make_fleet


def test_a_fleets_logs_are_tailed_newest_first_whether_held_directly_or_as_local(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path / "server", redis_url="redis://127.0.0.1:1/0")
    local = LocalFleet(settings, make_fleet("m1"), tmp_path / "fleet.toml")
    local.logs_dir.mkdir(parents=True)
    (local.logs_dir / "api.log").write_text("".join(f"api line {i}\n" for i in range(100)))
    (local.logs_dir / "worker-m1.log").write_text("claimed job j1\nstep 3/40\n")
    os.utime(local.logs_dir / "api.log", (1, 1))  # older than the worker's
    item = SimpleNamespace(funcargs={"fleet": SimpleNamespace(local=local), "local": local, "other": 3})

    tails = fleet_log_tails(item)  # type: ignore[arg-type]

    assert [name for name, _ in tails] == ["server/worker-m1.log", "server/api.log"]  # once each, newest first
    assert tails[0][1] == "claimed job j1\nstep 3/40"
    api_lines = tails[1][1].splitlines()
    assert len(api_lines) == LOG_TAIL_LINES and api_lines[-1] == "api line 99"


def test_a_test_without_a_fleet_reports_no_logs() -> None:
    assert fleet_log_tails(SimpleNamespace(funcargs={"tmp_path": Path("/")})) == []  # type: ignore[arg-type]


def test_a_log_that_cannot_be_read_is_named_with_the_reason_not_dropped(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path / "server", redis_url="redis://127.0.0.1:1/0")
    local = LocalFleet(settings, make_fleet("m1"), tmp_path / "fleet.toml")
    (local.logs_dir / "worker-m1.log").mkdir(parents=True)  # a folder where the log should be: EISDIR
    [(name, text)] = fleet_log_tails(SimpleNamespace(funcargs={"local": local}))  # type: ignore[arg-type]
    assert name == "server/worker-m1.log" and text.startswith("(the log could not be read: ")
