"""Submission on a real Redis with real Celery publishing, no worker reading (R8, R10, R19)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from app.context import ServerContext, build_context
from app.core.config import Settings
from app.core.errors import MachineUnavailable, Rejected
from app.core.states import JobState
from app.fleet.lock import Fence
from app.fleet.reservations import HashField
from app.jobs.dispatch import Submission
from tests.helpers import bring_online, make_fleet


def test_r8_r19_a_job_is_journaled_then_waits_in_its_machine_list(ctx: ServerContext, tiny_models_dir: Path) -> None:
    model = ctx.registry.add(tiny_models_dir / "tiny-sd").id
    bring_online(ctx, "m1", {model})
    ids = [ctx.dispatcher.submit(model, "txt2img", {"prompt": f"p{i}"}, "m1").job.id for i in range(3)]
    assert [ctx.journal.get(i).state for i in ids] == [JobState.queued] * 3
    assert ctx.redis.llen(ctx.keys.queue_list("m1")) == 3
    entries = [json.loads(raw) for raw in ctx.redis.lrange(ctx.keys.queue_list("m1"), 0, -1)]
    # LPUSH publishes, BRPOP consumes: index -1 runs next, so the list holds them newest first.
    assert [e["headers"]["id"] for e in reversed(entries)] == ids
    assert all(e["headers"]["task"] == "homefleet.run_job" and e["content-type"] == "application/json" for e in entries)
    assert ctx.redis.llen(ctx.keys.queue_list("server")) == 0
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
    assert all(ctx.redis.llen(ctx.keys.queue_list(m)) == 0 for m in ("server", "m1", "m2"))


def test_unknown_model_and_wrong_kind_are_refused(ctx: ServerContext, tiny_models_dir: Path) -> None:
    model = ctx.registry.add(tiny_models_dir / "tiny-sd").id
    with pytest.raises(Rejected, match="runs kinds txt2img, img2img, inpaint; got kind 'video'"):
        ctx.dispatcher.submit(model, "video", {}, "server")
    with pytest.raises(Exception, match="'missing' is not registered"):
        ctx.dispatcher.submit("missing", "txt2img", {}, "server")
    assert [j.reason for j in ctx.journal.list()] == ["kind_not_supported", "unknown_model"]


def test_r20_an_idempotency_key_returns_the_original_job(ctx: ServerContext, tiny_models_dir: Path) -> None:
    model = ctx.registry.add(tiny_models_dir / "tiny-sd").id
    bring_online(ctx, "m1", {model})
    first = ctx.dispatcher.submit(model, "txt2img", {"prompt": "x"}, "m1", idempotency_key="k1")
    again = ctx.dispatcher.submit(model, "txt2img", {"prompt": "x"}, "m1", idempotency_key="k1")
    assert (again.job.id, again.replayed, first.replayed) == (first.job.id, True, False)
    assert ctx.redis.llen(ctx.keys.queue_list("m1")) == 1
    with pytest.raises(Rejected) as reused:
        ctx.dispatcher.submit(model, "txt2img", {"prompt": "other"}, "m1", idempotency_key="k1")
    assert reused.value.reason == "idempotency_key_reused" and "'k1'" in reused.value.message
    assert ctx.redis.llen(ctx.keys.queue_list("m1")) == 1
    assert len(ctx.journal.list()) == 1


def test_r20_an_idempotency_key_is_the_api_keys_own(ctx: ServerContext, tiny_models_dir: Path) -> None:
    """Two API keys sending the same Idempotency-Key string (each numbering its requests) get a
    job each, never the other's; each key's retry still gets its own original, and the
    message of a reused key shows the key as the client sent it."""
    model = ctx.registry.add(tiny_models_dir / "tiny-sd").id
    bring_online(ctx, "m1", {model})
    alice = ctx.dispatcher.submit(model, "txt2img", {"prompt": "x"}, "m1", idempotency_key="1", api_key_id="ka")
    bob = ctx.dispatcher.submit(model, "txt2img", {"prompt": "x"}, "m1", idempotency_key="1", api_key_id="kb")
    assert bob.job.id != alice.job.id and not bob.replayed
    again = ctx.dispatcher.submit(model, "txt2img", {"prompt": "x"}, "m1", idempotency_key="1", api_key_id="kb")
    assert (again.job.id, again.replayed) == (bob.job.id, True)
    with pytest.raises(Rejected) as reused:
        ctx.dispatcher.submit(model, "txt2img", {"prompt": "y"}, "m1", idempotency_key="1", api_key_id="ka")
    assert reused.value.message.startswith("Idempotency-Key '1' was used for another request body")
    assert ctx.redis.llen(ctx.keys.queue_list("m1")) == 2


def test_r20_concurrent_retries_with_one_key_create_one_job(ctx: ServerContext, tiny_models_dir: Path) -> None:
    from concurrent.futures import ThreadPoolExecutor

    model = ctx.registry.add(tiny_models_dir / "tiny-sd").id
    bring_online(ctx, "m1", {model})
    with ThreadPoolExecutor(8) as pool:
        ids = set(
            pool.map(
                lambda _: ctx.dispatcher.submit(model, "txt2img", {"prompt": "x"}, "m1", idempotency_key="same").job.id,
                range(16),
            )
        )
    assert len(ids) == 1
    assert ctx.redis.llen(ctx.keys.queue_list("m1")) == 1


@pytest.mark.parametrize("failure", ["publish_failed", "placement_lock_lost"])
def test_r20_a_retry_of_a_submission_that_published_nothing_gets_a_job_that_runs(
    ctx: ServerContext, tiny_models_dir: Path, monkeypatch: pytest.MonkeyPatch, failure: str
) -> None:
    """A submission answered 5xx after its job was journaled but before it was published
    (the broker dropped the publish, or the fleet lock expired) ends that job ``interrupted``
    and says "nothing was published; submit again". The client's retry with the same
    Idempotency-Key (R20: a deliberate retry) must then get a job that runs, not a replay of
    the interrupted one that never will."""
    import redis

    from app.core.errors import PlacementLost

    model = ctx.registry.add(tiny_models_dir / "tiny-sd").id
    bring_online(ctx, "m1", {model})

    def submit() -> Submission:
        return ctx.dispatcher.submit(
            model, "txt2img", {"prompt": "x", "seed": 1}, "m1", idempotency_key="k", api_key_id="ka"
        )

    if failure == "publish_failed":
        publish = ctx.queues.publish

        def broken(*args: object, **kwargs: object) -> None:
            monkeypatch.setattr(ctx.queues, "publish", publish)  # once
            raise redis.ConnectionError("Connection reset by peer")

        monkeypatch.setattr(ctx.queues, "publish", broken)
        expected: type[Exception] = redis.ConnectionError
    else:
        add = ctx.machines.reservations.add

        def lost(*args: object, **kwargs: object) -> bool:
            monkeypatch.setattr(ctx.machines.reservations, "add", add)  # once
            return False

        monkeypatch.setattr(ctx.machines.reservations, "add", lost)
        expected = PlacementLost
    with pytest.raises(expected):
        submit()
    [first] = ctx.journal.list()
    assert (first.state, first.reason) == (JobState.interrupted, failure)
    retry = submit()
    assert not retry.replayed and retry.job.id != first.id
    assert retry.job.state == JobState.queued and ctx.queues.queued_ids("m1") == [retry.job.id]
    again = submit()
    assert (again.job.id, again.replayed) == (retry.job.id, True)  # the key now names the job that runs
    assert ctx.journal.get(first.id).state == JobState.interrupted  # the interrupted one stays journaled


def test_c03_cancel_removes_the_queue_entry_and_the_claim_refuses_a_late_copy(
    ctx: ServerContext, tiny_models_dir: Path
) -> None:
    model = ctx.registry.add(tiny_models_dir / "tiny-sd").id
    bring_online(ctx, "m1", {model})
    first, second, third = (ctx.dispatcher.submit(model, "txt2img", {"prompt": p}, "m1").job.id for p in "abc")
    cancelled = ctx.dispatcher.cancel(second)
    assert cancelled.state == JobState.cancelled
    assert ctx.queues.queued_ids("m1") == [first, third]  # only its entry is gone, order kept
    assert [job_id for job_id, _ in ctx.machines.reservations.records("m1")] == [first, third]  # released (R14)
    with pytest.raises(Exception, match="cancelled"):
        ctx.journal.claim(second, "m1")
    assert ctx.journal.get(second).state == JobState.cancelled


def test_c03_a_running_or_ended_job_cannot_be_cancelled(ctx: ServerContext, tiny_models_dir: Path) -> None:
    from app.core.errors import Conflict

    model = ctx.registry.add(tiny_models_dir / "tiny-sd").id
    bring_online(ctx, "m1", {model})
    job = ctx.dispatcher.submit(model, "txt2img", {"prompt": "x"}, "m1").job.id
    ctx.journal.claim(job, "m1")
    with pytest.raises(Conflict) as refused:
        ctx.dispatcher.cancel(job)
    assert refused.value.status_code == 409 and "is running on m1" in refused.value.message
    assert ctx.journal.get(job).state == JobState.running
    # an ended job, asked through POST /v1/jobs/{id}/cancel: the answer says it has ended
    other = ctx.dispatcher.submit(model, "txt2img", {"prompt": "y"}, "m1").job.id
    ctx.dispatcher.cancel(other)
    with pytest.raises(Conflict) as again:
        ctx.dispatcher.request_cancel(other)
    assert again.value.reason == "not_cancellable_cancelled"
    assert "is cancelled on m1; it has ended, there is nothing to cancel" in again.value.message


def test_c03_a_cancel_racing_the_claim_asks_the_running_job_to_stop(
    ctx: ServerContext, tiny_models_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``POST /v1/jobs/{id}/cancel`` read the job queued, and its worker claimed it before the
    cancel's conditional update: the job is running, and the request must ask it to stop
    between steps (202 with the running job, docs/api.md "Reading and ending jobs"), not
    answer 409 ``not_cancellable_running`` and leave it to run to its end."""
    model = ctx.registry.add(tiny_models_dir / "tiny-sd").id
    bring_online(ctx, "m1", {model})
    job = ctx.dispatcher.submit(model, "txt2img", {"prompt": "x"}, "m1").job.id
    cancel = ctx.dispatcher.endings.cancel

    def claimed_first(job_id: str, *args: object, **kwargs: object) -> object:
        ctx.journal.claim(job_id, "m1")  # the worker's claim lands between the read and the update
        return cancel(job_id, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(ctx.dispatcher.endings, "cancel", claimed_first)
    answered = ctx.dispatcher.request_cancel(job)
    assert answered.state == JobState.running
    assert ctx.redis.exists(ctx.keys.cancel(job))  # its worker stops it between steps


def test_drain_refuses_pinned_jobs_and_auto_skips_the_machine(ctx: ServerContext, tiny_models_dir: Path) -> None:
    model = ctx.registry.add(tiny_models_dir / "tiny-sd").id
    bring_online(ctx, "m1", {model})
    bring_online(ctx, "m2", {model})
    ctx.redis.set(ctx.keys.draining("m1"), "1")
    with pytest.raises(MachineUnavailable) as refused:
        ctx.dispatcher.submit(model, "txt2img", {"prompt": "x"}, "m1")
    assert refused.value.reason == "machine_draining" and "m1" in refused.value.message
    placed = {ctx.dispatcher.submit(model, "txt2img", {"prompt": f"{i}"}, "auto").job.machine for i in range(3)}
    assert "m1" not in placed
    ctx.redis.delete(ctx.keys.draining("m1"))
    assert ctx.dispatcher.submit(model, "txt2img", {"prompt": "x"}, "m1").job.machine == "m1"


def test_c04_a_reservation_is_written_only_while_the_fleet_lock_holds_our_token(ctx: ServerContext) -> None:
    lock_key = ctx.keys.fleet_lock()
    demand = HashField(ctx.keys.demand(), "tiny-sd", "[1.0, 1.0, 0.0]")
    ctx.redis.set(lock_key, "another-placer", px=5000)
    lost = Fence(lock_key, "our-token", ttl_ms=30_000)
    assert not ctx.machines.reservations.add("m1", "job-1", "tiny-sd", "txt2img", 4, 4096, lost, also=[demand])
    assert ctx.machines.reservations.count("m1") == 0 and not ctx.redis.exists(ctx.keys.demand())
    assert ctx.redis.get(ctx.keys.reservation_seq()) is None  # no sequence number was drawn
    assert ctx.redis.pttl(lock_key) <= 5000  # another placer's lock is left as it was

    ctx.redis.set(lock_key, "our-token", px=500)
    assert ctx.machines.reservations.add("m1", "job-1", "tiny-sd", "txt2img", 4, 4096, lost, also=[demand])
    assert ctx.redis.pttl(lock_key) > 5000  # renewed to the fence's full TTL
    [(job_id, record)] = ctx.machines.reservations.records("m1")
    assert (job_id, record["seq"], record["steps"], record["size"]) == ("job-1", 1, 4, 4096)
    assert ctx.redis.hget(ctx.keys.demand(), "tiny-sd") == "[1.0, 1.0, 0.0]"


def test_r14_marking_a_job_started_never_brings_back_a_released_reservation(ctx: ServerContext) -> None:
    """A claim marks the reservation running while the job may just have been cancelled and
    released: the mark and the existence check are one atomic step."""
    reservations = ctx.machines.reservations
    ctx.redis.set(ctx.keys.fleet_lock(), "ours", px=5000)
    fence = Fence(ctx.keys.fleet_lock(), "ours", ttl_ms=5000)
    for job_id in ("job-1", "job-2"):
        assert reservations.add("m1", job_id, "tiny-sd", "txt2img", 4, 4096, fence)
    assert reservations.start("m1", "job-1", at_s=1_700_000_000.25)
    started = dict(reservations.records("m1"))["job-1"]
    assert started["started_at"] == pytest.approx(1_700_000_000.25) and started["seq"] == 1 and started["steps"] == 4
    assert [item.elapsed_s is not None for item in reservations.items("m1")] == [True, False]  # running first

    assert reservations.release("m1", "job-2")
    assert not reservations.start("m1", "job-2")  # released: not written again
    assert [job_id for job_id, _ in reservations.records("m1")] == ["job-1"]


def test_r22_integer_valued_floats_are_integers_for_every_check_the_price_and_the_worker(
    ctx: ServerContext, tiny_models_dir: Path
) -> None:
    """A JSON client may send 64.0 for 64: the model's frame limit must see 64 (not skip a
    float), and the job must be journaled and priced with the number it asked for."""
    model = ctx.registry.add(tiny_models_dir / "tiny-animatediff").id  # motion_max_seq_length 32
    bring_online(ctx, "m1", {model})
    with pytest.raises(Rejected) as refused:
        ctx.dispatcher.submit(model, "video", {"prompt": "x", "frames": 64.0, "width": 64, "height": 64}, "m1")
    assert refused.value.reason == "invalid_frames" and "between 1 and 32" in refused.value.message
    with pytest.raises(Rejected, match="between 1 and 32"):  # one limit, the same message at both ends
        ctx.dispatcher.submit(model, "video", {"prompt": "x", "frames": 0, "width": 64, "height": 64}, "m1")
    job = ctx.dispatcher.submit(model, "video", {"prompt": "x", "frames": 16.0, "width": 64.0, "height": 64}, "m1").job
    assert job.params["frames"] == 16 and isinstance(job.params["frames"], int) and job.params["width"] == 64
    record = json.loads(ctx.redis.hget(ctx.keys.reservations("m1"), job.id))
    assert record["size"] == 64 * 64 * 16  # priced at 16 frames, not the default 8


def test_a_job_predicted_to_run_longer_than_max_job_s_on_every_eligible_machine_is_refused_naming_both(
    settings: Settings, tiny_models_dir: Path
) -> None:
    """``max_job_s`` (here a tiny 0.01 s): a job whose predicted run time (placement's, R12)
    exceeds it on the fastest eligible machine is refused 422 ``job_too_long`` naming the
    prediction and the limit, journaled ``rejected``, nothing published; the dry run shows the
    figure beside the limit and the same refusal. Under a limit it fits, it is queued."""
    tight = build_context(settings.model_copy(update={"max_job_s": 0.01}), make_fleet("m1", "m2"), migrate=True)
    try:
        model = tight.registry.add(tiny_models_dir / "tiny-sd").id
        bring_online(tight, "m1", {model})
        bring_online(tight, "m2", {model})
        params = {"prompt": "x", "steps": 50}
        dry = tight.dispatcher.dry_run(model, "txt2img", params, "auto")
        assert dry["max_job_s"] == 0.01 and dry["predicted_run_s"] > 0.01, dry
        assert dry["predicted_run_s"] == min(dry["machines"][m]["run_s"] for m in ("m1", "m2"))
        assert (dry["error"]["reason"], dry["machine"]) == ("job_too_long", None), dry
        for target, where in (("auto", "the fastest of 2 eligible machines"), ("m1", "the only eligible machine")):
            with pytest.raises(Rejected) as refused:
                tight.dispatcher.submit(model, "txt2img", params, target)
            assert refused.value.reason == "job_too_long" and refused.value.status_code == 422
            assert "the limit (max_job_s) is 0.01 s" in refused.value.message, refused.value.message
            assert where in refused.value.message and "predicted run time is " in refused.value.message
        assert [j.reason for j in tight.journal.list()] == ["job_too_long", "job_too_long"]
        assert all(tight.redis.llen(tight.keys.queue_list(m)) == 0 for m in ("server", "m1", "m2"))
        tight.dispatcher.settings = settings.model_copy(update={"max_job_s": 3600.0})
        roomy = tight.dispatcher.dry_run(model, "txt2img", params, "auto")
        assert "error" not in roomy and roomy["machine"] in ("m1", "m2") and roomy["max_job_s"] == 3600.0
        assert tight.dispatcher.submit(model, "txt2img", params, "auto").job.state == JobState.queued
    finally:
        tight.close()
