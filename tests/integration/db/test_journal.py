"""The journal's state machine and the claim (R19), on a real SQLite journal."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from sqlalchemy.exc import IntegrityError

from app.context import ServerContext
from app.core.errors import Conflict
from app.core.states import JobState
from app.db.tables import Job


@pytest.fixture
def ctx(sql_ctx: ServerContext) -> ServerContext:
    """These tests are about SQL: each runs on SQLite and on PostgreSQL (tests/conftest.py)."""
    return sql_ctx


def queued_job(ctx: ServerContext, machine: str = "m1") -> Job:
    return ctx.journal.add(
        Job(
            state=JobState.queued,
            model_id="tiny-sd",
            kind="txt2img",
            params={"prompt": "x"},
            target=machine,
            machine=machine,
        )
    )


def test_r19_a_job_is_claimed_once_and_a_second_claim_changes_nothing(ctx: ServerContext) -> None:
    job = queued_job(ctx)
    claimed = ctx.journal.claim(job.id, "m1")
    assert claimed.state == JobState.running and claimed.started_at is not None
    with pytest.raises(Conflict) as refused:
        ctx.journal.claim(job.id, "m1")
    assert "running" in refused.value.message
    after = ctx.journal.get(job.id)
    assert (after.state, after.started_at) == (JobState.running, claimed.started_at)
    assert [e.event for e in ctx.journal.events(job.id)] == ["queued", "running", "running_refused"]


def test_r19_concurrent_claims_have_exactly_one_winner(ctx: ServerContext) -> None:
    job = queued_job(ctx)

    def attempt(_: int) -> bool:
        try:
            ctx.journal.claim(job.id, "m1")
        except Conflict:
            return False
        return True

    with ThreadPoolExecutor(8) as pool:
        outcomes = list(pool.map(attempt, range(16)))
    assert outcomes.count(True) == 1
    assert [e.event for e in ctx.journal.events(job.id)].count("running") == 1


def test_r19_a_job_placed_elsewhere_cannot_be_claimed(ctx: ServerContext) -> None:
    job = queued_job(ctx, "m1")
    with pytest.raises(Conflict):
        ctx.journal.claim(job.id, "m2")
    assert ctx.journal.get(job.id).state == JobState.queued


@pytest.mark.parametrize("ended", [JobState.succeeded, JobState.failed])
def test_only_a_running_job_can_end(ctx: ServerContext, ended: JobState) -> None:
    job = queued_job(ctx)
    with pytest.raises(Conflict):
        ctx.journal.transition(job.id, [JobState.running], ended, machine="m1")
    ctx.journal.claim(job.id, "m1")
    done = ctx.journal.transition(job.id, [JobState.running], ended, machine="m1")
    assert done.state == ended and done.finished_at is not None
    with pytest.raises(Conflict):
        ctx.journal.transition(job.id, [JobState.running], JobState.succeeded, machine="m1")
    assert ctx.journal.get(job.id).state == ended


def test_r19_the_same_delivery_may_repeat_its_claim_but_no_other_delivery_can(ctx: ServerContext) -> None:
    job = queued_job(ctx)
    first = ctx.journal.claim(job.id, "m1", worker_boot_id="boot", claim_id="delivery-1")
    again = ctx.journal.claim(job.id, "m1", worker_boot_id="boot", claim_id="delivery-1")  # its answer was lost
    assert again.started_at == first.started_at and again.state == JobState.running
    with pytest.raises(Conflict):
        ctx.journal.claim(job.id, "m1", worker_boot_id="boot", claim_id="delivery-2")
    with pytest.raises(Conflict):
        ctx.journal.claim(job.id, "m1", worker_boot_id="boot")
    assert [e.event for e in ctx.journal.events(job.id)].count("running") == 1


def test_r19_add_writes_the_job_as_given_with_its_first_event(ctx: ServerContext) -> None:
    job = ctx.journal.add(
        Job(
            state=JobState.queued,
            model_id="tiny-sd",
            kind="txt2img",
            params={"prompt": "x", "seed": 7},
            target="auto",
            machine="m1",
            idempotency_key="k1",
            predicted_run_s=2.5,
            weights_bytes=5_000_000_000,
        )
    )
    stored = ctx.journal.get(job.id)
    assert stored.model_dump() == job.model_dump()  # every column, defaults (id, created_at) included
    assert stored.provenance is None and stored.params == {"prompt": "x", "seed": 7}
    assert [(e.event, e.detail) for e in ctx.journal.events(job.id)] == [("queued", "")]
    refused = ctx.journal.add(
        Job(
            state=JobState.rejected,
            model_id="tiny-sd",
            kind="txt2img",
            params={},
            target="m9",
            reason="unknown_machine",
            message="no m9",
        )
    )
    assert [(e.event, e.detail) for e in ctx.journal.events(refused.id)] == [("rejected", "unknown_machine")]


def test_r20_add_refuses_a_taken_idempotency_key_and_writes_nothing(ctx: ServerContext) -> None:
    first = queued_job(ctx)
    ctx.journal.add(
        Job(
            state=JobState.queued,
            model_id="tiny-sd",
            kind="txt2img",
            params={},
            target="m1",
            machine="m1",
            idempotency_key="same",
        )
    )
    second = Job(
        state=JobState.queued,
        model_id="tiny-sd",
        kind="txt2img",
        params={},
        target="m1",
        machine="m1",
        idempotency_key="same",
    )
    with pytest.raises(IntegrityError):
        ctx.journal.add(second)
    assert ctx.journal.state_of(second.id) is None and ctx.journal.events(second.id) == []  # one transaction
    assert ctx.journal.state_of(first.id) == JobState.queued


def test_states_of_answers_many_ids_in_batches_and_leaves_unknown_ids_out(ctx: ServerContext) -> None:
    """``homefleet status`` and reconciliation read every reservation's state at once
    (one query per batch, not one per job); more ids than one batch holds, and unknown ones."""
    from app.journal.jobs import STATES_BATCH

    jobs = [queued_job(ctx) for _ in range(STATES_BATCH + 3)]
    ctx.journal.claim(jobs[-1].id, "m1")
    states = ctx.journal.states_of([job.id for job in jobs] + ["no-such-job"])
    assert len(states) == len(jobs) and "no-such-job" not in states
    assert states[jobs[-1].id] == JobState.running
    assert {states[job.id] for job in jobs[:-1]} == {JobState.queued}
    assert ctx.journal.count_in(JobState.running, "m1") == 1 and ctx.journal.count_in(JobState.running, "m2") == 0


def test_placements_give_each_job_of_the_states_its_machine_oldest_first(ctx: ServerContext) -> None:
    """Reconciliation's queued pass reads (id, machine) pairs, not whole jobs: every
    job of the states asked, in journal order, with its machine; none of another state."""
    jobs = [queued_job(ctx, machine) for machine in ("m1", "m2", "m1", "m2")]
    ctx.journal.claim(jobs[1].id, "m2")
    assert ctx.journal.placements([JobState.queued]) == [(jobs[0].id, "m1"), (jobs[2].id, "m1"), (jobs[3].id, "m2")]
    assert ctx.journal.placements([JobState.running]) == [(jobs[1].id, "m2")]
    assert ctx.journal.placements([JobState.succeeded]) == []


def test_page_walks_a_state_oldest_first_with_a_keyset_cursor(ctx: ServerContext) -> None:
    """``GET /v1/jobs?state=queued`` pages: every queued job once, in journal order,
    none of another state; a cursor naming no job is refused."""
    from app.core.errors import NotFound

    jobs = [queued_job(ctx, machine="m1" if i % 2 else "m2") for i in range(7)]
    ctx.journal.claim(jobs[3].id, "m1")
    seen, after = [], None
    while page := ctx.journal.page([JobState.queued], limit=2, after=after):
        assert len(page) <= 2
        seen += [job.id for job in page]
        after = page[-1].id
    assert seen == [job.id for job in jobs if job.id != jobs[3].id]
    assert [j.id for j in ctx.journal.page([JobState.queued], machine="m1", limit=10)] == [
        job.id for job in jobs[1::2] if job.id != jobs[3].id
    ]
    with pytest.raises(NotFound):
        ctx.journal.page([JobState.queued], after="no-such-job")


def test_a_job_is_found_by_the_first_characters_of_its_id_when_they_name_one_job(ctx: ServerContext) -> None:
    """``homefleet jobs requeue`` takes the short ids the demo and the page print; a prefix of
    several is refused naming them, and only hex digits reach the query (no LIKE wildcard)."""
    from app.core.errors import NotFound

    ids = ["abcdef01" + "0" * 24, "abcdef02" + "0" * 24, "12345678" + "f" * 24]
    for job_id in ids:
        job = Job(state=JobState.queued, model_id="tiny-sd", kind="txt2img", params={"prompt": "x"}, target="m1")
        job.id = job_id
        ctx.journal.add(job)
    assert ctx.journal.full_id("12345678") == ids[2] == ctx.journal.full_id(ids[2])
    assert ctx.journal.full_id("abcdef02") == ids[1]
    with pytest.raises(NotFound) as several:
        ctx.journal.full_id("abcdef0")
    assert several.value.reason == "job_id_ambiguous" and ids[0] in several.value.message
    for unknown in ("fedcba", "%", "abcdef0_", ""):
        with pytest.raises(NotFound) as missing:
            ctx.journal.full_id(unknown)
        assert missing.value.reason == "job_not_found"
