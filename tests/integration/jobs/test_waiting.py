"""Waiting for a job on a real Redis and journal (app/jobs/waiting.py): a waiter wakes on the
change that app/jobs/endings.py publishes, and reads the journal once per change, not on a
polling period. The safety re-read is set to a minute here, so only the published change can
wake a waiter within the bounds asserted. No worker runs: the test claims and ends the job
through ``Endings`` as a worker's reports would."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from anyio import to_thread

from app.context import ServerContext, build_context
from app.core.config import Settings
from app.core.states import JobState
from app.db.tables import Job
from app.devtools.redis_server import free_port, start_redis_server
from app.jobs.progress import Progress
from app.jobs.waiting import Waiting
from tests.helpers import bring_online, make_fleet

SAFETY_S = 60.0  # the waiters' safety re-read: longer than any bound below


class CountingJournal:
    """The journal's ``get`` (all a waiter reads of it), counted."""

    def __init__(self, ctx: ServerContext) -> None:
        self.journal = ctx.journal
        self.reads = 0

    def get(self, job_id: str) -> Job:
        self.reads += 1
        return self.journal.get(job_id)


@pytest.fixture
def queued(ctx: ServerContext, tiny_models_dir: Path) -> str:
    model = ctx.registry.add(tiny_models_dir / "tiny-sd").id
    bring_online(ctx, "server", {model})
    return ctx.dispatcher.submit(model, "txt2img", {"prompt": "a lighthouse"}, "server").job.id


@pytest.fixture
def counted(ctx: ServerContext) -> Iterator[tuple[Waiting, CountingJournal]]:
    journal = CountingJournal(ctx)
    waiting = Waiting(ctx.settings, ctx.keys, journal, ctx.progress, recheck_s=SAFETY_S)  # type: ignore[arg-type]
    try:
        yield waiting, journal
    finally:
        waiting.close()


async def reads_reach(journal: CountingJournal, count: int) -> None:
    while journal.reads < count:  # the waiter's own reads, not a clock
        await asyncio.sleep(0.01)


def test_until_ended_wakes_on_each_published_transition_and_reads_the_journal_once_per_change(
    ctx: ServerContext, queued: str, counted: tuple[Waiting, CountingJournal]
) -> None:
    waiting, journal = counted

    async def scenario() -> tuple[Job, float, list[int]]:
        task = asyncio.create_task(waiting.until_ended(queued, timeout_s=SAFETY_S * 2))
        await reads_reach(journal, 1)  # subscribed, read once: queued
        seen = [journal.reads]
        started = time.monotonic()
        await to_thread.run_sync(ctx.endings.claim, queued, "server")
        await reads_reach(journal, 2)  # woken by the claim: running, not ended
        seen.append(journal.reads)
        await to_thread.run_sync(lambda: ctx.endings.fail(queued, "server", "error", "boom", load_s=0.1, run_s=None))
        job = await asyncio.wait_for(task, timeout=SAFETY_S / 2)
        return job, time.monotonic() - started, seen

    job, waited_s, seen = asyncio.run(scenario())
    assert (job.state, job.reason, job.message) == (JobState.failed, "error", "boom")
    assert seen == [1, 2] and journal.reads == 3  # one read at the start, one per published transition
    assert waited_s < SAFETY_S / 2  # woken by the messages, not by the safety re-read
    assert ctx.machines.reservations.count("server") == 0  # the end released its reservation (R14)


def test_until_ended_without_a_change_reads_the_journal_at_the_start_and_at_its_timeout_only(
    queued: str, counted: tuple[Waiting, CountingJournal]
) -> None:
    waiting, journal = counted
    job = asyncio.run(waiting.until_ended(queued, timeout_s=0.5))
    assert job.state == JobState.queued  # not ended: the caller answers that it keeps running
    assert journal.reads == 2  # no polling in between (a 0.05 s poll read it about ten times)


def test_follow_yields_the_state_changes_and_each_progress_report_then_the_ended_job(
    ctx: ServerContext, queued: str, counted: tuple[Waiting, CountingJournal]
) -> None:
    waiting, journal = counted
    steps = iter(
        [
            lambda: ctx.endings.claim(queued, "server"),
            lambda: ctx.progress.report(queued, 1, 4),
            lambda: ctx.progress.report(queued, 2, 4),
            lambda: ctx.endings.interrupt(queued, [JobState.running], "hung", "no progress"),
        ]
    )

    async def scenario() -> list[str]:
        seen: list[str] = []
        async for change in waiting.follow(queued):
            seen.append(f"progress {change.step}" if isinstance(change, Progress) else str(change.state))
            if seen[-1] in ("queued", "progress None", "progress 1", "progress 2"):  # claim, two steps, the end
                await to_thread.run_sync(next(steps))
        return seen

    started = time.monotonic()
    seen = asyncio.run(asyncio.wait_for(scenario(), timeout=SAFETY_S / 2))
    assert seen == ["queued", "running", "progress None", "progress 1", "progress 2", "interrupted"]
    assert time.monotonic() - started < SAFETY_S / 2
    assert journal.reads <= 7  # once at the start and once per message heard (the claim publishes two)


def test_the_listener_says_a_redis_outage_once_and_when_redis_answers_again(
    settings: Settings, tmp_path: Path, request: pytest.FixtureRequest, caplog: pytest.LogCaptureFixture
) -> None:
    """The listener retries every second while Redis does not answer: one warning (redis_down,
    the URL without its password) for the outage, not one per try; one line when it is back."""
    port = free_port()
    servers = [start_redis_server(tmp_path / "redis", port=port, password="s3cret")]
    request.addfinalizer(lambda: servers[-1].stop())
    ctx = build_context(settings.model_copy(update={"redis_url": servers[0].url}), make_fleet("m1"), migrate=True)
    request.addfinalizer(ctx.close)
    waiting = Waiting(ctx.settings, ctx.keys, ctx.journal, ctx.progress, recheck_s=SAFETY_S)
    request.addfinalizer(waiting.close)
    caplog.set_level(logging.INFO, logger="app.jobs.waiting")
    waiting._start()  # the listener, subscribed (a first waiter starts it)
    assert waiting._ready.is_set()
    servers[0].stop()
    time.sleep(3.5)  # three tries or more, each failing
    said = [record for record in caplog.records if record.name == "app.jobs.waiting"]
    assert len(said) == 1, [record.getMessage() for record in said]
    line = said[0].getMessage()
    assert said[0].levelno == logging.WARNING and "redis_down" in line
    assert f"redis://:***@127.0.0.1:{port}/0" in line and "s3cret" not in line
    caplog.clear()
    servers.append(start_redis_server(tmp_path / "redis", port=port, password="s3cret"))
    deadline = time.monotonic() + 10
    while not waiting._ready.is_set() and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(1.5)  # listening again, quietly
    again = [record.getMessage() for record in caplog.records if record.name == "app.jobs.waiting"]
    assert len(again) == 1 and "answers again" in again[0], again
