"""Residency commitments applied at worker start (R16), through a real ``celery worker``: once
its files are verified (R4), the worker loads its machine's committed models as protected, so
its heartbeat shows them warm before any job is submitted, and the first job does not cold-load.
A committed model that is not verified there is skipped with a warning."""

from __future__ import annotations

import json
import threading
import time

import pytest

from app.core.states import JobState
from tests.e2e.conftest import EDIT_MODEL, RunningFleet

pytestmark = pytest.mark.e2e

MACHINE = "m3"  # in the fleet config, no worker until a test starts one


def heartbeat(fleet: RunningFleet) -> dict:
    raw = fleet.ctx.redis.get(fleet.ctx.keys.heartbeat(MACHINE))
    return json.loads(raw) if raw else {}


def test_r16_committed_models_are_warm_at_worker_start_and_the_first_job_runs_warm(fleet: RunningFleet) -> None:
    model, http, local = fleet.model, fleet.client.http, fleet.local
    local.copy_model(model, MACHINE)  # EDIT_MODEL is registered but never copied to m3
    answer = http.put(f"/v1/machines/{MACHINE}/residency", json={"models": [model, EDIT_MODEL]})
    assert answer.status_code == 200, answer.text
    log_file = local.logs_dir / f"worker-{MACHINE}.log"
    log_start = log_file.stat().st_size if log_file.exists() else 0
    jobs_before = len(fleet.ctx.journal.list(machine=MACHINE))
    local.start_worker(MACHINE)
    try:
        deadline = time.monotonic() + 180
        while model not in heartbeat(fleet).get("warm_models", []):
            assert time.monotonic() < deadline, f"{model} not warm in m3's heartbeat: {heartbeat(fleet)}"
            time.sleep(0.2)
        beat = heartbeat(fleet)
        assert beat["warm_models"] == [model] and model in beat["verified_models"]
        assert EDIT_MODEL not in beat["verified_models"]
        assert len(fleet.ctx.journal.list(machine=MACHINE)) == jobs_before  # warm before any job was placed there
        log = log_file.read_bytes()[log_start:].decode(errors="replace")
        assert f"committed model {model} preloaded" in log
        assert f"committed model {EDIT_MODEL} is not verified here; not preloaded" in log

        job_id = fleet.client.submit(model, "txt2img", {"prompt": "x", "steps": 1}, target=MACHINE)["id"]
        assert fleet.client.wait(job_id, timeout_s=180)["state"] == "succeeded"
        journaled = fleet.ctx.journal.get(job_id)
        assert (journaled.cold_load, journaled.load_s) == (False, 0.0)  # the preloaded pipeline ran it
    finally:
        local.stop_worker(MACHINE)
        assert http.put(f"/v1/machines/{MACHINE}/residency", json={"models": []}).status_code == 200


