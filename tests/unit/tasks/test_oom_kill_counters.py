"""R21: a pool process killed by SIGKILL is an OOM only when the kernel's OOM-kill counters rose
while its job ran (``tasks.watchdog.sigkill_verdict``, a pure function of the counters read at
the job's start and after its death); where no counter can be read (macOS), a SIGKILL is taken
as an OOM, as before the counters were read."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tasks.watchdog import VMSTAT, oom_kill_counters, sigkill_verdict

HOST = str(VMSTAT)
CGROUP = "/sys/fs/cgroup/worker/memory.events"


def test_a_counter_that_rose_is_an_oom_and_names_its_figures() -> None:
    oom, why = sigkill_verdict({HOST: 3, CGROUP: 0}, {HOST: 3, CGROUP: 1})
    assert oom
    assert why == f"the kernel's OOM killer killed a process meanwhile ({CGROUP} oom_kill 0 -> 1)"


def test_counters_that_did_not_move_are_no_oom() -> None:
    oom, why = sigkill_verdict({HOST: 7}, {HOST: 7})
    assert not oom
    assert why == f"not by the kernel's OOM killer (its counter did not move: {HOST} oom_kill 7)"


def test_only_counters_read_at_both_ends_count() -> None:
    assert sigkill_verdict({HOST: 7}, {HOST: 7, CGROUP: 5}) == sigkill_verdict({HOST: 7}, {HOST: 7})
    assert sigkill_verdict({CGROUP: 1}, {HOST: 9, CGROUP: 2})[0]


@pytest.mark.parametrize(
    ("before", "after", "where"),
    [({}, {}, "when the job started"), ({}, {HOST: 2}, "when the job started"), ({HOST: 2}, {}, "now")],
    ids=["macos", "no_reading_at_start", "none_now"],
)
def test_without_counters_at_both_ends_a_sigkill_is_taken_as_an_oom(
    before: dict[str, int], after: dict[str, int], where: str
) -> None:
    oom, why = sigkill_verdict(before, after)
    assert oom
    assert f"no OOM-kill counter of the kernel could be read {where}" in why


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the kernel's counters are Linux's")
def test_this_hosts_vmstat_counter_is_read_as_the_kernel_writes_it() -> None:
    line = next(line for line in Path("/proc/vmstat").read_text().splitlines() if line.startswith("oom_kill "))
    counters = oom_kill_counters()
    assert counters[HOST] == int(line.split()[1])
    assert all(value >= 0 for value in counters.values())
