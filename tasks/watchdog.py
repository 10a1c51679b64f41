"""The worker's end of the watchdog (R19) and of the remembered OOM (R21).

- The pool process records which job it runs (:func:`mark_running`, :func:`mark_working`,
  :func:`clear_running`: ``Keys.running``, JSON ``{job_id, pid[, working]}``).
- When reconciliation declares a running job hung it asks for a restart (``Keys.restart``);
  :meth:`Watchdog.obey_restart` kills the pool process when, and only when, that process runs
  that job (the prefork pool starts a fresh one), after asking it for its Python stacks, which
  it writes to the worker's log (:func:`dump_stacks_on_signal`).
- A pool process killed under its job is reported by the parent (:meth:`Watchdog.report_lost`):
  killed by SIGKILL, what the kernel's OOM killer sends, as an ``oom`` so the server remembers
  its size (R21), but only when the kernel's OOM-kill counters (:func:`oom_kill_counters`,
  read when the job starts and when its process dies) rose meanwhile; a SIGKILL they did not
  see (``kill -9``, a supervisor) fails the job as ``error`` and remembers nothing
  (:func:`sigkill_verdict`). Where no counter can be read (macOS), every SIGKILL is taken as
  an OOM, as before the counters were read.
"""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import signal
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import cast

import httpx
import psutil
import redis

from app.core.config import WorkerSettings
from app.core.errors import HomefleetError
from app.core.keys import Keys
from app.core.states import OOM
from tasks.server_client import ServerClient

log = logging.getLogger("homefleet.worker")

#: The signal on which a pool process writes every thread's Python stack to the worker's log
#: (``faulthandler``, :func:`dump_stacks_on_signal`); SIGUSR1 is billiard's soft time limit there.
STACKS_SIGNAL = signal.SIGUSR2
#: Seconds the watchdog waits between asking a hung pool process for its stacks and killing it:
#: the dump is written from a C signal handler, at once when the process runs at all.
STACKS_WAIT_S = 0.5
STDERR_FD = 2  # the worker's own stderr, its log (a pool process's sys.stderr is Celery's logging proxy)


def dump_stacks_on_signal() -> None:
    """In a pool process: on :data:`STACKS_SIGNAL`, write every thread's Python stack to the
    worker's own stderr (its log), from a C signal handler that needs no lock nor the GIL, so a
    process stuck on a lock or in native code still answers. The watchdog asks for it before it
    kills a hung job's process (R19); an operator can too (``kill -USR2 PID``)."""
    faulthandler.register(STACKS_SIGNAL, file=STDERR_FD, all_threads=True)


VMSTAT = Path("/proc/vmstat")
"""The kernel's event counters; its ``oom_kill`` line counts every process the OOM killer
killed on the host since boot, a cgroup's OOM killer's included (Linux 4.13+)."""
CGROUP_ROOT = Path("/sys/fs/cgroup")
"""Where cgroup v2 is mounted; a cgroup's ``memory.events`` line ``oom_kill`` counts the processes
of that cgroup (and of those below it) killed by any OOM killer."""


def _counter(path: Path, name: str) -> int | None:
    """The value of the line ``<name> <int>`` of ``path``, or None when the file cannot be read
    or has no such line."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        field, _, value = line.partition(" ")
        if field == name and value.strip().isdigit():
            return int(value)
    return None


def _own_cgroup_events() -> Path | None:
    """This process's cgroup v2 ``memory.events`` (from ``/proc/self/cgroup``'s ``0::`` line),
    or None where there is no cgroup v2 entry (macOS, cgroup v1)."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        if line.startswith("0::"):
            return CGROUP_ROOT / line[3:].strip().lstrip("/") / "memory.events"
    return None


