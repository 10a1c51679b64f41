"""The sync's reservation renewal (R6, tasks/sync.py ``Renewal``): it reports on its own
thread until its block ends, however the block ends, and hands a refusal to the copier."""

from __future__ import annotations

import threading
import time
from contextlib import nullcontext

import httpx
import pytest

from app.core.errors import Conflict
from tasks.sync import Renewal


def renewal_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "homefleet-sync-renewal"]


@pytest.mark.parametrize("outcome", ["returns", "raises"])
def test_r6_renewal_reports_while_the_block_runs_and_stops_when_it_ends(outcome: str) -> None:
    reports: list[float] = []
    raising = pytest.raises(RuntimeError) if outcome == "raises" else nullcontext()
    with raising, Renewal(lambda: reports.append(time.monotonic()), interval_s=0.05):
        time.sleep(0.5)  # one long call (a hash) that reports nothing itself
        if outcome == "raises":
            raise RuntimeError("the copy failed")
    assert len(reports) >= 3
    assert not renewal_threads()
    count = len(reports)
    time.sleep(0.2)
    assert len(reports) == count  # nothing after the block


def test_r6_a_refused_renewal_stops_reporting_and_is_raised_to_the_copier() -> None:
    calls: list[int] = []

    def refused() -> None:
        calls.append(1)
        raise Conflict("sync s1 no longer holds machine 'm1' (its reservation expired)", reason="sync_not_reserved")

    with Renewal(refused, interval_s=0.02) as renewal:
        time.sleep(0.3)
        with pytest.raises(Conflict) as lost:
            renewal.check()
    assert lost.value.reason == "sync_not_reserved" and calls == [1]


def test_r6_a_transport_error_does_not_stop_the_renewal() -> None:
    calls: list[int] = []

    def flaky() -> None:
        calls.append(1)
        if len(calls) == 1:
            raise httpx.ConnectError("server unreachable")

    with Renewal(flaky, interval_s=0.02) as renewal:
        time.sleep(0.3)
        renewal.check()
    assert len(calls) >= 3
