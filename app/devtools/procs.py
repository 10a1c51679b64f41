"""Stopping child processes we started, with their whole process group."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from typing import Protocol


class ChildProcess(Protocol):
    """What a local fleet needs of a process it started: :class:`subprocess.Popen`, or
    :class:`app.devtools.forkserver.ForkedProcess` (one forked by the fork server)."""

    pid: int
    returncode: int | None

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def send_signal(self, sig: int) -> None: ...


def stop_process_group(process: ChildProcess, sig: int = signal.SIGTERM, timeout_s: float = 15.0) -> int | None:
    """Send ``sig`` to the process group of ``process`` (started with ``start_new_session``),
    wait up to ``timeout_s`` seconds, then SIGKILL the group. Returns the exit code."""
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, sig)
        try:
            process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(5)
    # children left behind in the group (e.g. a prefork pool child) go too
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    return process.returncode
