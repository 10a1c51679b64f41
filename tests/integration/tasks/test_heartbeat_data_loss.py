"""A worker's advertised set survives Redis losing its data (R4, R19): restarted without
persistence (a new run id) or flushed (``FLUSHALL``, ``FLUSHDB``: the same run id), the next beat writes the
set back, so the machine stays placeable without a sync. Real Redis; the heartbeat and lease
are the worker's own (tasks/heartbeat.py, tasks/lease.py)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis

from app.core.keys import Keys
from tasks.heartbeat import Heartbeat
from tests.helpers import worker_settings

VERIFIED = {"tiny-sd", "tiny-llama"}


class FolderCheck:
    """The verifier's one call: the models whose files the folder holds."""

    def verify(self) -> set[str]:
        return set(VERIFIED)


@dataclass
class Beating:
    client: redis.Redis
    keys: Keys
    beat: Heartbeat


@pytest.fixture
def beating(redis_url: str, tmp_path: Path) -> Iterator[Beating]:
    """m1's heartbeat, holding the lease, its models advertised, one beat written."""
    settings = worker_settings(redis_url, tmp_path)
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    keys = Keys(settings.key_prefix)
    beat = Heartbeat(settings, client, keys, "boot-1", "cpu", FolderCheck())  # type: ignore[arg-type]
    client.set(keys.worker_lease("m1"), "boot-1")  # the lease this worker holds
    beat._first_check()
    client.sadd(keys.verified("m1"), *VERIFIED)  # as the verifier advertises them
    assert beat.beat()
    yield Beating(client, keys, beat)
    client.close()


def test_r19_a_flushed_redis_gets_the_advertised_set_back_at_the_next_beat(beating: Beating) -> None:
    client, keys, beat = beating.client, beating.keys, beating.beat
    client.srem(keys.verified("m1"), "tiny-llama")  # withdrawn by the job-time check: stays withdrawn
    assert beat.beat() and client.smembers(keys.verified("m1")) == {"tiny-sd"}

    client.flushdb()  # the same Redis (run id), its data gone (FLUSHDB: the session Redis serves other tests)
    client.set(keys.worker_lease("m1"), "boot-1")  # the lease thread takes it back (tasks/lease.py)
    assert beat.beat()
    assert client.smembers(keys.verified("m1")) == {"tiny-sd"}  # back, as it was before the loss
    assert client.get(keys.heartbeat("m1")) is not None


@pytest.mark.parametrize("after_calls", [1, 2, 3])
def test_r19_a_loss_at_any_moment_of_a_beat_gets_the_advertised_set_back(beating: Beating, after_calls: int) -> None:
    """Redis loses its data (``FLUSHDB``) between two of a beat's own commands, and the lease
    thread takes the lease back at once (tasks/lease.py): however the loss falls, the beat
    written after it leaves the set as it was. (The beat once checked the kept marker, then read
    the set, then wrote: a loss between the check and the read left the set empty, and kept.)"""
    client, keys, beat = beating.client, beating.keys, beating.beat

    plain = client.execute_command
    calls: list[str] = []

    def losing(*args: Any, **options: Any) -> Any:
        answer = plain(*args, **options)
        calls.append(str(args[0]))
        if len(calls) == after_calls:
            plain("FLUSHDB")
            plain("SET", keys.worker_lease("m1"), "boot-1")  # the lease taken back meanwhile
        return answer

    client.execute_command = losing  # type: ignore[method-assign]
    for _ in range(2):  # the beat under way, then the next one
        beat.beat()
    client.execute_command = plain  # type: ignore[method-assign]
    assert len(calls) >= after_calls, calls
    assert client.smembers(keys.verified("m1")) == VERIFIED, calls
