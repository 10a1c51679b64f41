"""The watchdog's kill of a hung or cancelled job's pool process (R19, R21) cuts that job only:
when the job ends during the half second the watchdog gives the process to write its stacks,
and the process takes the next job, that job must not be killed (an operator's pass: a cancel
that a long step outlasted killed the job queued behind it, failed ``error``). Real Redis; the
pool process is a real child process that ignores the stacks signal, as a pool process
prints its stacks and runs on."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import redis

from app.core.keys import Keys
from tasks import watchdog as watchdog_module
from tasks.watchdog import Watchdog
from tests.helpers import worker_settings


@pytest.fixture
def pool_process() -> Iterator[subprocess.Popen[bytes]]:
    """A child of this process standing for the pool process: it ignores SIGUSR2 (the stacks
    signal) and sleeps until killed."""
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import signal, time; signal.signal(signal.SIGUSR2, signal.SIG_IGN); print('ready', flush=True); "
            "time.sleep(120)",
        ],
        stdout=subprocess.PIPE,
    )
    assert child.stdout is not None and child.stdout.readline() == b"ready\n"  # its handler is in place
    try:
        yield child
    finally:
        child.kill()
        child.wait(timeout=10)


def watchdog_for(redis_url: str, tmp_path: Path, pid: int, job_id: str) -> tuple[Watchdog, redis.Redis, Keys]:
    """A watchdog of machine m1 whose running record names ``job_id`` in ``pid``, asked to
    restart (kill) that job's process."""
    settings = worker_settings(redis_url, tmp_path)
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    keys = Keys(settings.key_prefix)
    client.set(keys.running("m1"), json.dumps({"job_id": job_id, "pid": pid}))
    client.set(keys.restart("m1"), job_id)
    return Watchdog(settings, client, keys, "boot-1"), client, keys


def test_r19_the_job_that_ended_in_the_stacks_wait_spares_the_next_job(
    redis_url: str, tmp_path: Path, pool_process: subprocess.Popen[bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    watchdog, client, keys = watchdog_for(redis_url, tmp_path, pool_process.pid, "job-a")

    def job_a_ends_and_b_starts(_seconds: float) -> None:  # the stacks' wait: the process moves on
        client.set(keys.running("m1"), json.dumps({"job_id": "job-b", "pid": pool_process.pid}))

    monkeypatch.setattr(watchdog_module.time, "sleep", job_a_ends_and_b_starts)
    watchdog.obey_restart()
    process = psutil.Process(pool_process.pid)
    assert pool_process.poll() is None and process.status() != psutil.STATUS_STOPPED  # alive, running on
    assert "job-a" not in watchdog.killed


def test_r19_the_hung_job_still_running_after_the_stacks_wait_is_killed(
    redis_url: str, tmp_path: Path, pool_process: subprocess.Popen[bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    watchdog, _, _ = watchdog_for(redis_url, tmp_path, pool_process.pid, "job-a")
    monkeypatch.setattr(watchdog_module.time, "sleep", lambda _seconds: None)
    watchdog.obey_restart()
    assert pool_process.wait(timeout=10) == -9  # SIGKILL, though it was stopped first
    assert "job-a" in watchdog.killed
