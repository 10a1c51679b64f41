"""The worker's SIGTERM between its first heartbeat and Celery's own handlers (R7, tasks/worker.py
``wait_first_beat``): a worker whose lease another worker took signals itself; in that window
the default handler killed it with 143 (seen on a slow host), not the documented exit 78."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from types import SimpleNamespace

import pytest

from tasks.lease import EX_CONFIG
from tasks.worker import wait_first_beat


@pytest.fixture
def sigterm_restored() -> Iterator[None]:
    before = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, before)


def stand_ins(beats: bool, lost: bool) -> tuple[SimpleNamespace, SimpleNamespace]:
    """A heartbeat whose first beat is written (or not: another worker holds the lease) and the lease."""
    stopped: list[bool] = []
    heartbeat = SimpleNamespace(
        wait_first_beat=lambda: beats, stop=lambda: stopped.append(True), stopped=stopped, refused=False
    )
    return heartbeat, SimpleNamespace(lost=lost)


@pytest.mark.parametrize(("lost", "code"), [(True, EX_CONFIG), (False, 0)])
def test_once_beating_sigterm_exits_78_for_a_lost_lease_and_0_otherwise_until_celery_takes_over(
    sigterm_restored: None, lost: bool, code: int
) -> None:
    heartbeat, lease = stand_ins(beats=True, lost=lost)
    assert wait_first_beat(heartbeat, lease) is True  # type: ignore[arg-type]
    handler = signal.getsignal(signal.SIGTERM)
    assert callable(handler), handler  # not SIG_DFL: that would end the process with 143
    with pytest.raises(SystemExit) as stopped:
        handler(signal.SIGTERM, None)
    assert stopped.value.code == code


def test_not_beating_puts_the_previous_handler_back(sigterm_restored: None) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    heartbeat, lease = stand_ins(beats=False, lost=True)
    assert wait_first_beat(heartbeat, lease) is False  # type: ignore[arg-type]
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
