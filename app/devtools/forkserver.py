"""Starting ``homefleet`` commands forked from one preloaded interpreter (a local fleet's
fast path; the test suite's fleets use it).

Exec'ing ``python -m app.cli worker`` costs about 3 CPU-seconds of imports before the worker
does anything (torch, diffusers, transformers, celery; measured on the 2-core CI machine, see
docs/benchmarks.md, "The test suite"), and a local fleet starts many. The standard library's
``multiprocessing`` *forkserver* imports them once (:data:`PRELOAD`) in a single-threaded
server process and forks each command from it, the way Celery's prefork
pool forks its pool processes from a parent that has already imported them.

A forked command runs the same code as an exec'd one: ``python -m app.cli`` (``runpy``), its own session (process
group), its own environment
(``os.environ`` replaced before the command starts) and its output appended to a log file.
What differs, and why a caller may prefer exec (:class:`app.devtools.localfleet.LocalFleet`'s
``forkserver=False``, the default):

- ``/proc/PID/cmdline`` and ``/proc/PID/environ`` (``ps``, ``psutil``) show the fork server's,
  not the command's;
- torch is imported before the command starts, so a worker bound to a device
  (``CUDA_VISIBLE_DEVICES``) logs that torch came first (CUDA still reads the
  variable at its first use, which comes later);
- the process is the fork server's child: only this module's :class:`ForkedProcess` knows its
  exit status.

Only plain data crosses to the fork server: the command's arguments, environment and log
paths, which ``multiprocessing`` serialises its own way between two local processes of this
program. Nothing of it is a Celery message; Celery still accepts JSON only.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import multiprocessing
import multiprocessing.util
import os
import runpy
import signal
import subprocess
import sys
import tempfile
from multiprocessing.context import ForkServerContext
from pathlib import Path

#: the modules the fork server imports once, by name, before it forks anything: what the
#: ``serve`` and ``worker`` commands import (named, not imported here: this module is the
#: server's, and only the commands it forks import the worker side). ``celery.bin.celery`` is
#: what ``Celery.worker_main`` imports at each worker start (its command line and plugins).
PRELOAD = (
    "tasks.preimport",
    "uvicorn",
    "app.cli.main",
    "app.api.server",
    "app.context",
    "tasks.worker",
    "celery.bin.celery",
)

_context: ForkServerContext | None = None


def _forkserver() -> ForkServerContext:
    """This process's fork server context (its server starts at the first :func:`start`)."""
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(list(PRELOAD))
    return _context


#: ``setns(2)``'s flag for a network namespace (linux/sched.h)
CLONE_NEWNET = 0x40000000
#: where ``ip netns add NAME`` keeps a named network namespace (ip-netns(8))
NETNS_DIR = Path("/var/run/netns")


def enter_netns(name: str) -> None:
    """Move this process into the named network namespace, as ``ip netns exec NAME`` does
    for the network (not its ``/etc/netns`` and ``/sys`` remounts). Only the calling thread
    moves: call it while the process has one thread (the forked command, before it starts any).

    Raises:
        OSError: no such namespace, or ``setns`` was refused (it needs CAP_SYS_ADMIN).
    """
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(NETNS_DIR / name, os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"setns into network namespace {name!r}: {os.strerror(errno)}")
    finally:
        os.close(fd)


def _run_command(
    args: list[str], env: dict[str, str], log_path: str, stderr_path: str | None, netns: str | None = None
) -> None:
    """In the forked process: enter network namespace ``netns`` when given, become a session
    leader, send stdout to ``log_path`` and stderr to ``stderr_path`` (or to ``log_path`` too;
    appended), take ``env`` as the whole environment and run ``homefleet ARGS``."""
    if netns is not None:
        enter_netns(netns)
    os.setsid()
    for target, path in ((1, log_path), (2, stderr_path or log_path)):
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(fd, target)
        os.close(fd)
    # line-buffered, as PYTHONUNBUFFERED would be; the process's own stdio, open until it exits
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    os.environ.clear()
    os.environ.update(env)
    sys.argv = ["homefleet", *args]
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        runpy.run_module("app.cli", run_name="__main__", alter_sys=True)  # as `python -m app.cli ARGS`
    finally:
        atexit._run_exitfuncs()  # multiprocessing ends its processes with os._exit, which skips them


class ForkedProcess:
    """A command forked by the fork server, with the part of :class:`subprocess.Popen`'s
    interface a local fleet uses (``pid``, ``returncode``, ``poll``, ``wait``, ``send_signal``,
    ``terminate``, ``kill``). ``returncode`` is the exit code, or ``-N`` after signal ``N``."""

    def __init__(self, process: multiprocessing.process.BaseProcess) -> None:
        self._process = process
        self.pid: int = process.pid or 0
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._process.exitcode
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the process to end, at most ``timeout`` seconds (None: for ever).

        Raises:
            subprocess.TimeoutExpired: it still runs after ``timeout`` seconds.
        """
        self._process.join(timeout)
        code = self.poll()
        if code is None:
            raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
        return code

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def start(
    args: list[str], env: dict[str, str], log_path: Path, stderr_path: Path | None = None, netns: str | None = None
) -> ForkedProcess:
    """Fork ``homefleet ARGS`` from the fork server, with environment ``env`` (all of it) and
    its output appended to ``log_path`` (its stderr to ``stderr_path`` when given), inside the
    named network namespace ``netns`` when given (:func:`enter_netns`). The first call of a
    process starts its fork server (the preload imports, ~3 CPU-seconds, once)."""
    # not daemonic: a command may start processes of its own (train-shapes' process pool)
    process = _forkserver().Process(
        target=_run_command,
        args=(list(args), dict(env), str(log_path), None if stderr_path is None else str(stderr_path), netns),
        name=f"homefleet {' '.join(args[:1])}",
        daemon=False,
    )
    process.start()
    forked = ForkedProcess(process)
    _started[:] = [each for each in _started if each.poll() is None]
    _started.append(forked)
    return forked


_started: list[ForkedProcess] = []  # those not seen ended yet


def _kill_left_running() -> None:
    """At this process's exit: SIGKILL the process group of every forked command still running
    (multiprocessing would otherwise wait for them)."""
    for forked in _started:
        if forked.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(forked.pid, signal.SIGKILL)


def run(args: list[str], env: dict[str, str], timeout_s: float | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``homefleet ARGS`` forked (:func:`start`) to its end, as :func:`subprocess.run` with
    ``capture_output=True, text=True`` would: its exit code, stdout and stderr (text).

    Raises:
        subprocess.TimeoutExpired: it ran past ``timeout_s`` seconds (it is killed, with its
            process group, first).
    """
    with tempfile.TemporaryDirectory(prefix="homefleet-run-") as folder:
        out, err = Path(folder) / "stdout", Path(folder) / "stderr"
        process = start(args, env, out, err)
        try:
            code = process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(5)
            raise subprocess.TimeoutExpired(
                ["homefleet", *args],
                timeout_s or 0.0,
                output=out.read_text(errors="replace"),
                stderr=err.read_text(errors="replace"),
            ) from None
        return subprocess.CompletedProcess(
            ["homefleet", *args], code, out.read_text(errors="replace"), err.read_text(errors="replace")
        )


# atexit runs its hooks last-registered first: this one, registered after multiprocessing's
# own (imported above), kills what is left before multiprocessing would wait for it
atexit.register(_kill_left_running)
