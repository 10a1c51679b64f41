"""app/fleet/multiread.py against a real Redis: one command answers many reads in order, shaped as
redis-py's own commands would be (R14: placement's fleet snapshot is read through it)."""

from __future__ import annotations

import pytest
import redis

from app.fleet.multiread import MultiRead


@pytest.fixture
def client(redis_url: str) -> redis.Redis:
    return redis.Redis.from_url(redis_url, decode_responses=True)


def test_replies_match_the_plain_commands_in_order(client: redis.Redis) -> None:
    client.set("s", "beat")
    client.sadd("set", "a", "b")
    client.hset("h", mapping={"job-1": "{}", "job-2": '{"x": 1}'})
    reads = [
        ("GET", "s"),
        ("GET", "missing"),
        ("SMEMBERS", "set"),
        ("SMEMBERS", "no-set"),
        ("HGETALL", "h"),
        ("HGETALL", "no-hash"),
        ("EXISTS", "s"),
        ("EXISTS", "missing"),
    ]
    expected = [
        client.get("s"),
        client.get("missing"),
        client.smembers("set"),
        client.smembers("no-set"),
        client.hgetall("h"),
        client.hgetall("no-hash"),
        bool(client.exists("s")),
        bool(client.exists("missing")),
    ]
    assert (
        MultiRead(client)(reads)
        == expected
        == ["beat", None, {"a", "b"}, set(), {"job-1": "{}", "job-2": '{"x": 1}'}, {}, True, False]
    )


def test_a_write_command_is_refused_before_reaching_redis(client: redis.Redis) -> None:
    client.set("s", "kept")
    with pytest.raises(ValueError, match="DEL"):
        MultiRead(client)([("GET", "s"), ("DEL", "s")])
    assert client.get("s") == "kept"


def test_no_reads_sends_nothing(client: redis.Redis) -> None:
    assert MultiRead(client)([]) == []