def oom_kill_counters() -> dict[str, int]:
    """The kernel's OOM-kill counters this process can read now, by where each was read
    (``{path: count}``): ``/proc/vmstat``'s ``oom_kill`` and its cgroup v2 ``memory.events``
    ``oom_kill``, each when readable. Empty where none can be read (macOS, a Linux kernel
    before 4.13, a sandbox without /proc): a SIGKILL there cannot be told apart from an OOM."""
    counters: dict[str, int] = {}
    if (host := _counter(VMSTAT, "oom_kill")) is not None:
        counters[str(VMSTAT)] = host
    events = _own_cgroup_events()
    if events is not None and (cgroup := _counter(events, "oom_kill")) is not None:
        counters[str(events)] = cgroup
    return counters


def sigkill_verdict(before: Mapping[str, int], after: Mapping[str, int]) -> tuple[bool, str]:
    """Whether a pool process killed by SIGKILL was killed by the kernel's OOM killer (R21),
    from the OOM-kill counters (:func:`oom_kill_counters`) read when its job started
    (``before``) and after it died (``after``), and the reason said in the job's message.

    - a counter read at both ends that rose: an OOM kill happened meanwhile (on this host, or in
      the worker's cgroup), taken as this job's: True;
    - counters read at both ends, none risen: killed by SIGKILL, not by the OOM killer: False;
    - no counter read at both ends (macOS, or no reading at the job's start): it cannot be told,
      and a SIGKILL is taken as an OOM, as the kernel's OOM killer sends one: True.
    """
    common = sorted(set(before) & set(after))
    risen = [
        f"{source} oom_kill {before[source]} -> {after[source]}" for source in common if after[source] > before[source]
    ]
    if risen:
        return True, f"the kernel's OOM killer killed a process meanwhile ({'; '.join(risen)})"
    if common:
        same = "; ".join(f"{source} oom_kill {after[source]}" for source in common)
        return False, f"not by the kernel's OOM killer (its counter did not move: {same})"
    where = "when the job started" if not before else "now"
    return True, (
        f"no OOM-kill counter of the kernel could be read {where} (it is read on Linux only), "
        "so the SIGKILL is taken as the OOM killer's"
    )


# KEYS[1] running record, ARGV[1] job id, ARGV[2] this process's pid: remove only our own.
_CLEAR_OWN = """
local current = redis.call('GET', KEYS[1])
if not current then return 0 end
local record = cjson.decode(current)
if record.job_id == ARGV[1] and tostring(record.pid) == ARGV[2] then return redis.call('DEL', KEYS[1]) end
return 0
"""


def _running_record(job_id: str, oom_kills: Mapping[str, int], working: bool = False) -> str:
    record: dict[str, object] = {"job_id": job_id, "pid": os.getpid(), "oom_kills": dict(oom_kills)}
    if working:
        record["working"] = True
    return json.dumps(record, sort_keys=True)


def mark_running(client: redis.Redis, keyspace: Keys, machine: str, job_id: str) -> None:
    """Record that this pool process (its pid) now runs ``job_id``, with the kernel's OOM-kill
    counters as they stand (:func:`oom_kill_counters`), for the watchdog (R19, R21). Called in
    the pool process when a job's task starts."""
    client.set(keyspace.running(machine), _running_record(job_id, oom_kill_counters()))


def mark_working(client: redis.Redis, keyspace: Keys, machine: str, job_id: str) -> None:
    """Record that this pool process's job now holds the model cache (past the start-up
    preload, R16): from here a death of the process is the job's own (R21, :meth:`Watchdog.report_lost`).
    The OOM-kill counters read by :func:`mark_running` are kept; read afresh when that record is gone."""
    raw = client.get(keyspace.running(machine))
    running = json.loads(raw) if raw else {}
    mine = running.get("job_id") == job_id and running.get("pid") == os.getpid()
    counters = running.get("oom_kills") if mine and isinstance(running.get("oom_kills"), dict) else None
    client.set(
        keyspace.running(machine),
        _running_record(job_id, counters if counters is not None else oom_kill_counters(), working=True),
    )


def clear_running(client: redis.Redis, keyspace: Keys, machine: str, job_id: str) -> None:
    """Remove this process's record of ``job_id`` when its task ends, however it ends; a record
    written by another process (the pool's next one) is left alone. A process that dies under a
    job leaves its record behind, naming a pid that is no longer a pool process."""
    client.eval(_CLEAR_OWN, 1, keyspace.running(machine), job_id, str(os.getpid()))


