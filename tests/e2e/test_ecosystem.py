"""At home in its ecosystem: Flower and the celery CLI against the real fleet."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest
from celery.utils.nodenames import host_format

from app.core import keys
from app.core.tls import tls_context
from app.devtools.procs import stop_process_group
from app.devtools.redis_server import free_port
from tests.e2e.conftest import WORKERS, RunningFleet
from tests.helpers import LONG_SIZE, end_running, pause, wait_for

pytestmark = pytest.mark.e2e


def celery_cli(fleet: RunningFleet, *args: str) -> str:
    env = {**os.environ, "HOMEFLEET_REDIS_URL": fleet.local.settings.redis_url}
    done = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "app.celery", *args], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


@pytest.fixture
def flower_url(fleet: RunningFleet) -> Iterator[str]:
    port = free_port()
    env = {**os.environ, "HOMEFLEET_REDIS_URL": fleet.local.settings.redis_url, "FLOWER_UNAUTHENTICATED_API": "true"}
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


def test_flower_shows_every_machine_with_its_queue_and_the_exact_queue_lengths(
    fleet: RunningFleet, flower_url: str
) -> None:
    def workers() -> dict[str, object]:
        try:
            response = httpx.get(
                f"{flower_url}/api/workers", params={"refresh": "true"}, timeout=10, verify=tls_context()
            )
        except httpx.HTTPError:
            return {}
        return response.json() if response.status_code == 200 else {}

    wait_for(
        lambda: {n.split("@")[0] for n in workers()} >= set(WORKERS), timeout_s=90, what="Flower to see the workers"
    )
    for name, info in workers().items():
        machine = name.split("@")[0]
        assert [q["name"] for q in info["active_queues"]] == [keys.queue(machine)]  # type: ignore[index]

    busy = fleet.client.submit(fleet.model, "txt2img", {"prompt": "long", "steps": 20, **LONG_SIZE}, target="m2")
    waiting = [fleet.client.submit(fleet.model, "txt2img", {"prompt": "w", "steps": 1}, target="m2") for _ in range(2)]
    wait_for(lambda: fleet.client.get(busy["id"])["state"] == "running", what="the long job to start")
    lengths = httpx.get(f"{flower_url}/api/queues/length", timeout=10, verify=tls_context()).json()["active_queues"]
    flower_lengths = {q["name"]: q["messages"] for q in lengths}
    for machine in WORKERS:
        assert flower_lengths[keys.queue(machine)] == fleet.ctx.redis.llen(fleet.ctx.keys.queue_list(machine))
    assert flower_lengths[keys.queue("m2")] == 2

    for job in (busy, *waiting):
        assert fleet.client.wait(job["id"], timeout_s=300)["state"] == "succeeded"

    def task_page_shows_job() -> bool:
        response = httpx.get(f"{flower_url}/api/task/info/{busy['id']}", timeout=10, verify=tls_context())
        return response.status_code == 200 and response.json().get("state") == "SUCCESS"

    wait_for(task_page_shows_job, timeout_s=30, what="Flower's task page for the job")
    info = httpx.get(f"{flower_url}/api/task/info/{busy['id']}", timeout=10, verify=tls_context()).json()
    assert info["name"] == "homefleet.run_job" and info["worker"].startswith("m2@")


def test_celery_cli_inspects_and_purges_the_fleet(fleet: RunningFleet) -> None:
    # The most steps allowed: it outlasts two `inspect` round trips (each starts a celery process
    # and waits up to 2 s for m1's reply) even on a starved host, and is then terminated.
    busy = fleet.client.submit(fleet.model, "txt2img", {"prompt": "long", "steps": 150, **LONG_SIZE}, target="m1")
    waiting = fleet.client.submit(fleet.model, "txt2img", {"prompt": "w", "steps": 1}, target="m1")
    pause(fleet.ctx, busy["id"])  # running, at no CPU, until it is terminated below
    # -d: the answer comes with m1's reply rather than after the whole timeout (the node name as
    # the worker expands its own `-n m1@%h`, tasks/worker.py)
    m1 = ("-d", host_format("m1@%h"))
    active = celery_cli(fleet, "inspect", "active", "--timeout", "2", *m1)
    assert busy["id"] in active and waiting["id"] not in active
    reserved = celery_cli(fleet, "inspect", "reserved", "--timeout", "2", *m1)
    assert waiting["id"] not in reserved  # prefetch disabled: the next job stays in Redis
    assert fleet.ctx.queues.queued_ids("m1") == [waiting["id"]]
    purged = celery_cli(fleet, "purge", "-Q", keys.queue("m1"), "-f")
    assert "Purged 1 message" in purged, purged
    assert fleet.ctx.redis.llen(fleet.ctx.keys.queue_list("m1")) == 0
    end_running(fleet.ctx, busy["id"])  # done with it (celery control terminate)
    # The purged job never runs; reconciliation says so, as a purge (R19).
    deadline = time.monotonic() + fleet.local.settings.lost_grace_s + 60
    while fleet.client.get(waiting["id"])["state"] == "queued" and time.monotonic() < deadline:
        time.sleep(0.5)
    ended = fleet.client.get(waiting["id"])
    assert (ended["state"], ended["reason"]) == ("cancelled", "purged"), ended
    assert "removed from the queue machine.m1" in ended["message"]


def test_serve_logs_where_it_listens_and_no_line_per_request(fleet: RunningFleet) -> None:
    """`homefleet serve` says where it listens (uvicorn's own line), as a new operator expects,
    without one access-log line per request (workers claim and report through the same API)."""
    for _ in range(3):
        assert httpx.get(f"{fleet.local.api_url}/health", timeout=5, verify=tls_context()).status_code in (200, 503)
    log = (fleet.local.logs_dir / "api.log").read_text()
    assert f"Uvicorn running on {fleet.local.api_url}" in log, log[-2000:]
    assert "GET /health" not in log, log[-2000:]
