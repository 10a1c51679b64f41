"""A pool process forked while another thread of the worker's parent writes a log line can
still log (tasks/logfork.py, R7/R19): without the fork hook, such a child waits for ever on
the stream's lock, which the writing thread held at the fork."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = """
import logging, os, sys, threading, time
hold, forks, bound_s = sys.argv[1] == "hold", int(sys.argv[2]), float(sys.argv[3])
logging.basicConfig(stream=open(os.devnull, "w"), level=logging.INFO)  # the stream's lock is what counts
log = logging.getLogger("parent")
if hold:
    from tasks.logfork import hold_log_handlers_across_fork
    hold_log_handlers_across_fork()
    hold_log_handlers_across_fork()  # idempotent: one hook
def write_lines():  # as the heartbeat's and the reporters' threads do
    while True:
        log.info("a line from another thread " + "x" * 4000)
threading.Thread(target=write_lines, daemon=True).start()
time.sleep(0.05)
stuck = 0
for _ in range(forks):
    pid = os.fork()
    if pid == 0:
        log.info("the child's first line")
        os._exit(0)
    deadline = time.monotonic() + bound_s
    while not os.waitpid(pid, os.WNOHANG)[0]:
        if time.monotonic() > deadline:
            stuck += 1
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            break
        time.sleep(0.002)
print(stuck)
"""


def stuck_children(tmp_path: Path, mode: str, forks: int, bound_s: float) -> int:
    script = tmp_path / "forks.py"
    script.write_text(SCRIPT)
    done = subprocess.run(
        [sys.executable, str(script), mode, str(forks), str(bound_s)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).resolve().parents[3],
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[3])},
        check=True,
    )
    return int(done.stdout.strip())


def test_children_forked_while_another_thread_logs_all_write_their_first_line(tmp_path: Path) -> None:
    assert stuck_children(tmp_path, "hold", forks=60, bound_s=20.0) == 0


def test_without_the_hook_such_a_child_waits_for_ever(tmp_path: Path) -> None:
    """The check above can fail: the same children, without the hook, get stuck."""
    assert stuck_children(tmp_path, "plain", forks=4, bound_s=0.5) >= 1
