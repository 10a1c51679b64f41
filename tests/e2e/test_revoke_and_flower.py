"""Revokes from Flower and the celery CLI (C11), and Flower's task states against the journal,
end to end: a real API with a fast reconciliation, a real ``celery worker`` for m1,
a real Flower process (its HTTP API) and the real celery CLI against the test Redis, real tiny
pipelines. Faults are real: revokes with terminate (SIGTERM, SIGKILL), a worker killed with
SIGKILL, an input changed or removed on the server, a duplicate delivery."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from app.client import ApiError, HomefleetClient
from app.context import ServerContext, build_context
from app.core import keys
from app.core.celery_app import RUN_JOB_TASK
from app.core.config import Settings
from app.core.states import JobState
from app.core.tls import tls_context
from app.devtools.localfleet import LocalFleet
from app.devtools.procs import stop_process_group
from app.devtools.redis_server import free_port
from tests.helpers import (
    LONG_SIZE,
    TEST_API_KEY,
    fleet_files,
    pause,
    png,
    pool_process,
    resume,
    run_cli,
    settings_env,
    wait_for,
)

pytestmark = pytest.mark.e2e

MODEL = "tiny-sd"
EDIT_MODEL = "tiny-pix2pix"
# the most steps allowed, at LONG_SIZE: running while it is revoked, even on a starved host
LONG = {"prompt": "long", "steps": 150, **LONG_SIZE}
SHORT = {"prompt": "short", "steps": 2}
ENDS_WITHIN_S = 15.0  # "within seconds" (C11): a heartbeat (0.5 s here) and a round trip, with room for a busy host


@dataclass
class RevokeFleet:
    local: LocalFleet
    ctx: ServerContext
    client: HomefleetClient
    flower: str  # Flower's base URL

    def flower_task(self, job_id: str) -> dict[str, Any]:
        response = httpx.get(f"{self.flower}/api/task/info/{job_id}", timeout=10, verify=tls_context())
        return response.json() if response.status_code == 200 else {}

    def flower_state(self, job_id: str, expected: str, timeout_s: float = 30) -> dict[str, Any]:
        """Wait until Flower shows the task in state ``expected``; its info."""
        return wait_for(
            lambda: (info := self.flower_task(job_id)).get("state") == expected and info,
            timeout_s=timeout_s,
            poll_s=0.5,
            what=f"Flower to show job {job_id} as {expected} (it shows {self.flower_task(job_id)})",
        )

    def running(self, job_id: str) -> None:
        wait_for(
            lambda: int(self.ctx.redis.hget(self.ctx.keys.progress(job_id), "step") or 0) >= 1,
            timeout_s=120,
            what=f"job {job_id} to report a step",
        )

    def reserved(self, job_id: str) -> bool:
        return bool(self.ctx.redis.hexists(self.ctx.keys.reservations("m1"), job_id))

    def claims(self, job_id: str) -> int:
        return sum(1 for event in self.ctx.journal.events(job_id) if event.event == JobState.running)

    def pool_pid(self) -> int:
        return pool_process(self.local.processes["worker-m1"].pid).pid


def celery_cli(settings: Settings, *args: str) -> str:
    env = {**os.environ, "HOMEFLEET_REDIS_URL": settings.redis_url}
    done = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "app.celery", *args],
        env=env,
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


@pytest.fixture(scope="module")
def rfleet(
    tmp_path_factory: pytest.TempPathFactory, redis_base_url: str, tiny_models_dir: Path
) -> Iterator[RevokeFleet]:
    files = fleet_files(tmp_path_factory.mktemp("revoke"), f"{redis_base_url}/6", "m1", reconcile_interval_s=0.5)
    config, settings = files.config, files.settings
    local = LocalFleet(settings, config, files.fleet_file, forkserver=True)
    ctx = build_context(settings, config, migrate=True)
    client = HomefleetClient(local.api_url, api_key=TEST_API_KEY)
    port = free_port()
    flower: subprocess.Popen[bytes] | None = None
    try:
        for model in (MODEL, EDIT_MODEL):
            ctx.registry.add(tiny_models_dir / model, model_id=model)
            local.copy_model(model, "m1")
        local.start_api()
        local.logs_dir.mkdir(parents=True, exist_ok=True)
        with open(local.logs_dir / "flower.log", "ab") as log:
            flower = subprocess.Popen(
                [sys.executable, "-m", "app.cli", "flower", "--port", str(port)],
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, "HOMEFLEET_REDIS_URL": settings.redis_url, "FLOWER_UNAUTHENTICATED_API": "true"},
                start_new_session=True,
            )
        local.start_worker("m1")
        local.wait_online(["m1"], model_id=MODEL, timeout_s=180)
        url = f"http://127.0.0.1:{port}"

        def flower_hears_m1() -> bool:  # its event receiver is connected: the worker's heartbeats arrive
            try:
                rows = httpx.get(f"{url}/workers", params={"json": "1"}, timeout=5, verify=tls_context()).json()["data"]
            except (httpx.HTTPError, ValueError, KeyError):
                return False
            return any(row.get("hostname", "").startswith("m1@") for row in rows)

        wait_for(flower_hears_m1, timeout_s=90, poll_s=0.5, what="Flower to receive m1's events")
        yield RevokeFleet(local, ctx, client, url)
    finally:
        client.close()
        if flower is not None:
            stop_process_group(flower)
        local.stop()
        ctx.close()


def revoke(fleet: RevokeFleet, tool: str, job_id: str, terminate: bool = False, sig: str = "SIGTERM") -> None:
    """Revoke a job's task as an operator does: Flower's Revoke/Terminate (its HTTP API), or the
    celery CLI (``control revoke ID``; ``control terminate SIGNAL ID`` to terminate)."""
    if tool == "flower":
        params = {"terminate": "true", "signal": sig} if terminate else {}
        response = httpx.post(
            f"{fleet.flower}/api/task/revoke/{job_id}", params=params, timeout=30, verify=tls_context()
        )
        assert response.status_code == 200, response.text
    elif terminate:  # celery 5's CLI form of revoke(terminate=True, signal=...)
        assert f"terminate: {job_id}" in celery_cli(fleet.local.settings, "control", "terminate", sig, job_id)
    else:
        assert "revoked" in celery_cli(fleet.local.settings, "control", "revoke", job_id)


@pytest.mark.parametrize(("tool", "sig"), [("flower", "SIGTERM"), ("celery-cli", "SIGKILL")])
def test_c11_a_revoked_queued_job_is_cancelled_and_a_terminated_running_one_interrupted_within_seconds(
    rfleet: RevokeFleet, tool: str, sig: str
) -> None:
    """C11, its whole kind: revoke a queued job, then terminate the running one, from Flower's
    HTTP API (Terminate: SIGTERM) and from the celery CLI (``control terminate SIGKILL``). Each
    ends in the journal within seconds with its reservation released; the queued one never
    runs, the one queued behind runs once; drain and residency changes are not held up by a
    phantom; Flower shows both REVOKED; a terminate is no OOM (R21)."""
    ctx, client = rfleet.ctx, rfleet.client
    busy = client.submit(MODEL, "txt2img", LONG, target="m1")
    waiting = client.submit(MODEL, "txt2img", SHORT, target="m1")
    after = client.submit(MODEL, "txt2img", SHORT, target="m1")
    rfleet.running(busy["id"])
    pid = pause(ctx, busy["id"])  # running, at no CPU, while the queued job is revoked
    assert pid == rfleet.pool_pid()

    started = time.monotonic()
    revoke(rfleet, tool, waiting["id"])
    wait_for(
        lambda: ctx.journal.state_of(waiting["id"]) != JobState.queued,
        timeout_s=ENDS_WITHIN_S,
        poll_s=0.1,
        what="the revoked queued job to end in the journal",
    )
    cancelled_s = time.monotonic() - started
    job = ctx.journal.get(waiting["id"])
    assert (job.state, job.reason) == (JobState.cancelled, "revoked"), job.message
    # The journal first, then the message and the reservation (a moment later, in the same request).
    wait_for(
        lambda: waiting["id"] not in ctx.queues.queued_ids("m1") and not rfleet.reserved(waiting["id"]),
        timeout_s=ENDS_WITHIN_S,
        what="the revoked job's message and reservation to go",
    )
    assert ctx.queues.queued_ids("m1") == [after["id"]]  # its message removed; the next still waits
    assert ctx.journal.state_of(busy["id"]) == JobState.running  # revoking another job stops nothing

    resume(pid)  # the terminate finds it working, as an operator's does
    started = time.monotonic()
    revoke(rfleet, tool, busy["id"], terminate=True, sig=sig)
    wait_for(
        lambda: ctx.journal.state_of(busy["id"]) != JobState.running,
        timeout_s=ENDS_WITHIN_S,
        poll_s=0.1,
        what="the terminated running job to end in the journal",
    )
    interrupted_s = time.monotonic() - started
    job = ctx.journal.get(busy["id"])
    assert (job.state, job.reason) == (JobState.interrupted, "terminated"), job.message
    wait_for(lambda: not rfleet.reserved(busy["id"]), timeout_s=5, what="the terminated job's reservation to go")
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    print(
        f"\n{tool}: revoked queued job cancelled in {cancelled_s:.2f} s; "
        f"terminated ({sig}) running job interrupted in {interrupted_s:.2f} s"
    )

    assert client.wait(after["id"], timeout_s=180)["state"] == "succeeded"
    assert (rfleet.claims(after["id"]), rfleet.claims(waiting["id"]), rfleet.claims(busy["id"])) == (1, 0, 1)
    assert (
        ctx.journal.get(busy["id"]).state == JobState.interrupted
    )  # a late word from the dead process changes nothing
    assert ctx.residency.ooms("m1") == []  # an operator's terminate is no out-of-memory (R21)

    # Nothing phantom holds the machine: a drain ends at once, a residency change is taken.
    env = settings_env(ctx.settings)
    drained = run_cli("drain", "m1", "--timeout-s", "20", env=env)
    assert "m1: drained" in drained.stdout, drained.stdout
    run_cli("drain", "m1", "--undo", env=env)
    for models in ([MODEL], []):
        response = httpx.put(
            f"{rfleet.local.api_url}/v1/machines/m1/residency",
            json={"models": models},
            headers=rfleet.local.auth_headers,
            timeout=30,
            verify=tls_context(),
        )
        assert response.status_code == 200, response.text

    rfleet.flower_state(waiting["id"], "REVOKED")
    rfleet.flower_state(busy["id"], "REVOKED")
    rfleet.flower_state(after["id"], "SUCCESS")


def gone(pid: int) -> bool:
    """The process ``pid`` ended (or is a zombie its parent has not reaped yet)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.parametrize(("tool", "sig", "stopped"), [("flower", "SIGTERM", True), ("celery-cli", "SIGINT", False)])
