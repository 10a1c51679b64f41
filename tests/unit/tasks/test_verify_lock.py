"""The worker's verification lock (``tasks/verify.py`` ``one_check_at_a_time``, R4) when a pool
process is forked while it is held, as Celery forks its pool while the heartbeat thread runs the
start-up check: once the check ends, a later check (a registry change, a model put back) takes
the lock at once, though the child lives on with the inherited file. Released by closing the
file, the child's copy kept it held until the pool process died: a model put back stayed
withdrawn until the worker stopped."""

from __future__ import annotations

import fcntl
import os
import signal
import time
from pathlib import Path

from tasks.verify import LOCK_FILE, one_check_at_a_time


def taken_within(path: Path, timeout_s: float) -> bool:
    """Whether another open file of ``path`` gets the exclusive lock within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    with open(path, "a") as other:
        while time.monotonic() < deadline:
            try:
                fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                time.sleep(0.05)
                continue
            fcntl.flock(other, fcntl.LOCK_UN)
            return True
    return False


def test_r4_a_child_forked_during_a_check_does_not_keep_the_lock_after_it(tmp_path: Path) -> None:
    with one_check_at_a_time(tmp_path):
        child = os.fork()
        if child == 0:  # the pool process: it lives on, holding the inherited open file
            signal.pause()
            os._exit(0)
    try:
        assert taken_within(tmp_path / LOCK_FILE, timeout_s=5), "the forked child keeps the check's lock"
        with one_check_at_a_time(tmp_path):  # the next check of this worker runs
            pass
    finally:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
