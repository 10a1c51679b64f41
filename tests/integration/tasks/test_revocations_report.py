"""The worker's report of revocations (C11, ``tasks/revocations.py``) with its real parts: Celery's
revoked set of this process (``celery.worker.state.revoked``), the real ``ServerClient`` and the
real API served by uvicorn on a free port, a real Redis and journal. The server is first
unreachable: nothing is lost, the report goes through at a later beat."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
from celery.app.task import Context as TaskContext
from celery.worker import state as worker_state

from app.context import ServerContext, build_context
from app.core.celery_app import RUN_JOB_TASK
from app.core.config import Settings
from app.core.states import JobState
from app.devtools.redis_server import free_port
from tasks.revocations import Revocations
from tasks.server_client import ServerClient
from tests.helpers import bring_online, make_fleet, served_api


@pytest.fixture
def served(settings: Settings) -> Iterator[tuple[str, ServerContext]]:
    """The real API on a free port (no lifespan: no reconciliation pass runs meanwhile)."""
    ctx = build_context(settings, make_fleet("m1", "m2"), migrate=True)
    try:
        with served_api(ctx) as url:
            yield url, ctx
    finally:
        ctx.close()


def test_c11_revocations_reach_the_journal_once_the_server_answers(
    served: tuple[str, ServerContext], tiny_models_dir: Path
) -> None:
    url, ctx = served
    model = ctx.registry.add(tiny_models_dir / "tiny-sd").id
    bring_online(ctx, "m1", {model})
    queued = ctx.dispatcher.submit(model, "txt2img", {"prompt": "q"}, "m1").job.id
    running = ctx.dispatcher.submit(model, "txt2img", {"prompt": "r"}, "m1").job.id
    ctx.queues.remove("m1", running)  # its worker took the message...
    ctx.journal.claim(running, "m1")  # ...and claimed it
    token = ctx.fleet.machines["m1"].token
    unreachable = ServerClient(f"http://127.0.0.1:{free_port()}", token, 2.0, machine="m1")
    revocations = Revocations(unreachable, "m1", RUN_JOB_TASK)
    job_task = SimpleNamespace(name=RUN_JOB_TASK)
    try:
        worker_state.revoked.add(queued)  # what Celery's revoke command does in the main process
        revocations.on_task_revoked(sender=job_task, request=TaskContext(id=running), terminated=True)
        revocations.on_task_revoked(sender=SimpleNamespace(name="homefleet.sync"), request=TaskContext(id="s1"))
        revocations.report()  # the server is unreachable: kept for the next beat
        assert (ctx.journal.state_of(queued), ctx.journal.state_of(running)) == (JobState.queued, JobState.running)
        assert revocations.reported == set()

        revocations.server = ServerClient(url, token, 10.0, machine="m1")
        revocations.report()  # the next beat
        cancelled, interrupted = ctx.journal.get(queued), ctx.journal.get(running)
        assert (cancelled.state, cancelled.reason) == (JobState.cancelled, "revoked")
        assert (interrupted.state, interrupted.reason) == (JobState.interrupted, "terminated")
        assert ctx.machines.reservations.count("m1") == 0 and ctx.queues.queued_ids("m1") == []
        assert queued in revocations.reported

        revocations.report()  # nothing new: nothing sent, nothing changed
        events = [e.event for e in ctx.journal.events(queued)]
        assert events.count("cancelled") == 1 and "cancelled_refused" not in events
    finally:
        worker_state.revoked.discard(queued)
        worker_state.revoked.discard(running)
        revocations.server.close()
        unreachable.close()


def test_c11_a_worker_reports_every_revoked_id_but_ends_only_its_own_machines_jobs(
    served: tuple[str, ServerContext], tiny_models_dir: Path
) -> None:
    """Every live worker hears a revoke: m2's worker reporting m1's job changes nothing; more ids
    than one report holds go in several."""
    url, ctx = served
    model = ctx.registry.add(tiny_models_dir / "tiny-sd").id
    bring_online(ctx, "m1", {model})
    theirs = ctx.dispatcher.submit(model, "txt2img", {"prompt": "q"}, "m1").job.id
    ids = [theirs, *(f"{i:032x}" for i in range(250))]
    revocations = Revocations(ServerClient(url, ctx.fleet.machines["m2"].token, 10.0, machine="m2"), "m2", RUN_JOB_TASK)
    try:
        for job_id in ids:
            worker_state.revoked.add(job_id)
        started = time.monotonic()
        revocations.report()
        assert revocations.reported >= set(ids), "every id told once, in reports of at most 100"
        assert time.monotonic() - started < 30
        assert ctx.journal.state_of(theirs) == JobState.queued and ctx.queues.queued_ids("m1") == [theirs]
    finally:
        for job_id in ids:
            worker_state.revoked.discard(job_id)
        revocations.server.close()


def test_c11_a_terminate_noted_while_its_revoke_is_reported_reaches_the_journal_at_the_next_beat(
    served: tuple[str, ServerContext], tiny_models_dir: Path
) -> None:
    """Celery adds a revoked id to its set before it terminates the task and sends the signal: a
    beat between the two reports the running job as merely revoked (the server leaves it
    running), and the signal's note of the terminate, made while that report was answered, is
    kept and sent at the next beat (a loaded run once lost it: the job stayed running)."""
    url, ctx = served
    model = ctx.registry.add(tiny_models_dir / "tiny-sd").id
    bring_online(ctx, "m1", {model})
    running = ctx.dispatcher.submit(model, "txt2img", {"prompt": "r"}, "m1").job.id
    ctx.queues.remove("m1", running)
    ctx.journal.claim(running, "m1")
    job_task = SimpleNamespace(name=RUN_JOB_TASK)
    server = ServerClient(url, ctx.fleet.machines["m1"].token, 10.0, machine="m1")
    revocations = Revocations(server, "m1", RUN_JOB_TASK)
    sent: list[tuple[list[str], bool]] = []

    def revocations_then_signal(job_ids: list[str], terminated: bool, announced: bool) -> dict[str, str]:
        answer = ServerClient.revocations(server, job_ids, terminated=terminated, announced=announced)
        sent.append((job_ids, terminated))
        if not sent[1:]:  # Celery's task_revoked signal comes while the first report is answered
            revocations.on_task_revoked(sender=job_task, request=TaskContext(id=running), terminated=True)
        return answer

    server.revocations = revocations_then_signal  # type: ignore[method-assign]
    try:
        worker_state.revoked.add(running)
        revocations.report()
        assert ctx.journal.state_of(running) == JobState.running  # revoked without terminate: it runs on
        revocations.report()  # the next beat
        job = ctx.journal.get(running)
        assert (job.state, job.reason) == (JobState.interrupted, "terminated")
        assert sent == [([running], False), ([running], True)]
    finally:
        worker_state.revoked.discard(running)
        server.close()