def test_c11_a_terminated_job_s_pool_process_is_gone_within_seconds_whatever_it_does_and_the_next_job_runs(
    rfleet: RevokeFleet, tool: str, sig: str, stopped: bool
) -> None:
    """C11: a terminate ends the pool process within seconds, whatever it is doing, and the machine
    takes its next job. Two processes that a Python SIGTERM handler never ends: one that runs no
    bytecode (stopped with SIGSTOP, as inside a long native step; Flower's Terminate, SIGTERM),
    and one sent a signal pool processes ignore (``control terminate SIGINT``: the worker
    SIGKILLs it ``terminate_kill_after_s`` later). The journal says ``interrupted``
    (``terminated``, naming the real command), never an OOM (R21)."""
    ctx, client = rfleet.ctx, rfleet.client
    busy = client.submit(MODEL, "txt2img", LONG, target="m1")
    after = client.submit(MODEL, "txt2img", SHORT, target="m1")
    rfleet.running(busy["id"])
    pid = rfleet.pool_pid()
    if stopped:
        os.kill(pid, signal.SIGSTOP)  # from here it runs no Python at all, as in one long native call
    started = time.monotonic()
    try:
        revoke(rfleet, tool, busy["id"], terminate=True, sig=sig)
        wait_for(
            lambda: gone(pid),
            timeout_s=ENDS_WITHIN_S,
            poll_s=0.1,
            what=f"the terminated job's pool process {pid} to end",
        )
        gone_s = time.monotonic() - started
    finally:
        if not gone(pid):
            os.kill(pid, signal.SIGCONT)
    wait_for(
        lambda: ctx.journal.state_of(busy["id"]) != JobState.running,
        timeout_s=ENDS_WITHIN_S,
        poll_s=0.1,
        what="the terminated job to end in the journal",
    )
    job = ctx.journal.get(busy["id"])
    assert (job.state, job.reason) == (JobState.interrupted, "terminated"), job.message
    assert "control terminate SIGNAL JOB_ID" in (job.message or ""), job.message
    print(f"\n{tool} ({sig}{', stopped' if stopped else ''}): pool process gone in {gone_s:.2f} s")
    assert client.wait(after["id"], timeout_s=180)["state"] == "succeeded"  # the machine takes its next job
    assert rfleet.pool_pid() != pid
    assert ctx.residency.ooms("m1") == []  # an operator's terminate is no out-of-memory (R21)


