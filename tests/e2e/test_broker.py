"""The broker seen through the real tools (status, celery purge, restored messages, token files), on
a fleet of its own whose broker keys are under a prefix (kombu's ``global_keyprefix``,
HOMEFLEET_BROKER_KEY_PREFIX), as when one Redis serves several apps: a job runs; ``homefleet
status`` shows queued and running apart, the queued figure equal to LLEN of the exact key, as
Flower's; ``celery purge`` ends the purged jobs ``cancelled`` (``purged``); a message kombu restores
from its unacked set keeps its place in the line; the workers read their tokens from files (R8, R19,
C01)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from app.core.keys import queue
from app.core.tls import tls_context
from app.devtools.drills import MODEL, DrillFleet
from app.devtools.procs import stop_process_group
from app.devtools.redis_server import free_port
from tests.helpers import end_running, run_cli, settings_env, wait_for

pytestmark = pytest.mark.e2e

PREFIX = "shared-redis:"
VISIBILITY_S = 2  # short, so a message left unacked can be restored within the test


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, tiny_models_dir: Path) -> Iterator[DrillFleet]:
    with DrillFleet(
        tmp_path_factory.mktemp("broker"),
        tiny_models_dir / "tiny-sd",
        visibility_timeout_s=VISIBILITY_S,
        broker_key_prefix=PREFIX,
        forkserver=True,
    ) as running:
        yield running


def env_of(fleet: DrillFleet) -> dict[str, str]:
    assert fleet.ctx is not None
    return settings_env(fleet.ctx.settings)


def submit(fleet: DrillFleet, steps: int, machine: str = "m1") -> str:
    assert fleet.client is not None
    return str(
        fleet.client.submit(MODEL, "txt2img", {"prompt": f"broker {steps}", "steps": steps}, target=machine)["id"]
    )


def state(fleet: DrillFleet, job_id: str) -> str:
    assert fleet.ctx is not None
    return str(fleet.ctx.journal.get(job_id).state)


def busy_with_waiting(fleet: DrillFleet, waiting: int, machine: str = "m1") -> tuple[str, list[str]]:
    """A long job running on ``machine`` (150 steps: R22's most; several seconds) and ``waiting``
    short ones queued behind it. A test ends the long one (``end_running``) once it has seen
    what it needs: its steps would hold a core the other tests need."""
    long = submit(fleet, 150, machine)
    wait_for(lambda: state(fleet, long) == "running", timeout_s=120, what="the long job to start")
    return long, [submit(fleet, 1, machine) for _ in range(waiting)]


def status_row(fleet: DrillFleet, machine: str) -> dict[str, str]:
    """``homefleet status``'s row for ``machine``, by column name."""
    lines = run_cli("status", env=env_of(fleet)).stdout.splitlines()
    header = next(line for line in lines if "machine" in line and "queued" in line)
    names = [cell.strip() for cell in header.strip("┃│ ").replace("┃", "│").split("│")]
    for line in lines:
        cells = [cell.strip() for cell in line.strip("│ ").split("│")]
        if cells and cells[0] == machine:
            return dict(zip(names, cells, strict=True))
    raise AssertionError(f"no row for {machine} in {lines}")


def celery_cli(fleet: DrillFleet, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "app.celery", *args],
        env={**os.environ, **env_of(fleet)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


@pytest.fixture
def flower_url(fleet: DrillFleet) -> Iterator[str]:
    assert fleet.local is not None
    port = free_port()
    env = {**os.environ, **env_of(fleet), "FLOWER_UNAUTHENTICATED_API": "true"}
    log = open(fleet.local.logs_dir / "flower.log", "ab")  # noqa: SIM115 - closed below
    process = subprocess.Popen(
        [sys.executable, "-m", "app.cli", "flower", "--port", str(port)],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        stop_process_group(process)
        log.close()


def test_r8_under_a_broker_prefix_status_and_flower_count_the_exact_key_and_jobs_run(
    fleet: DrillFleet, flower_url: str
) -> None:
    assert fleet.ctx is not None and fleet.client is not None
    ctx = fleet.ctx
    assert ctx.keys.queue_list("m1") == f"{PREFIX}machine.m1"

    def flower_lengths() -> dict[str, int]:
        try:
            # Flower learns a worker's queues by inspecting it; one inspect sent before the
            # workers listened is not sent again by itself: ask for it, as a user's refresh does
            httpx.get(f"{flower_url}/api/workers", params={"refresh": "true"}, timeout=10, verify=tls_context())
            answer = httpx.get(f"{flower_url}/api/queues/length", timeout=10, verify=tls_context())
        except httpx.HTTPError:
            return {}
        found = {q["name"]: q["messages"] for q in answer.json()["active_queues"]} if answer.status_code == 200 else {}
        return found if queue("m1") in found else {}

    wait_for(flower_lengths, timeout_s=90, what="Flower to list m1's queue")
    long, waiting = busy_with_waiting(fleet, 2)
    row = status_row(fleet, "m1")
    assert (row["queued"], row["running"]) == ("2", "1"), row
    assert int(row["queued"]) == ctx.redis.llen(f"{PREFIX}machine.m1") == 2
    assert not ctx.redis.exists("machine.m1")  # nothing published outside the prefix
    assert flower_lengths()[queue("m1")] == ctx.redis.llen(ctx.keys.queue_list("m1")) == 2
    end_running(ctx, long)
    for job_id in waiting:
        assert fleet.client.wait(job_id, timeout_s=300)["state"] == "succeeded"
    assert status_row(fleet, "m1")["queued"] == "0"


def test_r19_celery_purge_under_the_prefix_ends_the_jobs_cancelled_as_purged(fleet: DrillFleet) -> None:
    assert fleet.client is not None
    long, waiting = busy_with_waiting(fleet, 2)
    purged = celery_cli(fleet, "purge", "-Q", queue("m1"), "-f")
    assert "Purged 2 messages" in purged, purged
    assert fleet.ctx is not None
    end_running(fleet.ctx, long)
    for job_id in waiting:
        job = fleet.client.wait(job_id, timeout_s=60)
        assert (job["state"], job["reason"]) == ("cancelled", "purged"), job
        assert "removed from the queue machine.m1" in job["message"] and "Redis" not in job["message"], job
    assert fleet.executions().keys().isdisjoint(waiting)  # never ran


_TAKE_AND_DIE = """
import os, sys
from kombu import Exchange, Queue
from app.core.celery_app import create_celery
from app.core.config import BrokerSettings
app = create_celery(BrokerSettings())
conn = app.connection_for_read()
channel = conn.default_channel
name = sys.argv[1]
message = Queue(name, Exchange(name), routing_key=name, channel=channel).get(no_ack=False)
print(message.headers["id"], flush=True)
os._exit(0)  # as a consumer killed before its ack: the message stays in kombu's unacked set
"""


def test_r19_a_message_restored_from_the_unacked_set_keeps_its_place_in_the_line(fleet: DrillFleet) -> None:
    """A consumer took m1's next message and died before acking it. kombu restores it after the
    visibility timeout (any worker's sweep; here kombu's own ``restore_visible``) with RPUSH, to
    the end the worker reads next (BRPOP): it runs first, as it would have, and the others follow
    in order. Meanwhile reconciliation leaves it queued (it is delivered-unacked)."""
    assert fleet.ctx is not None and fleet.client is not None
    ctx = fleet.ctx
    long, waiting = busy_with_waiting(fleet, 3)
    taken = subprocess.run(
        [sys.executable, "-c", _TAKE_AND_DIE, queue("m1")],
        env={**os.environ, **env_of(fleet)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert taken.returncode == 0, taken.stderr
    assert taken.stdout.strip() == waiting[0]
    assert waiting[0] in ctx.queues.unacked_ids() and ctx.redis.hlen(ctx.keys.unacked()) == 1
    assert ctx.queues.queued_ids("m1") == waiting[1:]
    time.sleep(VISIBILITY_S + 0.5)
    assert state(fleet, waiting[0]) == "queued"  # not purged: reconciliation sees it delivered-unacked
    with ctx.celery.connection_for_read() as connection:
        connection.default_channel.qos.restore_visible(num=10, interval=1)
    assert ctx.queues.queued_ids("m1") == waiting  # back at the head of the line: its place
    end_running(ctx, long)
    for job_id in waiting:
        assert fleet.client.wait(job_id, timeout_s=300)["state"] == "succeeded"
    assert [j for j in fleet.claim_order("m1") if j in waiting] == waiting
    assert all(fleet.executions()[j] == 1 for j in waiting)


def test_flowers_basic_auth_reaches_it_through_its_environment_not_its_command_line(fleet: DrillFleet) -> None:
    assert fleet.local is not None
    port, secret = free_port(), "operator:pw-0123456789"
    env = {**os.environ, **env_of(fleet)}
    env.pop("FLOWER_BASIC_AUTH", None)
    env.pop("FLOWER_UNAUTHENTICATED_API", None)
    process = subprocess.Popen(
        [sys.executable, "-m", "app.cli", "flower", "--port", str(port), "--basic-auth", secret],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:

        def answers() -> int:
            try:
                return httpx.get(f"http://127.0.0.1:{port}/api/workers", timeout=5, verify=tls_context()).status_code
            except httpx.HTTPError:
                return 0

        assert wait_for(answers, timeout_s=90, what="Flower to answer") == 401
        user, password = secret.split(":")
        assert (
            httpx.get(
                f"http://127.0.0.1:{port}/api/workers", auth=(user, password), timeout=10, verify=tls_context()
            ).status_code
            == 200
        )
        assert secret not in " ".join(psutil.Process(process.pid).cmdline())  # `ps` does not show it
    finally:
        stop_process_group(process)
