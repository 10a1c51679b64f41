"""A snapshot re-reads a machine's reservations only when they changed (a submission's
cost must not grow with the backlog), and never serves an old backlog for a changed one (R14):
every writer replaces the hash's version token in the same atomic step; a hash changed behind
the writers' back, or a Redis that lost its data, is read in full."""

from __future__ import annotations

from app.context import ServerContext, build_context
from app.core.config import Settings
from app.fleet.lock import Fence
from app.fleet.multiread import MultiRead
from tests.helpers import make_fleet


def fence(ctx: ServerContext) -> Fence:
    ctx.redis.set(ctx.keys.fleet_lock(), "ours", px=60_000)
    return Fence(ctx.keys.fleet_lock(), "ours", ttl_ms=60_000)


def queue_of(ctx: ServerContext, machine: str = "m1") -> list[str]:
    return [item.model_id for item in ctx.machines.view(machine).queue]


def test_r14_each_write_is_seen_by_the_next_snapshot_and_an_unchanged_hash_is_not_sent_again(
    ctx: ServerContext, settings: Settings
) -> None:
    reservations = ctx.machines.reservations
    held = fence(ctx)
    for i in range(50):
        assert reservations.add("m1", f"job-{i}", f"model-{i}", "txt2img", 4, 4096, held)
    assert queue_of(ctx) == [f"model-{i}" for i in range(50)]
    read, seen = reservations.snapshot_read("m1")
    assert read[0] == "HGETALL_SINCE" and len(seen[1]) == 50
    version, unchanged = MultiRead(ctx.redis)([read])[0]
    assert version == seen[0] and unchanged is None  # nothing sent back: the same 50 records

    # Another process (another API worker) writes: this one's next snapshot sees each change.
    other = build_context(settings, make_fleet("m1", "m2"), migrate=False)
    try:
        theirs = other.machines.reservations
        assert theirs.add("m1", "job-new", "model-new", "txt2img", 4, 4096, held)
        assert queue_of(ctx)[-1] == "model-new" and len(queue_of(ctx)) == 51
        assert theirs.start("m1", "job-7")
        assert queue_of(ctx)[0] == "model-7"  # running first
        assert ctx.machines.view("m1").queue[0].elapsed_s is not None
        assert theirs.release("m1", "job-7") and not theirs.release("m1", "job-7")
        assert "model-7" not in queue_of(ctx) and len(queue_of(ctx)) == 50
    finally:
        other.close()


def test_r14_a_hash_changed_behind_its_writers_or_lost_with_redis_is_read_in_full(ctx: ServerContext) -> None:
    reservations = ctx.machines.reservations
    held = fence(ctx)
    for i in range(3):
        assert reservations.add("m1", f"job-{i}", f"model-{i}", "txt2img", 4, 4096, held)
    assert len(queue_of(ctx)) == 3
    ctx.redis.delete(ctx.keys.reservations("m1"))  # its version is left behind: the field count differs
    assert queue_of(ctx) == []

    # Redis lost its data, then one job was reserved again: a version repeated after the loss would
    # hide the change, so versions are random tokens and a missing one reads in full.
    held = fence(ctx)
    assert reservations.add("m1", "job-a", "model-a", "txt2img", 4, 4096, held)
    assert queue_of(ctx) == ["model-a"]
    ctx.redis.flushdb()
    assert queue_of(ctx) == []
    ctx.redis.hset(
        ctx.keys.reservations("m1"),
        "job-b",  # as an older release wrote it: no version
        '{"model_id": "model-b", "kind": "txt2img", "steps": 4, "size": 4096, "started_at": null, "seq": 0}',
    )
    assert queue_of(ctx) == ["model-b"]  # no version key: read in full every time
    assert queue_of(ctx) == ["model-b"]
    assert ctx.redis.get(ctx.keys.reservations_version("m1")) is None
    held = fence(ctx)
    assert reservations.add("m1", "job-c", "model-c", "txt2img", 4, 4096, held)
    assert ctx.redis.get(ctx.keys.reservations_version("m1")) is not None
    assert queue_of(ctx) == ["model-b", "model-c"]