@pytest.mark.parametrize("stuck", [False, True])
def test_cancel_a_running_job_ends_it_cancelled_within_seconds_and_the_machine_takes_the_next_job(
    rfleet: RevokeFleet, stuck: bool
) -> None:
    """``POST /v1/jobs/{id}/cancel`` on a running job (through HomefleetClient): 202, still
    ``running``; its worker stops between steps and the job ends ``cancelled`` saying how many
    steps ran. ``stuck``: its pool process runs no Python (SIGSTOP, as in a long native step):
    after ``cancel_grace_s`` (10 s) reconciliation ends it ``cancelled`` and the watchdog kills
    the process. Either way the machine takes its next job; a second cancel is 409."""
    ctx, client = rfleet.ctx, rfleet.client
    busy = client.submit(MODEL, "txt2img", LONG, target="m1")
    after = client.submit(MODEL, "txt2img", SHORT, target="m1")
    rfleet.running(busy["id"])
    pid = rfleet.pool_pid()
    if stuck:
        os.kill(pid, signal.SIGSTOP)
    started = time.monotonic()
    try:
        response = httpx.post(
            f"{rfleet.local.api_url}/v1/jobs/{busy['id']}/cancel",
            headers=rfleet.local.auth_headers,
            timeout=30,
            verify=tls_context(),
        )
        assert (response.status_code, response.json()["state"]) == (202, "running"), response.text
        job = client.wait(busy["id"], timeout_s=ctx.settings.cancel_grace_s + ENDS_WITHIN_S)
        ended_s = time.monotonic() - started
        if stuck:
            wait_for(lambda: gone(pid), timeout_s=ENDS_WITHIN_S, what=f"the stuck pool process {pid} to be killed")
    finally:
        if stuck and not gone(pid):
            os.kill(pid, signal.SIGCONT)
    assert (job["state"], job["reason"]) == ("cancelled", "cancelled"), job
    assert "cancelled by request while running, after " in job["message"], job["message"]
    if stuck:
        assert "its pool process was killed" in job["message"], job["message"]
        said = (rfleet.local.logs_dir / "worker-m1.log").read_text()
        assert f"job {busy['id']} was cancelled and did not stop between steps within cancel_grace_s" in said
    else:
        steps_done = int(job["message"].split("after ")[1].split(" of ")[0])
        assert 1 <= steps_done < LONG["steps"], job["message"]
        assert f"of {LONG['steps']} steps" in job["message"], job["message"]
    print(f"\ncancel (stuck={stuck}): running job cancelled in {ended_s:.2f} s: {job['message']}")
    wait_for(
        lambda: not rfleet.reserved(busy["id"]), timeout_s=ENDS_WITHIN_S, what="the cancelled job's reservation to go"
    )
    assert client.wait(after["id"], timeout_s=180)["state"] == "succeeded"  # the machine takes its next job
    with pytest.raises(ApiError) as refused:
        client.cancel(busy["id"])
    assert (refused.value.status_code, refused.value.reason) == (409, "not_cancellable_cancelled")
    assert ctx.residency.ooms("m1") == []
    if not stuck:  # (a killed pool process: Celery itself sends task-failed, WorkerLostError)
        rfleet.flower_state(busy["id"], "REVOKED")  # Flower agrees with the journal


