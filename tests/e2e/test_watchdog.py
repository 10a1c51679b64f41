"""The watchdog and a lost pool process, end to end (R19, R21): a real API whose reconciliation
declares jobs hung after 60 s without progress (a test dates a job's last progress back
instead of waiting), a real ``celery worker`` for m1, real tiny pipelines. Faults are real
signals to m1's pool process: SIGSTOP (a hang), SIGKILL (what the kernel's OOM killer sends, here
without it)."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from app.client import ApiError, HomefleetClient
from app.context import ServerContext, build_context
from app.core.states import JobState
from app.db.tables import Job
from app.devtools.localfleet import LocalFleet
from app.devtools.procs import stop_process_group
from tasks.server_client import ServerClient
from tasks.watchdog import STACKS_SIGNAL, oom_kill_counters, sigkill_verdict
from tests.helpers import LONG_SIZE, TEST_API_KEY, fleet_files, pool_process, wait_for

pytestmark = pytest.mark.e2e

MODEL = "tiny-sd"
# Long enough to be running when a restart request arrives (LONG_SIZE: 112x112, ~0.145 CPU-s a step).
LONG = {"prompt": "long", "steps": 20, **LONG_SIZE}


@dataclass
class WatchedFleet:
    local: LocalFleet
    ctx: ServerContext
    client: HomefleetClient

    def pool_pid(self) -> int:
        """The pid of m1's one pool process (concurrency 1, R7)."""
        return pool_process(self.local.processes["worker-m1"].pid).pid

    def running(self, job_id: str) -> int:
        """Wait until ``job_id`` has reported a step; the pid of the pool process running it."""
        wait_for(
            lambda: int(self.ctx.redis.hget(self.ctx.keys.progress(job_id), "step") or 0) >= 1,
            timeout_s=120,
            what=f"job {job_id} to report a step",
        )
        return self.pool_pid()

    def silent_since(self, job_id: str, seconds: float) -> None:
        """Date the job's last progress ``seconds`` back, so reconciliation finds it hung now."""
        self.ctx.redis.hset(self.ctx.keys.progress(job_id), "at", time.time() - seconds)

    def log(self) -> str:
        return (self.local.logs_dir / "worker-m1.log").read_text(errors="replace")


@pytest.fixture(scope="module")
def watched(
    tmp_path_factory: pytest.TempPathFactory, redis_base_url: str, tiny_models_dir: Path
) -> Iterator[WatchedFleet]:
    files = fleet_files(
        tmp_path_factory.mktemp("watchdog"), f"{redis_base_url}/4", "m1", reconcile_interval_s=0.5, hung_after_s=60
    )
    config, settings = files.config, files.settings
    local = LocalFleet(settings, config, files.fleet_file, forkserver=True)
    ctx = build_context(settings, config, migrate=True)
    client = HomefleetClient(local.api_url, api_key=TEST_API_KEY)
    try:
        ctx.registry.add(tiny_models_dir / MODEL, model_id=MODEL)
        local.copy_model(MODEL, "m1")
        local.start_api()
        local.start_worker("m1")
        local.wait_online(["m1"], model_id=MODEL, timeout_s=180)
        yield WatchedFleet(local, ctx, client)
    finally:
        client.close()
        local.stop()
        ctx.close()


def test_r19_a_hung_job_that_no_pool_process_runs_kills_nothing(watched: WatchedFleet) -> None:
    """A job left ``running`` with nobody running it (its claim's answer was lost, or its
    process died) is declared hung; the innocent job running now is not killed for it."""
    ctx = watched.ctx
    stale = ctx.journal.add(
        Job(state=JobState.queued, model_id=MODEL, kind="txt2img", params={"prompt": "x"}, target="m1", machine="m1")
    )
    ctx.journal.claim(stale.id, "m1", worker_boot_id=ctx.machines.heartbeat("m1")["boot_id"])  # type: ignore[index]
    busy = watched.client.submit(MODEL, "txt2img", LONG, target="m1")
    pid = watched.running(busy["id"])
    watched.silent_since(stale.id, 120)
    wait_for(lambda: ctx.journal.get(stale.id).reason == "hung", timeout_s=30, what="the stale job to be declared hung")
    wait_for(
        lambda: f"job {stale.id} was declared hung" in watched.log(),
        timeout_s=30,
        what="m1's watchdog to read the restart request",
    )
    done = watched.client.wait(busy["id"], timeout_s=180)
    assert done["state"] == "succeeded", done
    assert watched.pool_pid() == pid  # the busy job's pool process lived on
    assert "restart request dropped" in watched.log()
    # The worker drops its running record after the server has journaled the result.
    wait_for(
        lambda: ctx.redis.get(ctx.keys.running("m1")) is None,
        timeout_s=30,
        what="m1 to drop the ended job's running record",
    )


