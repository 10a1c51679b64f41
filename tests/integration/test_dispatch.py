"""Submission on a real Redis with real Celery publishing, no worker reading (R8, R10, R19)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from app import keys
from app.context import ServerContext
from app.errors import MachineUnavailable, Rejected
from app.journal import JobState


def bring_online(ctx: ServerContext, machine: str, verified: set[str]) -> None:
    """Write what a live worker of ``machine`` advertises (its heartbeat and verified set)."""
    ctx.redis.set(ctx.keys.heartbeat(machine), json.dumps({"machine": machine, "at": time.time()}), ex=60)
    if verified:
        ctx.redis.sadd(ctx.keys.verified(machine), *verified)


def test_r8_r19_a_job_is_journaled_then_waits_in_its_machine_list(ctx: ServerContext, tiny_models_dir: Path) -> None:
    model = ctx.registry.add(tiny_models_dir / "tiny-sd").id
    bring_online(ctx, "m1", {model})
    ids = [ctx.dispatcher.submit(model, "txt2img", {"prompt": f"p{i}"}, "m1").job.id for i in range(3)]
    assert [ctx.journal.get(i).state for i in ids] == [JobState.queued] * 3
    assert ctx.redis.llen(keys.queue("m1")) == 3
    entries = [json.loads(raw) for raw in ctx.redis.lrange(keys.queue("m1"), 0, -1)]
    # LPUSH publishes, BRPOP consumes: index -1 runs next, so the list holds them newest first.
    assert [e["headers"]["id"] for e in reversed(entries)] == ids
    assert all(e["headers"]["task"] == "homefleet.run_job" and e["content-type"] == "application/json" for e in entries)
    assert ctx.redis.llen(keys.queue("server")) == 0
    assert ctx.journal.get(ids[0]).params["seed"] >= 0  # drawn at submission and journaled


@pytest.mark.parametrize(
    ("target", "error", "reason"),
    [
        ("nope", Rejected, "unknown_machine"),
        ("m2", MachineUnavailable, "machine_unavailable"),
        ("m1", Rejected, "model_not_verified"),
    ],
)
def test_r10_refused_submissions_are_journaled_and_publish_nothing(
    ctx: ServerContext, tiny_models_dir: Path, target: str, error: type[Exception], reason: str
) -> None:
    model = ctx.registry.add(tiny_models_dir / "tiny-sd").id
    bring_online(ctx, "m1", set())
    with pytest.raises(error) as refused:
        ctx.dispatcher.submit(model, "txt2img", {"prompt": "x"}, target)
    assert refused.value.reason == reason  # type: ignore[attr-defined]
    assert target in refused.value.message  # type: ignore[attr-defined]
    [journaled] = ctx.journal.list()
    assert (journaled.state, journaled.reason, journaled.machine) == (JobState.rejected, reason, None)
    assert all(ctx.redis.llen(keys.queue(m)) == 0 for m in ("server", "m1", "m2"))


def test_unknown_model_and_wrong_kind_are_refused(ctx: ServerContext, tiny_models_dir: Path) -> None:
    model = ctx.registry.add(tiny_models_dir / "tiny-sd").id
    with pytest.raises(Rejected, match="runs kinds txt2img; got kind 'video'"):
        ctx.dispatcher.submit(model, "video", {}, "server")
    with pytest.raises(Exception, match="'missing' is not registered"):
        ctx.dispatcher.submit("missing", "txt2img", {}, "server")
    assert [j.reason for j in ctx.journal.list()] == ["kind_not_supported", "unknown_model"]