def test_flower_task_states_agree_with_the_journal_for_every_end(rfleet: RevokeFleet) -> None:
    """succeeded -> SUCCESS; failed (an input removed) and failed integrity (an input whose bytes
    changed, R5) -> FAILURE; a refused redelivery leaves the state as the journal has it;
    cancelled -> REVOKED; interrupted (its worker killed) -> FAILURE, sent by the server's
    reconciliation. Flower's Failed counter for m1 counts the failures; a task shows its model,
    kind and machine."""
    ctx, client, local = rfleet.ctx, rfleet.client, rfleet.local
    counter_before = failed_counter(rfleet)

    def upload(colour: tuple[int, int, int]) -> str:
        data = png(32, 32, colour)  # inputs are stored by content: two distinct files
        response = httpx.post(
            f"{local.api_url}/v1/files",
            files={"file": ("in.png", data, "image/png")},
            headers=local.auth_headers,
            timeout=30,
            verify=tls_context(),
        )
        assert response.status_code in (200, 201), response.text
        return str(response.json()["id"])

    removed_input, changed_input = upload((10, 20, 30)), upload((200, 100, 50))
    busy = client.submit(MODEL, "txt2img", {"prompt": "busy", "steps": 8, **LONG_SIZE}, target="m1")
    failed = client.submit(EDIT_MODEL, "edit", {"prompt": "x", "image": removed_input, "steps": 1}, target="m1")
    integrity = client.submit(EDIT_MODEL, "edit", {"prompt": "x", "image": changed_input, "steps": 1}, target="m1")
    cancelled = client.submit(MODEL, "txt2img", SHORT, target="m1")
    ctx.inputs.get(removed_input).path.unlink()  # the worker will find no such input on the server
    ctx.inputs.get(changed_input).path.write_bytes(png(24, 24))  # the bytes no longer match their id
    assert client.cancel(cancelled["id"])["state"] == "cancelled"
    assert client.wait(busy["id"], timeout_s=180)["state"] == "succeeded"
    ended = {job["id"]: client.wait(job["id"], timeout_s=180) for job in (failed, integrity)}
    assert ended[failed["id"]]["state"] == "failed", ended[failed["id"]]
    assert (ended[integrity["id"]]["state"], ended[integrity["id"]]["reason"]) == ("failed", "integrity")

    info = rfleet.flower_state(busy["id"], "SUCCESS")
    assert busy["id"] in info["args"]
    for shown in (f"'model': '{MODEL}'", "'kind': 'txt2img'", "'machine': 'm1'"):
        assert shown in info["kwargs"], info["kwargs"]
    assert "integrity" in rfleet.flower_state(integrity["id"], "FAILURE")["exception"]
    rfleet.flower_state(failed["id"], "FAILURE")
    rfleet.flower_state(cancelled["id"], "REVOKED")

    # A second delivery of ended jobs (a restored or duplicated message) is refused at claim and
    # leaves Flower's state as the journal has it.
    for job_id in (busy["id"], integrity["id"]):
        ctx.celery.send_task(RUN_JOB_TASK, args=[job_id], task_id=job_id, queue=keys.queue("m1"))
        wait_for(
            lambda job_id=job_id: any(e.event == "running_refused" for e in ctx.journal.events(job_id)),
            timeout_s=60,
            what=f"the second delivery of {job_id} to be refused",
        )
    probe = client.submit(MODEL, "txt2img", SHORT, target="m1")  # behind both: their tasks have ended
    assert client.wait(probe["id"], timeout_s=180)["state"] == "succeeded"
    assert rfleet.flower_task(busy["id"])["state"] == "SUCCESS"
    assert rfleet.flower_task(integrity["id"])["state"] == "FAILURE"

    # Its worker killed under it: reconciliation ends it (worker_lost) and tells Flower.
    lost = client.submit(MODEL, "txt2img", LONG, target="m1")
    rfleet.running(lost["id"])
    local.stop_worker("m1", signal.SIGKILL)
    try:
        job = client.wait(lost["id"], timeout_s=60)
        assert (job["state"], job["reason"]) == ("interrupted", "worker_lost"), job
        assert "worker_lost" in rfleet.flower_state(lost["id"], "FAILURE")["exception"]
    finally:
        local.start_worker("m1")
        local.wait_online(["m1"], model_id=MODEL, timeout_s=180)

    failures = {failed["id"], integrity["id"], lost["id"]}
    listed = httpx.get(
        f"{rfleet.flower}/api/tasks", params={"state": "FAILURE"}, timeout=10, verify=tls_context()
    ).json()
    assert failures <= set(listed), sorted(listed)
    wait_for(
        lambda: failed_counter(rfleet) - counter_before == len(failures),
        timeout_s=30,
        poll_s=0.5,
        what=f"Flower's Failed counter of m1 to count {len(failures)} more (it counts "
        f"{failed_counter(rfleet) - counter_before})",
    )


