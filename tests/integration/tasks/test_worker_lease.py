"""One worker per machine from its start (new-user pass): a second worker started while the
first is still starting (verifying its files, no heartbeat yet) must not consume; a worker
that died frees the machine within one TTL. Real Redis; the lease is what `homefleet worker`
takes before it consumes anything."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import redis

from tasks.lease import EX_CONFIG, WorkerLease
from tests.helpers import wait_for, worker_settings

#: how long a starved machine (one core, beside a CPU hog) may take to run a renewal or notice a loss:
#: a bound for a wait on a condition, never a fixed sleep
SLOW_S = 30.0


def test_r7_a_second_worker_of_a_machine_is_refused_from_the_first_ones_start(redis_url: str, tmp_path: Path) -> None:
    settings = worker_settings(redis_url, tmp_path)
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    first = WorkerLease(settings, client, "boot-1")
    first.acquire()
    try:
        time.sleep(2 * settings.heartbeat_ttl_s)  # renewed past its TTL while the first one starts
        started = time.monotonic()
        with pytest.raises(SystemExit) as refused:
            WorkerLease(settings, client, "boot-2").acquire()
        assert refused.value.code == EX_CONFIG
        assert time.monotonic() - started >= settings.heartbeat_ttl_s  # it waited out one TTL first
        assert client.get(first.key) == "boot-1"
    finally:
        first.release()
    assert client.get(first.key) is None  # a clean stop frees the machine at once
    second = WorkerLease(settings, client, "boot-2")
    second.acquire()
    second._stop.set()  # it dies: nothing renews or releases its lease
    started = time.monotonic()
    third = WorkerLease(settings, client, "boot-3")
    third.acquire()  # the dead worker's lease lapses within its TTL (acquire gives up after one TTL: SystemExit)
    assert time.monotonic() - started <= settings.heartbeat_ttl_s + SLOW_S  # no second full wait
    assert client.get(third.key) == "boot-3"
    second.release()  # a late release of a lapsed lease does not free the new holder's
    assert client.get(third.key) == "boot-3"
    third.release()


def test_r7_a_lease_that_vanished_is_taken_back_and_one_another_worker_took_stops_this_one(
    redis_url: str, tmp_path: Path
) -> None:
    """Redis restarted without persistence, lost its data, or stalled past the TTL: the lease
    key is gone while its worker still runs. The worker takes it back at its next renewal, so
    a second worker started later is still refused. A lease another worker took meanwhile is
    lost for good: the first worker is told to stop (``on_lost``), once."""
    settings = worker_settings(redis_url, tmp_path)
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    told: list[str] = []
    first = WorkerLease(settings, client, "boot-1", on_lost=lambda: told.append("stop"))
    first.acquire()
    try:
        for _ in range(2):
            client.delete(first.key)  # as a Redis restart without persistence or FLUSHALL does
            wait_for(lambda: client.get(first.key) == "boot-1", SLOW_S, "the renewal to take the lease back")
            assert not first.lost
            assert 0 < client.pttl(first.key) <= first.ttl_ms  # with its TTL: it lapses if the worker dies
        with pytest.raises(SystemExit):
            WorkerLease(settings, client, "boot-2").acquire()  # still refused

        client.set(first.key, "boot-3", px=first.ttl_ms)  # taken by another worker while the first stalled
        wait_for(lambda: first.lost, SLOW_S, "the first worker to notice")
        wait_for(lambda: told, SLOW_S, "the first worker to be told to stop")
        time.sleep(settings.heartbeat_interval_s * 3)  # three more renewals' time: nothing more is said
        assert told == ["stop"]  # told once; its renewal thread ended
        assert client.get(first.key) == "boot-3"  # the new holder's lease is left alone
    finally:
        first.release()
    assert client.get(first.key) == "boot-3"


def test_r7_a_lease_lost_before_the_worker_could_listen_still_stops_it(redis_url: str, tmp_path: Path) -> None:
    """The worker learns how to stop (``on_lost``) only after it imported torch (seconds): a
    lease lost in that window is acted on when it listens, once; a clean release waits for a
    renewal under way, which would otherwise take the released lease back."""
    settings = worker_settings(redis_url, tmp_path)
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    lease = WorkerLease(settings, client, "boot-1")
    lease.acquire()
    client.set(lease.key, "boot-2", px=lease.ttl_ms)
    wait_for(lambda: lease.lost, SLOW_S, "the lease to be noticed lost")
    told: list[str] = []
    lease.on_lost(lambda: told.append("stop"))
    lease.on_lost(lambda: told.append("again"))
    assert told == ["stop"]
    lease.release()
    assert client.get(lease.key) == "boot-2"

    for _ in range(20):  # released right as a renewal runs: the key stays released
        client.delete(lease.key)
        fresh = WorkerLease(settings, client, "boot-3")
        fresh.acquire()
        time.sleep(settings.heartbeat_interval_s * 0.97)
        fresh.release()
        time.sleep(settings.heartbeat_interval_s)
        assert client.get(lease.key) is None