def test_r19_the_pool_process_of_a_hung_job_is_killed_and_the_next_job_runs(watched: WatchedFleet) -> None:
    ctx = watched.ctx
    hung = watched.client.submit(MODEL, "txt2img", LONG, target="m1")
    pid = watched.running(hung["id"])
    os.kill(pid, STACKS_SIGNAL)  # where is it? its stacks in the worker's log, and it runs on
    wait_for(
        lambda: re.search(r'tasks/run_job\.py", line \d+ in run_claimed', watched.log()),
        timeout_s=60,
        what="the pool process's stacks in the worker's log",
    )
    os.kill(pid, signal.SIGSTOP)  # it hangs
    watched.silent_since(hung["id"], 120)
    wait_for(
        lambda: not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE,
        timeout_s=30,
        what="the watchdog to kill the hung job's pool process",
    )
    journaled = ctx.journal.get(hung["id"])
    assert (journaled.state, journaled.reason) == (JobState.interrupted, "hung")
    assert f"job {hung['id']} was declared hung; killing its pool process {pid}" in watched.log()
    after = watched.client.submit(MODEL, "txt2img", {"prompt": "after", "steps": 2}, target="m1")
    assert watched.client.wait(after["id"], timeout_s=180)["state"] == "succeeded"
    assert watched.pool_pid() != pid
    journaled = ctx.journal.get(hung["id"])  # the watchdog's own kill is no OOM (R21)
    assert (journaled.state, journaled.reason) == (JobState.interrupted, "hung")
    assert ctx.residency.ooms("m1") == []


def test_r21_a_pool_process_sigkilled_without_an_oom_kill_fails_its_job_and_remembers_no_oom(
    watched: WatchedFleet,
) -> None:
    """``kill -9`` of the pool process under its job (not the kernel's OOM killer: its counters,
    ``/proc/vmstat``'s ``oom_kill`` and the worker's cgroup's, do not move) fails the job as
    ``error`` saying so, and remembers no OOM: the same size, and a larger one, are taken again.
    (An OOM kill of the host meanwhile would make it an ``oom``: the test then says what it saw.)"""
    ctx = watched.ctx
    try:
        before = oom_kill_counters()
        job = watched.client.submit(MODEL, "txt2img", LONG, target="m1")
        pid = watched.running(job["id"])
        os.kill(pid, signal.SIGKILL)  # as `kill -9` does: the OOM killer's signal, without the OOM killer
        done = watched.client.wait(job["id"], timeout_s=60)
        journaled = ctx.journal.get(job["id"])
        if sigkill_verdict(before, oom_kill_counters())[0]:
            pytest.skip("no OOM-kill counter is readable here, or the host's OOM killer ran meanwhile")
        assert (done["state"], journaled.reason) == ("failed", "error"), journaled.message
        assert "killed by SIGKILL, not by the kernel's OOM killer" in (journaled.message or ""), journaled.message
        assert "no OOM remembered" in (journaled.message or "")
        assert ctx.residency.ooms("m1") == []
        bigger = {**LONG, "width": LONG["width"] * 2, "height": LONG["height"] * 2, "steps": 1}
        again = watched.client.submit(MODEL, "txt2img", bigger, target="m1")  # no remembered_oom
        assert watched.client.wait(again["id"], timeout_s=180)["state"] == "succeeded"  # a fresh pool process
    finally:
        ctx.residency.clear_ooms("m1")


def crash_and_restart(watched: WatchedFleet, worker_first: bool = False) -> None:
    """Hard-kill the API and m1's worker (SIGKILL to their process groups), start both again
    (the API first, or the worker while the API is still down) and wait until m1 is online.
    Started first, the worker must take nothing from its queue until the API is back: its
    start-up verification needs the server, and it consumes only after its first beat."""
    ctx = watched.ctx
    before = ctx.machines.heartbeat("m1")
    stop_process_group(watched.local.processes.pop("api"), signal.SIGKILL)
    watched.local.stop_worker("m1", signal.SIGKILL)
    if worker_first:
        queued = set(ctx.queues.queued_ids("m1"))
        retries = watched.log().count("(retrying in")
        watched.local.start_worker("m1")
        wait_for(
            lambda: watched.log().count("(retrying in") >= retries + 3,
            timeout_s=120,
            what="m1's new worker to try its start-up verification against the stopped API",
        )
        time.sleep(2)  # a consumer started meanwhile would have taken a message by now
        assert set(ctx.queues.queued_ids("m1")) == queued  # nothing taken while no claim can be made
        assert all(ctx.redis.get(ctx.keys.delivered(job_id)) is None for job_id in queued)
        watched.local.start_api()
    else:
        watched.local.start_api()
        watched.local.start_worker("m1")
    # The killed worker's heartbeat outlives it by its TTL: wait for the new boot's own.
    wait_for(
        lambda: (beat := ctx.machines.heartbeat("m1")) is not None and beat["boot_id"] != (before or {}).get("boot_id"),
        timeout_s=180,
        what="m1's new worker to beat",
    )
    watched.local.wait_online(["m1"], model_id=MODEL, timeout_s=180)


