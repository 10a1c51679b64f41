"""Revocations from Flower or the celery CLI (C11), told to the server by the worker's main process.

Celery's revoke (``celery control revoke ID [--terminate]``, Flower's Revoke and Terminate) is
a broadcast that every live worker's main process keeps in memory (``celery.worker.state.revoked``);
Celery itself only skips the task when its message arrives, and with terminate kills the pool
process running it. Neither reaches the journal, so without this the job stayed ``queued`` (its
message still in the list, its reservation held) or ``running`` with nobody running it (its pool
process killed) until reconciliation called it lost or hung.

Everything here runs in the main process, which lives on when Celery kills the pool process:

- :meth:`Revocations.on_task_revoked` (Celery's ``task_revoked`` signal, sent where Celery
  terminated a running task or skipped a revoked one) notes the job, terminated or not;
- :meth:`Revocations.report` (a heartbeat duty, every ``heartbeat_interval_s``) sends the noted
  jobs and every id newly in the revoked set to ``POST /internal/v1/revocations``. The server ends
  those placed on this machine: a queued one ``cancelled`` (its message removed, so it never
  runs), a terminated one ``interrupted`` (reason ``terminated``), each with its reservation
  released. A report the server did not take is sent again at the next beat.

A terminate must end the pool process within seconds, whatever it is doing. Celery sends the
signal once (SIGTERM unless told otherwise) and forgets the task at once, so a second
terminate (``--signal SIGKILL``) finds nothing to kill. Two things make the first one enough:

- :func:`default_sigterm`, in the pool process at each task's start: billiard installs a
  Python handler for SIGTERM there (``billiard.common.reset_signals``: ``sys.exit`` from the main
  thread), which runs only between bytecodes, i.e. after a long native step (a UNet step on a
  big image) returns, and then unwinds through the job's ``finally`` blocks. SIGTERM's default
  action ends the process in the kernel, at once;
- :meth:`Revocations.on_task_revoked` SIGKILLs the pool process ``terminate_kill_after_s``
  seconds after the terminate if it still lives (a signal that was caught, ignored or blocked).

A revoke reaches only the workers alive when it is sent (Celery keeps it in memory only): for a
machine whose worker is offline, cancel through the API (``POST /v1/jobs/{id}/cancel``).
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable
from typing import Any

import httpx
import psutil
from celery.worker import state as worker_state

from app.core.errors import HomefleetError
from app.core.protocol import REVOCATIONS_PER_REPORT
from tasks.server_client import ServerClient

log = logging.getLogger("homefleet.worker")


def revoked_ids() -> set[str]:
    """The task ids this worker process's Celery holds as revoked (``celery.worker.state.revoked``),
    read from another thread than the one that changes it (tried again while it changes)."""
    for _ in range(10):
        try:
            return {str(task_id) for task_id in list(worker_state.revoked)}
        except RuntimeError:  # changed size while being read
            continue
    return set()


def default_sigterm() -> None:
    """In a pool process (at a task's start, after billiard installed its own handler): SIGTERM
    takes its default action, ending the process in the kernel at once, even inside a native
    step (module docstring)."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


class Revocations:
    """See the module docstring. ``job_task``: the name of the job task (others are ignored);
    ``kill_after_s``: seconds after a terminate before a pool process still alive is SIGKILLed;
    ``pool_process``: the live pool process running a job id, or None."""

    def __init__(
        self,
        server: ServerClient,
        machine: str,
        job_task: str,
        kill_after_s: float = 3.0,
        pool_process: Callable[[str], psutil.Process | None] = lambda _job_id: None,
    ) -> None:
        self.server = server
        self.pool_process = pool_process  # the live pool process running a job (Watchdog.pool_process)
        self.machine = machine
        self.job_task = job_task
        self.kill_after_s = kill_after_s
        self.reported: set[str] = set()  # revoked-set ids already told to the server
        self._lock = threading.Lock()
        self._noted: dict[str, tuple[bool, bool]] = {}  # job id -> (terminated, announced), from the signal

    def on_task_revoked(self, sender: Any = None, request: Any = None, terminated: bool = False, **_: Any) -> None:
        """Celery's ``task_revoked`` signal, in the main process: it sent the task's
        ``task-revoked`` event itself, and killed its pool process when ``terminated``."""
        if getattr(sender, "name", None) != self.job_task or request is None:
            return
        job_id = str(request.id)
        log.warning(
            "%s: job %s was revoked%s (Flower or celery control revoke)",
            self.machine,
            job_id,
            "; Celery terminated its pool process" if terminated else " before it ran",
        )
        with self._lock:
            self._noted[job_id] = (bool(terminated), True)
        process = self.pool_process(job_id) if terminated else None  # taken now: a reused pid is never killed
        if process is not None:
            timer = threading.Timer(self.kill_after_s, self.finish_off, (job_id, process))
            timer.daemon = True
            timer.start()

    def finish_off(self, job_id: str, process: psutil.Process) -> None:
        """SIGKILL ``process`` (the pool process Celery terminated under ``job_id``) if it still
        runs, as a child of this worker: the prefork pool starts a fresh one and the machine
        takes its next job. Runs on a timer thread, ``kill_after_s`` after the terminate."""
        try:
            if process.ppid() != psutil.Process().pid or process.status() == psutil.STATUS_ZOMBIE:
                return
            log.warning(
                "%s: job %s's pool process %d still runs %.1f s after its terminate; killing it (SIGKILL)",
                self.machine,
                job_id,
                process.pid,
                self.kill_after_s,
            )
            process.kill()
        except psutil.NoSuchProcess:
            return

    def report(self) -> None:
        """Send what was noted and the newly revoked ids to the server (a heartbeat duty). A
        batch the server did not take stays for the next beat."""
        with self._lock:
            noted = dict(self._noted)
        seen = revoked_ids()
        fresh = sorted(seen - self.reported - set(noted))
        batches: list[tuple[list[str], bool, bool]] = [
            ([job_id for job_id, flags in noted.items() if flags == key], *key) for key in sorted(set(noted.values()))
        ]
        batches += [
            (fresh[i : i + REVOCATIONS_PER_REPORT], False, False) for i in range(0, len(fresh), REVOCATIONS_PER_REPORT)
        ]
        for job_ids, terminated, announced in batches:
            for start in range(0, len(job_ids), REVOCATIONS_PER_REPORT):
                chunk = job_ids[start : start + REVOCATIONS_PER_REPORT]
                try:
                    ended = self.server.revocations(chunk, terminated=terminated, announced=announced)
                except (HomefleetError, httpx.HTTPError) as error:
                    log.warning(
                        "%s: revocations of %d jobs not reported yet (%s); again at the next beat",
                        self.machine,
                        len(chunk),
                        error,
                    )
                    return
                for job_id, state in ended.items():
                    log.warning("%s: job %s is %s in the journal (revoked)", self.machine, job_id, state)
                with self._lock:
                    for job_id in chunk:
                        # only what was sent: a job noted terminated while this report was on its
                        # way (first sent from the revoked set, as not terminated) goes next beat
                        if self._noted.get(job_id) == (terminated, announced):
                            del self._noted[job_id]
                self.reported.update(chunk)
        self.reported &= seen  # forget ids Celery forgot (its revoked set is bounded)