def test_r16_r19_a_job_delivered_during_the_preload_is_claimed_at_once_and_never_lost(
    fleet: RunningFleet, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker's start-up preload (minutes for a large model) holds its model cache; a job
    delivered meanwhile has left the queue (early ack). It must be claimed at once: a job
    waiting unclaimed is `queued` with no message anywhere, which reconciliation ends as
    `lost`. Here this test process is m3's worker (a real runtime against the real API)."""
    from app.core.config import WorkerSettings
    from tasks import runtime
    from tasks.run_job import run_job

    ctx, local, model = fleet.ctx, fleet.local, fleet.model
    local.copy_model(model, MACHINE)
    settings = WorkerSettings(
        machine=MACHINE,
        models_dir=local.models_dir(MACHINE),
        redis_url=local.settings.redis_url,
        worker_token=ctx.fleet.machines[MACHINE].token,
        server_url=local.api_url,
    )
    rt = runtime.WorkerRuntime(settings, boot_id="boot-preload-test")
    monkeypatch.setattr(runtime, "_runtime", rt)
    beat = {"machine": MACHINE, "boot_id": rt.boot_id, "at": time.time(), "warm_models": []}
    ctx.redis.set(ctx.keys.heartbeat(MACHINE), json.dumps(beat), ex=120)
    ctx.redis.sadd(ctx.keys.verified(MACHINE), model)
    lock = rt.cache_lock
    lock.acquire()  # the preload is loading
    released = False
    try:
        job_id = fleet.client.submit(model, "txt2img", {"prompt": "x", "steps": 1}, target=MACHINE)["id"]
        assert ctx.redis.rpop(ctx.keys.queue_list(MACHINE)) is not None  # delivered: the message left the queue
        worker = threading.Thread(target=run_job, args=(job_id,), daemon=True)
        worker.start()
        deadline = time.monotonic() + 30
        while ctx.journal.get(job_id).state != JobState.running:
            assert time.monotonic() < deadline, ctx.journal.get(job_id).state
            time.sleep(0.1)
        # Two reconciliation passes with no grace for a missing message (R19): neither judges it.
        monkeypatch.setattr(ctx.settings, "lost_grace_s", 0.0)
        reconciler = ctx.reconciler()
        for _ in range(2):
            report = reconciler.run_once()
            assert job_id not in {**report.interrupted, **report.cancelled}, report
        assert ctx.journal.get(job_id).state == JobState.running
        lock.release()
        released = True
        worker.join(timeout=180)
        assert not worker.is_alive()
        assert ctx.journal.get(job_id).state == JobState.succeeded
    finally:
        if not released:
            lock.release()
        ctx.redis.delete(ctx.keys.heartbeat(MACHINE))
        ctx.redis.srem(ctx.keys.verified(MACHINE), model)


@pytest.mark.parametrize(
    ("working", "oom_killed", "reason", "remembered"),
    [(False, True, "error", 0), (True, True, "oom", 1), (True, False, "error", 0)],
    ids=["killed_while_waiting_for_the_preload", "oom_killed_while_running", "sigkilled_while_running"],
)
def test_r21_a_sigkill_is_the_jobs_oom_only_once_it_holds_the_model_cache(
    fleet: RunningFleet, working: bool, oom_killed: bool, reason: str, remembered: int
) -> None:
    """A pool process SIGKILLed under a job is that job's OOM (R21) only once the job holds the
    model cache, and only when the kernel's OOM-kill counters rose since the job started;
    killed while the job still waited for the start-up preload (R16), the preload's load was to
    blame: the job fails as ``error`` and no OOM is remembered for its size (its repeat would
    otherwise be refused for a fault that was not its own). The worker's parent process side
    (Watchdog.report_lost) reports to the real API. ``oom_killed``: the job's running record
    holds counters one below the kernel's now, as when the OOM killer killed one process
    since the job started (this host's OOM killer is not run by a test)."""
    from celery.exceptions import WorkerLostError

    from app.core.config import WorkerSettings
    from tasks.server_client import ServerClient
    from tasks.watchdog import Watchdog, mark_running, mark_working, oom_kill_counters

    ctx, local, model = fleet.ctx, fleet.local, fleet.model
    settings = WorkerSettings(
        machine=MACHINE,
        models_dir=local.models_dir(MACHINE),
        redis_url=local.settings.redis_url,
        worker_token=ctx.fleet.machines[MACHINE].token,
        server_url=local.api_url,
    )
    beat = {"machine": MACHINE, "boot_id": "boot-oom-test", "at": time.time(), "warm_models": []}
    ctx.redis.set(ctx.keys.heartbeat(MACHINE), json.dumps(beat), ex=120)
    ctx.redis.sadd(ctx.keys.verified(MACHINE), model)
    server = ServerClient(local.api_url, settings.worker_token, 30, "boot-oom-test", machine=MACHINE)
    assert ctx.residency.ooms(MACHINE) == []  # none left by an earlier test of the shared fleet
    try:
        job_id = fleet.client.submit(model, "txt2img", {"prompt": "x", "steps": 1}, target=MACHINE)["id"]
        assert ctx.redis.rpop(ctx.keys.queue_list(MACHINE)) is not None  # delivered
        server.claim(job_id, claim_id="claim-oom-test")
        mark_running(ctx.redis, ctx.keys, MACHINE, job_id)  # the task started: it waits for the cache
        if working:
            mark_working(ctx.redis, ctx.keys, MACHINE, job_id)  # it holds the cache: loading or running
        counters = oom_kill_counters()
        if not counters:  # no counter here (not Linux): every SIGKILL is taken as an OOM
            reason, remembered = ("oom", 1) if working else (reason, remembered)
        elif oom_killed:
            record = json.loads(ctx.redis.get(ctx.keys.running(MACHINE)))
            record["oom_kills"] = {source: count - 1 for source, count in counters.items()}
            ctx.redis.set(ctx.keys.running(MACHINE), json.dumps(record, sort_keys=True))
        lost = WorkerLostError("Worker exited prematurely: signal 9 (SIGKILL) Job: 0.")
        Watchdog(settings, ctx.redis, ctx.keys, "boot-oom-test").report_lost(job_id, lost)
        done = fleet.client.wait(job_id, timeout_s=60)
        journaled = ctx.journal.get(job_id)
        assert (done["state"], journaled.reason) == ("failed", reason), journaled.message
        assert len(ctx.residency.ooms(MACHINE)) == remembered
    finally:
        server.close()
        ctx.residency.clear_ooms(MACHINE)
        ctx.redis.delete(ctx.keys.heartbeat(MACHINE), ctx.keys.running(MACHINE))
        ctx.redis.srem(ctx.keys.verified(MACHINE), model)