def failed_counter(fleet: RevokeFleet) -> int:
    """Flower's Failed counter of m1's worker (its dashboard's column: task-failed events)."""
    rows = httpx.get(f"{fleet.flower}/workers", params={"json": "1"}, timeout=10, verify=tls_context()).json()["data"]
    return sum(int(row.get("task-failed", 0)) for row in rows if row.get("hostname", "").startswith("m1@"))


def test_flower_s_worker_page_lists_the_fleet_s_tasks(rfleet: RevokeFleet) -> None:
    """Flower's worker page ("Tasks" tab, "Task limits") lists what ``inspect registered``
    answers; an operator looks for the job task there to set its limits."""

    def registered() -> list[str]:
        response = httpx.get(f"{rfleet.flower}/api/workers", params={"refresh": "1"}, timeout=30, verify=tls_context())
        assert response.status_code == 200, response.text
        return next(
            (info.get("registered", []) for name, info in response.json().items() if name.startswith("m1@")), []
        )

    wait_for(lambda: registered(), timeout_s=30, poll_s=1, what="Flower to inspect m1")
    assert {"homefleet.run_job", "homefleet.sync"} <= set(registered()), registered()
    hostname = next(
        name
        for name in httpx.get(f"{rfleet.flower}/api/workers", timeout=30, verify=tls_context()).json()
        if name.startswith("m1@")
    )
    page = httpx.get(f"{rfleet.flower}/worker/{hostname}", timeout=30, verify=tls_context())
    assert page.status_code == 200
    assert "homefleet.run_job" in page.text and "homefleet.sync" in page.text, page.text[-3000:]
