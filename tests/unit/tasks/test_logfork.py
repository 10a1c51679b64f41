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
until_stuck = sys.argv[4:] == ["until_stuck"]  # stop at the first stuck child
logging.basicConfig(stream=open(os.devnull, "w"), level=logging.INFO)  # the stream's lock is what counts
log = logging.getLogger("parent")
if hold:
    from tasks.logfork import hold_locks_across_fork
    hold_locks_across_fork()
    hold_locks_across_fork()  # idempotent: one hook
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
    if stuck and until_stuck:
        break
print(stuck)
"""


def stuck_children(tmp_path: Path, mode: str, forks: int, bound_s: float, until_stuck: bool = False) -> int:
    """How many of ``forks`` children, forked while another thread logs, did not write their
    first line within ``bound_s`` seconds (``until_stuck``: stop at the first such child)."""
    script = tmp_path / "forks.py"
    script.write_text(SCRIPT)
    done = subprocess.run(
        [sys.executable, str(script), mode, str(forks), str(bound_s), *(["until_stuck"] if until_stuck else [])],
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
    """The check above can fail: the same children, without the hook, get stuck. Whether one
    fork lands while the writing thread holds the stream's lock is chance (on one starved core,
    4 forks once all missed it): up to 60, stopping at the first stuck one."""
    assert stuck_children(tmp_path, "plain", forks=60, bound_s=0.5, until_stuck=True) == 1


GATED_CALL = """
import os, sys, threading, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from tasks.server_client import ServerClient
if sys.argv[1] == "hold":
    from tasks.logfork import hold_locks_across_fork
    hold_locks_across_fork()
arrived = threading.Event()
class Slow(BaseHTTPRequestHandler):
    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        arrived.set()
        time.sleep(0.6)  # the server is slow to answer: the call is under way meanwhile
        self.send_response(204)
        self.end_headers()
    def log_message(self, *args):
        pass
server = ThreadingHTTPServer(("127.0.0.1", 0), Slow)
threading.Thread(target=server.serve_forever, daemon=True).start()
client = ServerClient(f"http://127.0.0.1:{server.server_port}", "token", timeout_s=10)
threading.Thread(target=client.fail, args=("job", "oom", "killed"), daemon=True).start()  # as the reporter thread
arrived.wait(10)
start = time.monotonic()
pid = os.fork()
if pid == 0:
    os._exit(0)
waited_s = time.monotonic() - start
os.waitpid(pid, 0)
print(f"{waited_s:.3f}")
"""


def fork_wait_s(tmp_path: Path, mode: str) -> float:
    script = tmp_path / "gated.py"
    script.write_text(GATED_CALL)
    root = Path(__file__).resolve().parents[3]
    done = subprocess.run(
        [sys.executable, str(script), mode],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
        check=True,
    )
    return float(done.stdout.strip())


def test_r21_a_fork_waits_until_another_threads_server_call_has_ended(tmp_path: Path) -> None:
    """The pool process that replaces a killed one is forked while the parent's reporter thread
    tells the server (R21): with the hooks, the fork waits for that call (its serialization and
    its HTTP request, tasks/server_client.py), so the child inherits none of their locks taken."""
    assert fork_wait_s(tmp_path, "hold") > 0.3


def test_without_the_hooks_the_fork_happens_mid_call(tmp_path: Path) -> None:
    """The check above can fail: without the hooks the fork does not wait."""
    assert fork_wait_s(tmp_path, "plain") < 0.3
