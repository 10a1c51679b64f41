"""A worker whose token the server refuses while it runs (``homefleet machines rotate-token``)
stops consuming and exits 78, as a worker whose token is refused at start does, and its
machine goes offline: submissions get 503 ``machine_unavailable``. The job whose claim was
refused never ran: reconciliation publishes it again to the machine's queue (R8, R19), and the
worker started with the new token runs it, once. A real API, a real ``celery worker``, the
operator's real CLI."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from app.client import ApiError, HomefleetClient
from app.context import ServerContext, build_context
from app.core.states import JobState
from app.devtools.localfleet import LocalFleet
from app.fleet import live
from tests.helpers import LONG_SIZE, TEST_API_KEY, fleet_files, run_cli, wait_for

pytestmark = pytest.mark.e2e

MODEL = "tiny-sd"
MACHINE = "m1"
JOB = {"prompt": "after the rotation", "steps": 2}


@dataclass
class RotatedFleet:
    local: LocalFleet
    ctx: ServerContext
    client: HomefleetClient
    operator: dict[str, str]
    fleet_file: Path


@pytest.fixture
def rotated(tmp_path: Path, redis_base_url: str, tiny_models_dir: Path) -> Iterator[RotatedFleet]:
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    files = fleet_files(data_dir, f"{redis_base_url}/15", MACHINE, reconcile_interval_s=0.5, lost_grace_s=1.0)
    config, fleet_file, settings, operator = files.config, files.fleet_file, files.settings, files.operator
    local = LocalFleet(settings, config, fleet_file, forkserver=True)
    ctx = build_context(settings, config, migrate=True)
    client = HomefleetClient(local.api_url, api_key=TEST_API_KEY)
    try:
        ctx.registry.add(tiny_models_dir / MODEL, model_id=MODEL)
        local.copy_model(MODEL, MACHINE)
        local.start_api()
        local.start_worker(MACHINE)
        local.wait_online([MACHINE], model_id=MODEL, timeout_s=180)
        yield RotatedFleet(local, ctx, client, operator, fleet_file)
    finally:
        client.close()
        local.stop()
        ctx.close()


def test_a_worker_whose_token_is_rotated_exits_78_and_its_refused_job_runs_once_with_the_new_token(
    rotated: RotatedFleet,
) -> None:
    ctx, local, client = rotated.ctx, rotated.local, rotated.client
    worker = local.processes[f"worker-{MACHINE}"]
    log_file = local.logs_dir / f"worker-{MACHINE}.log"
    run_cli("machines", "rotate-token", MACHINE, env=rotated.operator)  # waits for the server's reload
    new_token = live.parse(rotated.fleet_file.read_text(), "fleet").machines[MACHINE].token

    job = client.submit(MODEL, "txt2img", JOB, target=MACHINE)  # m1 still looks online: taken
    assert worker.wait(timeout=180) == 78  # EX_CONFIG, as for a token refused at start
    log = log_file.read_text(errors="replace")
    assert "the server refused this worker's token" in log and "HOMEFLEET_WORKER_TOKEN" in log, log[-3000:]
    assert ctx.redis.get(ctx.keys.heartbeat(MACHINE)) is None  # offline at once
    with pytest.raises(ApiError) as refused:
        client.submit(MODEL, "txt2img", JOB, target=MACHINE)
    assert (refused.value.status_code, refused.value.reason) == (503, "machine_unavailable")

    # The refused claim changed nothing: the job is queued, never ran, and is published again.
    wait_for(
        lambda: (
            ctx.queues.queued_ids(MACHINE) == [job["id"]]
            and any(event.event == "requeued" for event in ctx.journal.events(job["id"]))
        ),
        timeout_s=60,
        what="reconciliation to publish the refused job again",
    )
    journaled = ctx.journal.get(job["id"])
    assert journaled.state == JobState.queued and journaled.started_at is None
    [requeued] = [event for event in ctx.journal.events(job["id"]) if event.event == "requeued"]
    assert "the server refused that worker's token" in (requeued.detail or ""), requeued

    local.processes.pop(f"worker-{MACHINE}", None)
    local.start_worker(MACHINE, extra_env={"HOMEFLEET_WORKER_TOKEN": new_token})
    done = client.wait(job["id"], timeout_s=240)
    assert done["state"] == "succeeded", done
    claims = [event for event in ctx.journal.events(job["id"]) if event.event == "running"]
    assert len(claims) == 1, ctx.journal.events(job["id"])  # ran once


def test_an_idle_worker_whose_token_is_rotated_exits_78_at_its_next_call_to_the_server(
    rotated: RotatedFleet, tiny_models_dir: Path
) -> None:
    """No job reaches it: the next registry change makes its heartbeat ask the server for the
    manifest, which answers 401, and the worker stops (exit 78), its machine offline. It used to
    retry every 2 s forever, stay online, and turn away the worker started with the new token
    ("another worker of this machine is running")."""
    ctx, local = rotated.ctx, rotated.local
    worker = local.processes[f"worker-{MACHINE}"]
    run_cli("machines", "rotate-token", MACHINE, env=rotated.operator)
    run_cli("models", "add", str(tiny_models_dir / MODEL), "--id", "another", env=rotated.operator)
    assert worker.wait(timeout=120) == 78
    log = (local.logs_dir / f"worker-{MACHINE}.log").read_text(errors="replace")
    assert "the server refused this worker's token" in log, log[-3000:]
    assert ctx.redis.get(ctx.keys.heartbeat(MACHINE)) is None


def test_a_job_running_when_its_machine_s_token_is_rotated_is_interrupted_at_once_and_its_worker_stops(
    rotated: RotatedFleet,
) -> None:
    """The rotation interrupts the running job (``token_rotated``, announced) as soon as the
    server took the new token: its worker's progress reports and result upload are refused from
    then on, so nothing of it could arrive. The worker's next progress report gets 401: it stops
    the run there (its step count stops growing long before the job's 150 steps), stores
    nothing and exits 78. It used to run the job to its end, have the result refused and leave
    the job ``running`` until the worker stopped for another reason."""
    ctx, local, client = rotated.ctx, rotated.local, rotated.client
    worker = local.processes[f"worker-{MACHINE}"]
    job = client.submit(MODEL, "txt2img", {"prompt": "long", "steps": 150, **LONG_SIZE}, target=MACHINE)
    wait_for(lambda: (client.get(job["id"]).get("progress") or {}).get("step", 0) >= 2, 120, "the job to run")
    rotated_out = run_cli("machines", "rotate-token", MACHINE, env=rotated.operator)
    assert f"job {job['id']}: interrupted (token_rotated)" in rotated_out.stdout, rotated_out.stdout
    ended = client.get(job["id"])
    assert (ended["state"], ended["reason"]) == ("interrupted", "token_rotated"), ended
    assert "rotate-token" in ended["message"]
    assert worker.wait(timeout=60) == 78
    log = (local.logs_dir / f"worker-{MACHINE}.log").read_text(errors="replace")
    assert "the server refused that worker's token at its progress report" in log, log[-3000:]
    assert "nothing more of it is run or reported" in log
    found = ctx.progress.read(job["id"])
    step = (found.step or 0) if found is not None else 0
    assert 2 <= step < 150, step  # stopped mid-run
    assert ctx.journal.get(job["id"]).result_digest is None  # nothing stored
    assert ctx.redis.get(ctx.keys.heartbeat(MACHINE)) is None
