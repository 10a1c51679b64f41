"""The server's side of a revoke (C11) and of the task events it sends for Flower, on
a real Redis, real Celery publishing, a real Celery event receiver and the real HTTP app; no
worker reads the queues here (tests/e2e/test_revoke_and_flower.py runs the whole way)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from app.api.server import create_app
from app.context import ServerContext, build_context
from app.core.config import Settings
from app.core.states import JobState
from app.db.tables import Job
from tests.helpers import TEST_API_KEY, bring_online, make_fleet, wait_for


@pytest.fixture
def api(settings: Settings) -> Iterator[tuple[TestClient, ServerContext]]:
    context = build_context(settings, make_fleet("m1", "m2"), migrate=True)
    try:
        yield TestClient(create_app(settings, context), headers={"Authorization": f"Bearer {TEST_API_KEY}"}), context
    finally:
        context.close()


def auth(ctx: ServerContext, machine: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {ctx.fleet.machines[machine].token}", "X-Homefleet-Machine": machine}


def task_events(
    ctx: ServerContext, action: Callable[[], object], wanted: int, timeout_s: float = 30.0
) -> list[dict[str, Any]]:
    """Run ``action`` while a Celery event receiver listens (as Flower's does); the task events
    that arrive, until ``wanted`` of them or ``timeout_s``. On Redis, events are a fan-out
    (publish/subscribe): the receiver must be subscribed first, so a probe event is sent until
    it comes back."""
    events: list[dict[str, Any]] = []
    with ctx.celery.connection_for_read() as connection:
        receiver = ctx.celery.events.Receiver(connection, handlers={"*": events.append})

        def listen() -> None:
            for _ in receiver.consume(safety_interval=0.2):
                pass

        listener = threading.Thread(target=listen, daemon=True)
        listener.start()
        try:

            def probe_heard() -> bool:
                with ctx.celery.events.default_dispatcher(hostname="probe@test") as dispatcher:
                    dispatcher.send("probe-ready")
                return any(event["type"] == "probe-ready" for event in events)

            wait_for(probe_heard, timeout_s=30, poll_s=0.2, what="the event receiver to subscribe")
            action()
            deadline = time.monotonic() + timeout_s
            while sum(e["type"].startswith("task-") for e in events) < wanted and time.monotonic() < deadline:
                time.sleep(0.05)
        finally:
            receiver.should_stop = True
            listener.join(timeout=5)
    return [event for event in events if event["type"].startswith("task-")]


def submitted(ctx: ServerContext, model: str, machine: str) -> str:
    return ctx.dispatcher.submit(model, "txt2img", {"prompt": "x"}, machine).job.id


def test_c11_a_revoke_reported_by_a_machine_cancels_its_own_queued_job_only(
    api: tuple[TestClient, ServerContext], tiny_models_dir: Path
) -> None:
    """Every live worker hears a revoke; the server ends only jobs placed on the reporting
    machine: its queued job is ``cancelled`` (reason ``revoked``), its message removed, its
    reservation released, and Flower is told (``task-revoked`` under m1's node name). Another
    machine's job and an unknown id are left alone."""
    client, ctx = api
    model = ctx.registry.add(tiny_models_dir / "tiny-sd").id
    bring_online(ctx, "m1", {model})
    bring_online(ctx, "m2", {model})
    ctx.redis.set(ctx.keys.node("m1"), "m1@host-of-m1")
    own, other = submitted(ctx, model, "m1"), submitted(ctx, model, "m2")

    def report() -> None:
        answer = client.post(
            "/internal/v1/revocations", headers=auth(ctx, "m1"), json={"job_ids": [own, other, "f" * 32]}
        )
        assert answer.status_code == 200, answer.text
        assert answer.json() == {"ended": {own: "cancelled"}}

    [event] = task_events(ctx, report, wanted=1)
    assert (event["type"], event["uuid"], event["hostname"]) == ("task-revoked", own, "m1@host-of-m1")
    job = ctx.journal.get(own)
    assert (job.state, job.reason) == (JobState.cancelled, "revoked")
    assert ctx.queues.queued_ids("m1") == [] and ctx.machines.reservations.count("m1") == 0
    assert ctx.journal.state_of(other) == JobState.queued and ctx.queues.queued_ids("m2") == [other]
    assert ctx.machines.reservations.count("m2") == 1


def test_c11_a_terminated_running_job_is_interrupted_and_a_running_one_revoked_without_terminate_runs_on(
    api: tuple[TestClient, ServerContext], tiny_models_dir: Path
) -> None:
    client, ctx = api
    model = ctx.registry.add(tiny_models_dir / "tiny-sd").id
    bring_online(ctx, "m1", {model})
    job_id = submitted(ctx, model, "m1")
    assert client.post(f"/internal/v1/jobs/{job_id}/claim", headers=auth(ctx, "m1")).status_code == 200

    answer = client.post("/internal/v1/revocations", headers=auth(ctx, "m1"), json={"job_ids": [job_id]})
    assert answer.json() == {"ended": {}}  # Celery stops a started task only with terminate
    assert ctx.journal.state_of(job_id) == JobState.running and ctx.machines.reservations.count("m1") == 1

    def terminated() -> None:
        answer = client.post(
            "/internal/v1/revocations",
            headers=auth(ctx, "m1"),
            json={"job_ids": [job_id], "terminated": True, "announced": True},
        )
        assert answer.json() == {"ended": {job_id: "interrupted"}}

    assert task_events(ctx, terminated, wanted=1, timeout_s=2) == []  # Celery's worker sent task-revoked itself
    job = ctx.journal.get(job_id)
    assert (job.state, job.reason) == (JobState.interrupted, "terminated")
    assert "terminate" in (job.message or "")
    assert ctx.machines.reservations.count("m1") == 0
    again = client.post(
        "/internal/v1/revocations", headers=auth(ctx, "m1"), json={"job_ids": [job_id], "terminated": True}
    )
    assert again.json() == {"ended": {}}  # ended jobs stay as they ended


def test_c11_a_revocation_report_is_bounded_and_needs_the_machine_token(api: tuple[TestClient, ServerContext]) -> None:
    client, ctx = api
    too_many = client.post(
        "/internal/v1/revocations", headers=auth(ctx, "m1"), json={"job_ids": [f"{i:032x}" for i in range(101)]}
    )
    assert too_many.status_code == 422 and "job_ids" in too_many.text
    assert client.post("/internal/v1/revocations", json={"job_ids": ["x"]}).status_code == 401  # an API key is no token


def test_the_server_tells_flower_of_the_jobs_it_ends(
    api: tuple[TestClient, ServerContext], tiny_models_dir: Path
) -> None:
    """A cancel through the API sends ``task-revoked``; reconciliation's ``worker_lost`` sends
    ``task-failed`` naming the reason, its ``purged`` ``task-revoked``, so Flower shows neither
    PENDING nor STARTED forever."""
    client, ctx = api
    model = ctx.registry.add(tiny_models_dir / "tiny-sd").id
    bring_online(ctx, "m1", {model})
    queued = submitted(ctx, model, "m1")
    [revoked] = task_events(ctx, lambda: client.post(f"/v1/jobs/{queued}/cancel"), wanted=1)
    assert (revoked["type"], revoked["uuid"]) == ("task-revoked", queued)
    assert ctx.journal.get(queued).reason == "cancelled"

    lost = ctx.journal.add(
        Job(state=JobState.queued, model_id=model, kind="txt2img", params={}, target="m1", machine="m1")
    )
    ctx.journal.claim(lost.id, "m1")
    ctx.redis.delete(ctx.keys.heartbeat("m1"))  # its worker is gone
    ctx.redis.set(ctx.keys.redis_seen(), repr(time.time() - 3600))  # Redis kept its data for an hour
    [failed] = task_events(ctx, lambda: ctx.reconciler().run_once(), wanted=1)
    assert (failed["type"], failed["uuid"]) == ("task-failed", lost.id)
    assert failed["exception"].startswith("interrupted: worker_lost:"), failed["exception"]

    bring_online(ctx, "m1", {model})  # its worker is back
    purged = submitted(ctx, model, "m1")
    assert ctx.queues.remove("m1", purged)  # as `celery purge` does
    reconciler = replace(ctx.reconciler(), settings=ctx.settings.model_copy(update={"lost_grace_s": 0.0}))
    [revoked] = task_events(ctx, reconciler.run_once, wanted=1)
    assert (revoked["type"], revoked["uuid"]) == ("task-revoked", purged)
    assert ctx.journal.get(purged).reason == "purged"
