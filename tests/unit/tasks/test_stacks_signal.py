"""A hung pool process says where it hangs (R19): on ``STACKS_SIGNAL`` it writes every thread's
Python stack to its stderr (the worker's log), even while its main thread waits on a lock for
ever, and the watchdog asks for them before it kills it (tasks/watchdog.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tasks.watchdog import STACKS_SIGNAL

SCRIPT = """
import sys, threading
from tasks.watchdog import dump_stacks_on_signal
dump_stacks_on_signal()
held = threading.Lock()
held.acquire()
def waits_for_a_lock_held_for_ever():
    print("ready", flush=True)
    held.acquire()
waits_for_a_lock_held_for_ever()
"""


def test_r19_a_process_stuck_on_a_lock_writes_its_stacks_on_the_signal(tmp_path: Path) -> None:
    log = tmp_path / "worker.log"
    with log.open("wb") as stderr:
        child = subprocess.Popen(
            [sys.executable, "-c", SCRIPT],
            stdout=subprocess.PIPE,
            stderr=stderr,
            cwd=Path(__file__).resolve().parents[3],
            text=True,
        )
        try:
            assert child.stdout is not None and child.stdout.readline().strip() == "ready"
            time.sleep(0.2)  # into the second acquire (a wait for it would need the very stacks we ask for)
            os.kill(child.pid, STACKS_SIGNAL)
            deadline = time.monotonic() + 30
            while "waits_for_a_lock_held_for_ever" not in log.read_text() and time.monotonic() < deadline:
                time.sleep(0.05)
            assert child.poll() is None  # it answered and lives on: only the watchdog's kill ends it
        finally:
            child.kill()
            child.wait(timeout=30)
    text = log.read_text()
    assert "waits_for_a_lock_held_for_ever" in text and "Current thread" in text, text
    assert STACKS_SIGNAL != signal.SIGUSR1  # billiard's soft time limit in a pool process