class Watchdog:
    """Runs in the worker's parent process (the heartbeat's thread calls :meth:`obey_restart`;
    Celery's ``task_failure`` signal calls :meth:`report_lost`)."""

    def __init__(self, settings: WorkerSettings, client: redis.Redis, keyspace: Keys, boot_id: str) -> None:
        self.settings = settings
        self.redis = client
        self.keys = keyspace
        self.boot_id = boot_id
        self.killed: set[str] = set()  # jobs whose pool process the watchdog killed (not OOMs, R21)

    def running_job(self) -> str | None:
        """The job a pool process of this machine runs by its running record (:func:`mark_running`),
        or None.

        Raises:
            redis.RedisError: the record could not be read.
        """
        raw = self.redis.get(self.keys.running(self.settings.machine))
        job_id = json.loads(raw).get("job_id") if raw else None
        return str(job_id) if job_id else None

    def pool_process(self, job_id: str) -> psutil.Process | None:
        """The live pool process of this worker that runs ``job_id`` by its running record
        (:func:`mark_running`), or None (no record of that job, or its pid is no child of this
        process any more)."""
        try:
            raw = self.redis.get(self.keys.running(self.settings.machine))
        except redis.RedisError as error:
            log.warning("%s: job %s's pool process not found (%s)", self.settings.machine, job_id, error)
            return None
        running = json.loads(raw) if raw else {}
        if running.get("job_id") != job_id:
            return None
        pid = running.get("pid")
        if not isinstance(pid, int):
            return None
        return {child.pid: child for child in psutil.Process().children()}.get(pid)

    def obey_restart(self) -> None:
        """When the server marked this machine's running job ``hung`` (or ended it ``cancelled``
        after it outlasted ``cancel_grace_s``: its cancel request is still kept, and the log says
        so), kill the pool process that runs it; the prefork pool starts a fresh one. The job is
        not re-run: its message was acked at start, and the journal already says how it ended.

        The kill happens only when the running record (:func:`mark_running`) names that job and
        a live pool process of this worker, read again with that process stopped (SIGSTOP) just
        before the kill, so it cannot have moved on to the next job. A job can stay ``running`` in the journal with
        nobody running it (its process was killed, or its claim's answer was lost): killing
        the pool then would cut the next, innocent job. Such a request is dropped, with a log
        line."""
        machine = self.settings.machine
        job_id = cast("str | None", self.redis.getdel(self.keys.restart(machine)))  # decoded (create_redis)
        if job_id is None:
            return
        raw = self.redis.get(self.keys.running(machine))
        running = json.loads(raw) if raw else {}
        children = {child.pid: child for child in psutil.Process().children()}
        pid = running.get("pid")
        if running.get("job_id") != job_id or pid not in children:
            log.warning(
                "%s: job %s was declared hung, but no pool process runs it (running: %s in pid %s); "
                "restart request dropped, nothing killed",
                machine,
                job_id,
                running.get("job_id") or "none",
                pid if pid in children else "none",
            )
            return
        try:  # the server asks for the same kill for a cancel that a long native step outlasted
            cancelled = bool(self.redis.exists(self.keys.cancel(job_id)))
        except redis.RedisError:
            cancelled = False
        log.warning(
            "%s: job %s %s; killing its pool process %d (the pool starts a fresh one)",
            machine,
            job_id,
            "was cancelled and did not stop between steps within cancel_grace_s" if cancelled else "was declared hung",
            pid,
        )
        self.killed.add(job_id)
        still = self.redis.get(self.keys.running(machine))  # again, at the last moment: the job may just have ended
        if still is None or json.loads(still).get("job_id") != job_id:
            log.warning("%s: job %s ended before its pool process was killed; nothing killed", machine, job_id)
            self.killed.discard(job_id)
            return
        process = children[pid]
        try:
            process.send_signal(STACKS_SIGNAL)  # its stacks to this log, to see where it hung
            time.sleep(STACKS_WAIT_S)
            # Stopped (SIGSTOP), it cannot end this job and claim the next one between the last look
            # at its running record and the kill: in the stacks' wait a cancelled job that stopped at
            # last had its process take the next job, which the kill then cut (an operator's pass).
            process.suspend()
            try:
                still = self.redis.get(self.keys.running(machine))
                ours = still is not None and json.loads(still).get("job_id") == job_id
            except redis.RedisError as error:
                ours = False
                log.warning("%s: job %s's running record unread (%s); nothing killed", machine, job_id, error)
            if not ours:
                process.resume()
                log.warning("%s: job %s ended before its pool process was killed; nothing killed", machine, job_id)
                self.killed.discard(job_id)
                return
            process.kill()
        except psutil.NoSuchProcess:
            log.info("%s: pool process %d of job %s had already ended", machine, pid, job_id)

    def report_lost(self, job_id: str, error: BaseException) -> None:
        """R21: the pool process running ``job_id`` died before the job reported back (Celery's
        ``WorkerLostError``, raised in this, the parent process). Killed by SIGKILL, what the
        kernel's OOM killer sends, once the job held the model cache, the job is reported failed
        with reason ``oom``, so the server remembers its size, when the kernel's OOM-kill
        counters rose since the job started (:func:`sigkill_verdict`; on a host where none can
        be read, macOS, every such SIGKILL is taken as an OOM, as before the counters were
        read). A SIGKILL the counters did not see (``kill -9`` by a person or a supervisor) fails
        the job with reason ``error``, saying it was killed by SIGKILL and not by the kernel's
        OOM killer, and nothing is remembered: a false OOM would refuse that size there for good.

        Not reported: a process the watchdog killed (the server already marked that job
        ``interrupted``) and any other death (reconciliation marks the job ``interrupted``, R19).
        Sent from a short daemon thread, so Celery's main loop never waits on the server; a report
        the server refuses (the job had ended, or was never claimed) is logged and dropped."""
        machine = self.settings.machine
        if job_id in self.killed:
            self.killed.discard(job_id)
            return
        if f"signal {int(signal.SIGKILL)} " not in str(error):
            log.error("%s: job %s lost its pool process (%s); left to reconciliation", machine, job_id, error)
            return
        raw = self.redis.get(self.keys.running(machine))
        running = json.loads(raw) if raw else {}
        mine = running.get("job_id") == job_id
        if mine and not running.get("working"):
            # Killed while the job waited for the start-up preload: the preload's load, not this job.
            log.error(
                "%s: job %s lost its pool process to SIGKILL while the preload loaded committed models; "
                "reported as an error, no OOM remembered",
                machine,
                job_id,
            )
            reason = "error"
            message = f"its pool process was killed while the start-up preload loaded committed models: {error}"
        else:
            recorded = running.get("oom_kills") if mine else None
            before = (
                {str(source): count for source, count in recorded.items() if isinstance(count, int)}
                if isinstance(recorded, dict)
                else {}
            )
            oom, why = sigkill_verdict(before, oom_kill_counters())
            if oom:
                log.error(
                    "%s: job %s lost its pool process to SIGKILL (%s): %s; reporting it as oom (R21)",
                    machine,
                    job_id,
                    error,
                    why,
                )
                reason = OOM
                message = f"its pool process was killed by SIGKILL, taken as an out-of-memory kill: {why}: {error}"
            else:
                log.error(
                    "%s: job %s lost its pool process to SIGKILL (%s), %s; reported as an error, no OOM remembered",
                    machine,
                    job_id,
                    error,
                    why,
                )
                reason = "error"
                message = f"its pool process was killed by SIGKILL, {why}; no OOM remembered: {error}"

        def send() -> None:
            server = ServerClient.for_worker(self.settings, self.boot_id, patient=True)
            try:
                server.fail(job_id, reason, message)
            except (HomefleetError, httpx.HTTPError) as refusal:
                log.warning("%s: job %s not reported as %s: %s", machine, job_id, reason, refusal)
            finally:
                server.close()

        threading.Thread(target=send, name="homefleet-report-lost", daemon=True).start()
