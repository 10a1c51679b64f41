"""R8 (FIFO per machine) across a Redis that lost its data (R19): the queued jobs that
reconciliation publishes again reach the machine's worker in the journal's order whatever the
worker does meanwhile: busy (nothing consumes during the pass) or idle (blocked in BRPOP on its
queue, taking each message the moment it lands). Real Redis and journal; the consumer pops the
machine's list the way kombu's Redis transport does (BRPOP, app/core/keys.py)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from app.context import ServerContext, build_context
from app.core.config import Settings
from app.core.keys import queue
from app.core.states import JobState
from tests.helpers import bring_online, make_fleet

BACKLOG = 6


@pytest.fixture
def ctx(settings: Settings) -> Iterator[ServerContext]:
    """On a Redis reconciliation has known for an hour; a grace for missing messages, as a worker
    between its BRPOP and its claim leaves none in the list (the consumer here never claims)."""
    context = build_context(settings.model_copy(update={"lost_grace_s": 30.0}), make_fleet("m1"), migrate=True)
    context.redis.set(context.keys.redis_seen(), time.time() - 3600)
    yield context
    context.close()


def submit(ctx: ServerContext, model: str) -> str:
    return ctx.dispatcher.submit(model, "txt2img", {"prompt": "x"}, "m1").job.id


def job_id(raw: bytes | str) -> str:
    return str(json.loads(raw)["headers"]["id"])


class IdleWorker:
    """A consumer blocked in BRPOP on m1's list before the pass starts, taking every message as
    soon as it lands, until ``expected`` were taken or ``timeout_s`` passed."""

    def __init__(self, ctx: ServerContext, expected: int, timeout_s: float = 20.0) -> None:
        self.client = redis.Redis.from_url(ctx.settings.redis_url)
        self.name = f"idle-worker-{id(self)}"
        self.key = ctx.keys.queue_list("m1")
        self.expected, self.deadline = expected, time.monotonic() + timeout_s
        self.taken: list[str] = []
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        self.client.client_setname(self.name)
        while len(self.taken) < self.expected and time.monotonic() < self.deadline:
            popped = self.client.brpop([self.key], timeout=1)
            if popped is not None:
                self.taken.append(job_id(popped[1]))

    def start(self, ctx: ServerContext) -> None:
        self.thread.start()
        for _ in range(200):  # until Redis itself shows it blocked in BRPOP
            if any(c.get("name") == self.name and c.get("cmd") == "brpop" for c in ctx.redis.client_list()):
                return
            time.sleep(0.01)
        raise AssertionError("the consumer never blocked in BRPOP")

    def join(self) -> list[str]:
        self.thread.join(timeout=30)
        self.client.close()
        return self.taken


def drain(ctx: ServerContext) -> list[str]:
    """What a worker that comes back after the pass takes, in order (BRPOP until empty)."""
    taken = []
    while (popped := ctx.redis.brpop([ctx.keys.queue_list("m1")], timeout=1)) is not None:
        taken.append(job_id(popped[1]))
    return taken


@pytest.mark.parametrize("worker", ["busy", "idle"])
def test_r8_after_redis_lost_its_data_the_worker_takes_the_queued_jobs_in_journal_order(
    ctx: ServerContext, tiny_models_dir: Path, worker: str
) -> None:
    """Redis flushed under a backlog of six, then a job submitted before reconciliation saw the
    loss: the worker takes the six oldest first, in creation order, then the newer one. (An idle
    worker used to take the newest of the six first: the pass published them newest first.)"""
    model = ctx.registry.add(tiny_models_dir / "tiny-sd").id
    bring_online(ctx, "m1", {model})
    older = [submit(ctx, model) for _ in range(BACKLOG)]
    ctx.redis.flushdb()
    bring_online(ctx, "m1", {model})
    consumer = IdleWorker(ctx, expected=BACKLOG) if worker == "idle" else None
    if consumer is not None:
        consumer.start(ctx)
    else:
        newer = submit(ctx, model)  # placed before reconciliation saw the loss
    report = ctx.reconciler().run_once()
    assert report.redis_lost and report.requeued == older
    if consumer is not None:
        assert consumer.join() == older  # the order the journal created them (R8)
        assert drain(ctx) == []
    else:
        assert ctx.queues.queued_ids("m1") == [*older, newer]
        assert drain(ctx) == [*older, newer]
    assert all(ctx.journal.get(j).state == JobState.queued for j in older)


def test_r8_a_partial_loss_puts_the_lost_older_jobs_back_ahead_of_the_newer_ones_still_queued(
    ctx: ServerContext, tiny_models_dir: Path
) -> None:
    """Redis lost the messages of some queued jobs but not of others (its marker gone with them):
    the machine's whole backlog is put back in journal order, the messages still there kept (not
    doubled), the lost ones being an older one and the two newest. (The pass used to put every
    lost one ahead of those still there.)"""
    model = ctx.registry.add(tiny_models_dir / "tiny-sd").id
    bring_online(ctx, "m1", {model})
    jobs = [submit(ctx, model) for _ in range(BACKLOG)]
    lost = [jobs[1], jobs[4], jobs[5]]
    for job in lost:
        assert ctx.queues.remove("m1", job)
    ctx.redis.delete(ctx.keys.redis_seen())
    report = ctx.reconciler().run_once()
    assert report.redis_lost and report.requeued == lost
    assert ctx.queues.queued_ids("m1") == jobs
    assert ctx.queues.length("m1") == BACKLOG  # each message once
    assert drain(ctx) == jobs


def test_r19_a_message_published_again_is_the_one_a_publication_writes_and_a_consumer_decodes(
    ctx: ServerContext, tiny_models_dir: Path
) -> None:
    """The message reconciliation builds without publishing is what a publication writes (same
    fields, headers, routing) and kombu's consumer decodes it: the run-job task with the job id."""
    model = ctx.registry.add(tiny_models_dir / "tiny-sd").id
    bring_online(ctx, "m1", {model})
    job = submit(ctx, model)
    published = json.loads(ctx.redis.lindex(ctx.keys.queue_list("m1"), 0) or b"{}")
    ctx.redis.flushdb()
    bring_online(ctx, "m1", {model})
    assert ctx.reconciler().run_once().requeued == [job]
    again = json.loads(ctx.redis.lindex(ctx.keys.queue_list("m1"), 0) or b"{}")
    assert again.keys() == published.keys() and again["headers"].keys() == published["headers"].keys()
    assert again["properties"]["delivery_info"] == published["properties"]["delivery_info"]
    assert (again["headers"]["id"], again["headers"]["task"]) == (job, published["headers"]["task"])
    with ctx.queues.celery.connection_for_read() as connection:
        consumer = connection.SimpleQueue(queue("m1"))
        message = consumer.get(timeout=5)
        assert (message.headers["id"], message.payload[0]) == (job, [job])
        assert message.delivery_info["routing_key"] == queue("m1")
        message.ack()
        consumer.close()