def test_c08_a_job_cut_by_a_server_and_worker_crash_is_interrupted_once_and_never_runs_again(
    watched: WatchedFleet,
) -> None:
    """C08: hard-kill the server and the worker while J1 runs, restart the worker, then the
    server. J1 is ``interrupted`` once and never comes back by itself; J2, queued behind it,
    waits in the list while the server is down and then runs once (R19: it is claimed by a
    boot that has beaten, so reconciliation never takes it for a lost worker's)."""
    ctx = watched.ctx
    j1 = watched.client.submit(MODEL, "txt2img", {**LONG, "prompt": "c08 j1"}, target="m1")
    j2 = watched.client.submit(MODEL, "txt2img", {"prompt": "c08 j2", "steps": 2}, target="m1")
    watched.running(j1["id"])
    assert j2["id"] in ctx.queues.queued_ids("m1")
    crash_and_restart(watched, worker_first=True)
    done = watched.client.wait(j2["id"], timeout_s=180)
    j2_journaled = ctx.journal.get(j2["id"])
    assert done["state"] == "succeeded", (
        j2_journaled.reason,
        j2_journaled.message,
        [(e.event, e.detail) for e in ctx.journal.events(j2["id"])],
    )
    wait_for(
        lambda: ctx.journal.get(j1["id"]).state == JobState.interrupted,
        timeout_s=60,
        what="reconciliation to mark J1 interrupted",
    )
    journaled = ctx.journal.get(j1["id"])
    assert journaled.reason in {"worker_lost", "worker_restarted"}, journaled.reason
    assert journaled.result_digest is None
    events = [e.event for e in ctx.journal.events(j1["id"])]
    assert events.count("running") == 1 and events.count("interrupted") == 1, events
    assert [e.event for e in ctx.journal.events(j2["id"])].count("running") == 1
    time.sleep(3)  # a resubmission or redelivery would show within a few passes (reconcile_interval_s=0.5)
    assert [e.event for e in ctx.journal.events(j1["id"])] == events
    assert [j.id for j in ctx.journal.list() if j.params.get("prompt") == "c08 j1"] == [j1["id"]]  # never resubmitted


def test_c08_an_oom_is_still_remembered_after_the_server_and_worker_crash(watched: WatchedFleet) -> None:
    """C08: if J1 died of OOM, an identical repeat is refused with the remembered reason, also
    after the server and the worker were hard-killed and started again (R21: durable)."""
    ctx = watched.ctx
    try:
        job = watched.client.submit(MODEL, "txt2img", LONG, target="m1")
        watched.running(job["id"])
        boot_id = json.loads(ctx.redis.get(ctx.keys.heartbeat("m1")))["boot_id"]
        worker = ServerClient(watched.local.api_url, ctx.fleet.machines["m1"].token, 30, boot_id, machine="m1")
        try:  # the report m1's worker sends for an OOM of its job (R21)
            worker.fail(job["id"], "oom", "RuntimeError: can't allocate memory")
        finally:
            worker.close()
        assert watched.client.wait(job["id"], timeout_s=60)["state"] == "failed"
        assert ctx.journal.get(job["id"]).reason == "oom"
        assert [r.job_id for r in ctx.residency.ooms("m1")] == [job["id"]]
        crash_and_restart(watched)
        assert [r.job_id for r in ctx.residency.ooms("m1")] == [job["id"]]  # R21: durable
        with pytest.raises(ApiError) as refused:
            watched.client.submit(MODEL, "txt2img", LONG, target="m1")
        assert (refused.value.status_code, refused.value.reason) == (422, "remembered_oom")
        assert "ran out of memory on machine 'm1'" in refused.value.message
    finally:
        ctx.residency.clear_ooms("m1")
