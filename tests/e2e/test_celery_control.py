"""The celery CLI's control commands that would break a worker's rules are refused by the worker
(docs/operations.md, "The celery CLI and Flower"; tasks/control.py): ``add_consumer`` of another
machine's queue and ``cancel_consumer`` of its own (R8), ``pool_grow``, ``pool_shrink`` and
``autoscale`` (R7). A real API, real ``celery worker`` processes for m1 and m2, the real celery
CLI, the real tiny pipeline."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from app.client import HomefleetClient
from app.context import ServerContext, build_context
from app.core import keys
from app.core.config import Settings
from app.devtools.localfleet import LocalFleet
from tests.helpers import TEST_API_KEY, fleet_files, wait_for

pytestmark = pytest.mark.e2e

MODEL = "tiny-sd"
PARAMS = {"prompt": "a control command", "steps": 2}


@dataclass
class ControlFleet:
    local: LocalFleet
    ctx: ServerContext
    client: HomefleetClient

    def node(self, machine: str) -> str:
        """The machine's Celery node name, which its worker records once Celery is ready."""
        found = wait_for(lambda: self.ctx.redis.get(self.ctx.keys.node(machine)), what=f"{machine}'s node name")
        return str(found)


def celery(settings: Settings, *args: str) -> subprocess.CompletedProcess[str]:
    """``celery -A app.celery ARGS`` as an operator runs it, against the fleet's Redis."""
    return subprocess.run(
        [sys.executable, "-m", "celery", "-A", "app.celery", *args],
        env={**os.environ, "HOMEFLEET_REDIS_URL": settings.redis_url},
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )


def inspect(settings: Settings, command: str, node: str) -> object:
    """``celery inspect COMMAND --json -d NODE``: that node's answer."""
    done = celery(settings, "inspect", command, "--json", "-d", node)
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])[node]


@pytest.fixture(scope="module")
def cfleet(
    tmp_path_factory: pytest.TempPathFactory, redis_base_url: str, tiny_models_dir: Path
) -> Iterator[ControlFleet]:
    files = fleet_files(tmp_path_factory.mktemp("control"), f"{redis_base_url}/8", "m1", "m2", reconcile_interval_s=0.5)
    local = LocalFleet(files.settings, files.config, files.fleet_file, forkserver=True)
    ctx = build_context(files.settings, files.config, migrate=True)
    client = HomefleetClient(local.api_url, api_key=TEST_API_KEY)
    try:
        ctx.registry.add(tiny_models_dir / MODEL, model_id=MODEL)
        for machine in ("m1", "m2"):
            local.copy_model(MODEL, machine)
        local.start_api()
        for machine in ("m1", "m2"):
            local.start_worker(machine)
        local.wait_online(["m1", "m2"], model_id=MODEL, timeout_s=180)
        yield ControlFleet(local, ctx, client)
    finally:
        client.close()
        local.stop()
        ctx.close()


def test_control_commands_that_break_r7_or_r8_are_refused_and_every_job_runs_once_on_its_machine(
    cfleet: ControlFleet,
) -> None:
    settings = cfleet.local.settings
    m1 = cfleet.node("m1")
    assert m1.startswith("m1@"), m1
    # R8: m1 taking m2's queue would take m2's jobs, refused at their claim: lost
    added = celery(settings, "control", "add_consumer", keys.queue("m2"), "-d", m1)
    said = " ".join(added.stdout.split())
    assert "refused (add_consumer)" in said and "R8" in said, added.stdout + added.stderr
    # R8: m1 not reading its own queue would leave its jobs queued while it shows online
    cancelled = celery(settings, "control", "cancel_consumer", keys.queue("m1"), "-d", m1)
    said = " ".join(cancelled.stdout.split())
    assert "refused (cancel_consumer)" in said and "homefleet drain m1" in said, cancelled.stdout + cancelled.stderr
    queues = inspect(settings, "active_queues", m1)
    assert [queue["name"] for queue in queues] == [keys.queue("m1")]  # type: ignore[union-attr, index]
    # R7: one job at a time per device
    for command in (["pool_grow", "1"], ["pool_shrink", "1"], ["autoscale", "4", "1"]):
        answer = celery(settings, "control", *command, "-d", m1)
        said = " ".join(answer.stdout.split())
        assert f"refused ({command[0]})" in said and "R7" in said, answer.stdout + answer.stderr
    stats = inspect(settings, "stats", m1)
    assert len(stats["pool"]["processes"]) == 1, stats  # type: ignore[index]

    # jobs on both machines run, each once, on its own machine
    jobs = [cfleet.client.submit(MODEL, "txt2img", PARAMS, target=machine)["id"] for machine in ("m2", "m1", "m2")]
    ended = [cfleet.client.wait(job_id, timeout_s=240) for job_id in jobs]
    assert [(job["state"], job["machine"]) for job in ended] == [
        ("succeeded", "m2"),
        ("succeeded", "m1"),
        ("succeeded", "m2"),
    ], ended
