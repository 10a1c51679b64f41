"""A worker whose token the server refuses stops at start with a message naming the setting,
instead of retrying forever (a wrong token never becomes right). Real ``homefleet worker``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.e2e.conftest import RunningFleet

pytestmark = pytest.mark.e2e

MACHINE = "m3"  # in the fleet config, no worker until a test starts one


@pytest.mark.parametrize("token", ["unknown", "another_machines"])
def test_a_worker_with_a_wrong_token_exits_78_naming_the_setting(fleet: RunningFleet, token: str) -> None:
    """A token of no machine, or of another machine (m2's for m3: its every claim would be
    refused and its jobs lost), stops the worker at start."""
    local = fleet.local
    log_file = local.logs_dir / f"worker-{MACHINE}.log"
    log_start = log_file.stat().st_size if log_file.exists() else 0
    wrong = "wrong-token-".ljust(32, "x") if token == "unknown" else fleet.ctx.fleet.machines["m2"].token
    verified_m2 = fleet.ctx.redis.smembers(fleet.ctx.keys.verified("m2"))
    queue = fleet.ctx.keys.queue_list(MACHINE)
    fleet.ctx.redis.delete(fleet.ctx.keys.verified(MACHINE), fleet.ctx.keys.heartbeat(MACHINE))  # an earlier test's m3
    fleet.ctx.redis.lpush(queue, "waiting")  # stands for a queued job: the refused worker must not take it
    process = local.start_worker(MACHINE, extra_env={"HOMEFLEET_WORKER_TOKEN": wrong})
    try:
        assert process.wait(timeout=180) == 78  # EX_CONFIG
    finally:
        local.stop_worker(MACHINE)
        left = fleet.ctx.redis.lrange(queue, 0, -1)
        fleet.ctx.redis.delete(queue)
    assert left == ["waiting"]  # refused before it consumed anything
    log = log_file.read_text()[log_start:]
    assert "the server refused this worker's token" in log and "HOMEFLEET_WORKER_TOKEN" in log
    if token == "another_machines":
        assert "its token belongs to machine 'm2'" in log
    assert fleet.ctx.redis.get(fleet.ctx.keys.heartbeat(MACHINE)) is None  # it never advertised itself
    assert not fleet.ctx.redis.exists(fleet.ctx.keys.verified(MACHINE))
    assert fleet.ctx.redis.smembers(fleet.ctx.keys.verified("m2")) == verified_m2  # m2 untouched


def test_a_second_worker_for_a_machine_with_a_live_worker_exits_78_and_changes_nothing(
    fleet: RunningFleet, tmp_path: Path
) -> None:
    """One worker per machine: a second `homefleet worker --machine m1` (here with an empty
    model folder) would take m1's jobs and replace its verified models with none."""
    ctx, local = fleet.ctx, fleet.local
    before = json.loads(ctx.redis.get(ctx.keys.heartbeat("m1")))
    verified = ctx.redis.smembers(ctx.keys.verified("m1"))
    (tmp_path / "empty").mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOMEFLEET_")}
    env.update(
        {
            "HOMEFLEET_MACHINE": "m1",
            "HOMEFLEET_MODELS_DIR": str(tmp_path / "empty"),
            "HOMEFLEET_WORKER_TOKEN": ctx.fleet.machines["m1"].token,
            "HOMEFLEET_SERVER_URL": local.api_url,
            "HOMEFLEET_REDIS_URL": local.settings.redis_url,
            "HOMEFLEET_HEARTBEAT_INTERVAL_S": str(local.settings.heartbeat_interval_s),
            "HOMEFLEET_HEARTBEAT_TTL_S": str(local.settings.heartbeat_ttl_s),
        }
    )
    second = subprocess.run(
        [sys.executable, "-m", "app.cli", "worker"], env=env, capture_output=True, text=True, timeout=120
    )
    assert second.returncode == 78, second.stdout + second.stderr
    assert "another worker of this machine is running" in second.stdout + second.stderr
    # naming where it runs: the operator stops that one (a worker left running on a machine removed and added again)
    assert f"(boot {before['boot_id']}, pid {before['pid']} on host {before['host']})" in second.stdout + second.stderr
    after = json.loads(ctx.redis.get(ctx.keys.heartbeat("m1")))
    assert after["boot_id"] == before["boot_id"]  # the first one still beats
    assert ctx.redis.smembers(ctx.keys.verified("m1")) == verified  # and its verified models are as they were


def test_r7_a_worker_whose_lease_another_worker_took_stops_with_78_and_leaves_the_machine_to_it(
    fleet: RunningFleet,
) -> None:
    """A lease that vanished under a live worker (Redis lost its data) is taken back; one that
    another worker holds now (it started while this one's Redis stalled past the TTL) stops
    this worker: a warm shutdown, exit 78, and the other's heartbeat is left in place."""
    local, redis_client = fleet.local, fleet.ctx.redis
    local.start_worker(MACHINE)
    lease = fleet.ctx.keys.worker_lease(MACHINE)
    try:
        local.wait_online([MACHINE], timeout_s=180)
        boot_id = json.loads(redis_client.get(fleet.ctx.keys.heartbeat(MACHINE)))["boot_id"]
        assert redis_client.get(lease) == boot_id
        redis_client.delete(lease)  # as a Redis restart without persistence does
        deadline = time.monotonic() + 30
        while redis_client.get(lease) != boot_id:
            assert time.monotonic() < deadline, "the worker did not take its lease back"
            time.sleep(0.1)

        redis_client.set(lease, "boot-of-another-worker", ex=60)
        log_file = local.logs_dir / f"worker-{MACHINE}.log"
        deadline = time.monotonic() + 30
        while "another worker of this machine took the worker lease" not in log_file.read_text():
            assert time.monotonic() < deadline, "the worker did not notice"
            time.sleep(0.1)
        other_beat = json.dumps({"machine": MACHINE, "boot_id": "boot-of-another-worker"})
        redis_client.set(fleet.ctx.keys.heartbeat(MACHINE), other_beat, ex=60)  # the other worker's
        assert local.processes[f"worker-{MACHINE}"].wait(timeout=120) == 78  # EX_CONFIG
        assert redis_client.get(lease) == "boot-of-another-worker"
        assert redis_client.get(fleet.ctx.keys.heartbeat(MACHINE)) == other_beat  # neither rewritten nor deleted
    finally:
        local.stop_worker(MACHINE)
        redis_client.delete(lease, fleet.ctx.keys.heartbeat(MACHINE), fleet.ctx.keys.verified(MACHINE))
