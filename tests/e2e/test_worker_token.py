"""A worker whose token the server refuses stops at start with a message naming the setting,
instead of retrying forever (a wrong token never becomes right). Real ``homefleet worker``."""

from __future__ import annotations

import pytest

from tests.e2e.conftest import RunningFleet

pytestmark = pytest.mark.e2e

MACHINE = "m3"  # in the fleet config, no worker until a test starts one


def test_a_worker_with_a_wrong_token_exits_78_naming_the_setting(fleet: RunningFleet) -> None:
    local = fleet.local
    log_file = local.logs_dir / f"worker-{MACHINE}.log"
    log_start = log_file.stat().st_size if log_file.exists() else 0
    process = local.start_worker(MACHINE, extra_env={"HOMEFLEET_WORKER_TOKEN": "wrong-token-".ljust(32, "x")})
    try:
        assert process.wait(timeout=180) == 78  # EX_CONFIG
    finally:
        local.stop_worker(MACHINE)
    log = log_file.read_text()[log_start:]
    assert "the server refused this worker's token" in log and "HOMEFLEET_WORKER_TOKEN" in log
    assert fleet.ctx.redis.get(fleet.ctx.keys.heartbeat(MACHINE)) is None  # it never advertised itself
