"""``homefleet worker --machine NAME``: one Celery worker process for one device (R7, R8).

It consumes only ``machine.<name>``, with the prefork pool, concurrency 1 and prefetch
disabled, so it holds only the job it runs; the rest wait in the Redis list, in order
(shared/notes/celery-redis.md).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import httpx
import redis
from celery.exceptions import WorkerLostError
from celery.signals import task_failure, task_postrun, task_prerun, worker_process_init, worker_ready, worker_shutdown
from celery.worker import state as worker_state

from app.core import digest, keys
from app.core.celery_app import RUN_JOB_TASK, SYNC_TASK, create_celery
from app.core.config import WorkerSettings
from app.core.connections import create_redis
from app.core.errors import HomefleetError, Unauthorized
from app.core.keys import Keys
from tasks import runtime
from tasks.heartbeat import Heartbeat, clear_running, mark_running
from tasks.preload import start_preload
from tasks.run_job import run_job
from tasks.server_client import ServerClient
from tasks.sync import sync


log = logging.getLogger("homefleet.worker")


def worker_argv(machine: str, loglevel: str) -> list[str]:
    """The celery worker command line for one machine (shared/notes/celery-redis.md, "Settings")."""
    return [
        "worker", "-Q", keys.queue(machine), "-n", f"{machine}@%h", "-c", "1", "-P", "prefork",
        "--prefetch-multiplier=1", "--disable-prefetch", "--without-gossip", "--without-mingle", "-E",
        f"--loglevel={loglevel}",
    ]


def detect_device() -> str:
    import torch

    if torch.cuda.is_available():
        return "cuda"
    if torch.backends.mps.is_available():
        return "mps"
    return "cpu"


EX_CONFIG = 78  # sysexits.h: a configuration error (the server refused the token; a second worker)


# KEYS[1] the lease, ARGV[1] our boot id, ARGV[2] TTL (ms). Renew our own (1); take it back when
# it is gone (2: Redis restarted or lost its data, or a stall outlasted the TTL); 0: another
# worker holds it.
_RENEW = """
local holder = redis.call('GET', KEYS[1])
if holder == ARGV[1] then redis.call('PEXPIRE', KEYS[1], ARGV[2]) return 1 end
if not holder then redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2]) return 2 end
return 0
"""
_RELEASE = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0"


class WorkerLease:
    """One worker per machine, from the moment a worker starts (before it consumes anything or
    verifies its files): the Redis key ``machine:<name>:worker`` holds its boot id with a TTL
    of ``heartbeat_ttl_s``, renewed by a thread every ``heartbeat_interval_s`` and deleted at a
    clean stop. A worker that died leaves a lease that lapses within the TTL; a new worker
    waits that long for it, then takes it. A lease that vanished under a running worker (Redis
    restarted or lost its data, or a stall outlasted the TTL) is taken back at the next
    renewal; one that another worker took meanwhile is lost for good: :attr:`lost` is set and
    ``on_lost`` is called (the worker stops: a warm shutdown, then exit 78).

    Raises (:meth:`acquire`):
        SystemExit: ``EX_CONFIG`` (78) when another worker of this machine holds the lease:
            it would take that machine's jobs and replace its verified models with its own
            folder's.
    """

    def __init__(self, settings: WorkerSettings, client: redis.Redis, boot_id: str,
                 on_lost: Callable[[], None] | None = None) -> None:
        self.settings, self.redis, self.boot_id = settings, client, boot_id
        self.key = Keys(settings.key_prefix).worker_lease(settings.machine)
        self.ttl_ms = int(settings.heartbeat_ttl_s * 1000)
        self._on_lost = on_lost
        self.lost = False  # another worker of this machine took the lease: this one must stop
        self._told = False  # on_lost was called (once)
        self._guard = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._renew, name="homefleet-lease", daemon=True)

    def acquire(self, poll_s: float = 0.2) -> None:
        deadline = time.monotonic() + self.settings.heartbeat_ttl_s + self.settings.heartbeat_interval_s
        while not self.redis.set(self.key, self.boot_id, nx=True, px=self.ttl_ms):
            if time.monotonic() >= deadline:
                log.critical("%s: another worker of this machine is running (boot %s), or still finishing its job "
                             "after a stop; one worker per machine: stop it first (or start this one with its own "
                             "--machine); stopping", self.settings.machine, self.redis.get(self.key))
                raise SystemExit(EX_CONFIG)
            time.sleep(poll_s)
        self._thread.start()

    def _renew(self) -> None:
        while not self._stop.wait(self.settings.heartbeat_interval_s):
            try:
                renewed = self.redis.eval(_RENEW, 1, self.key, self.boot_id, self.ttl_ms)
            except redis.RedisError as error:
                log.warning("%s: worker lease not renewed: %s", self.settings.machine, error)
                continue
            if renewed == 2:
                log.warning("%s: the worker lease was gone (Redis restarted or lost its data, or a stall outlasted "
                            "its %.0f s TTL); taken back", self.settings.machine, self.settings.heartbeat_ttl_s)
            elif renewed == 0:
                log.critical("%s: another worker of this machine took the worker lease (boot %s) while this one "
                             "could not renew it; one worker per machine: this one stops", self.settings.machine,
                             self.redis.get(self.key))
                with self._guard:
                    self.lost = True
                self._tell()
                return

    def on_lost(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` (once) when the lease is lost; at once if it already was."""
        with self._guard:
            self._on_lost = callback
        self._tell()

    def _tell(self) -> None:
        with self._guard:
            callback = self._on_lost if self.lost and not self._told else None
            self._told = self._told or callback is not None
        if callback is not None:
            callback()

    def release(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=15)  # a renewal under way would take a released lease back
        try:
            self.redis.eval(_RELEASE, 1, self.key, self.boot_id)
        except redis.RedisError as error:
            log.warning("%s: worker lease not released (it lapses in %.0f s): %s", self.settings.machine,
                        self.settings.heartbeat_ttl_s, error)


def check_token(settings: WorkerSettings) -> None:
    """Ask the server, before consuming anything, whether this worker's token is its machine's
    (the token's machine must be the one it names). A server that cannot be reached now is
    left to the heartbeat, which keeps trying.

    Raises:
        SystemExit: ``EX_CONFIG`` (78) when the server refuses the token.
    """
    server = ServerClient(settings.server_url, settings.worker_token, settings.http_timeout_s, machine=settings.machine)
    try:
        server.manifest()
    except Unauthorized as refusal:
        log.critical("%s: the server refused this worker's token (%s); set HOMEFLEET_WORKER_TOKEN (or --token) to "
                     "the token of machine %r in the server's fleet config; stopping", settings.machine,
                     refusal.message, settings.machine)
        raise SystemExit(EX_CONFIG) from refusal
    except (HomefleetError, httpx.HTTPError) as error:
        log.warning("%s: the server could not be asked at start (%s); the heartbeat keeps trying", settings.machine,
                    error)
    finally:
        server.close()


def start_worker(settings: WorkerSettings, loglevel: str = "INFO") -> None:
    """Run the worker in the foreground until it is stopped (SIGTERM/SIGINT).

    Raises:
        SystemExit: ``EX_CONFIG`` (78) when the server refused the worker's token at start, or
            another worker of the same machine holds its lease, or took it while it ran
            (:class:`WorkerLease`).
    """
    boot_id = uuid.uuid4().hex
    check_token(settings)  # before anything is consumed: a wrong token would lose the jobs it takes
    lease = WorkerLease(settings, create_redis(settings), boot_id)
    lease.acquire()
    try:
        _run(settings, loglevel, boot_id, lease)
    finally:
        lease.release()
    if lease.lost:
        raise SystemExit(EX_CONFIG)


def record_fresh_pool(rt: runtime.WorkerRuntime) -> None:
    """In a new pool process (at start, or replacing one that was killed: an OOM, the
    watchdog): publish its warm models, none, so the heartbeat stops advertising the dead
    process's (R12 prices cold loads by them)."""
    try:
        rt.record_warm()
    except redis.RedisError as error:
        log.warning("%s: the new pool process could not publish its warm models: %s", rt.settings.machine, error)


def _run(settings: WorkerSettings, loglevel: str, boot_id: str, lease: WorkerLease) -> None:
    from tasks.pipelines import go_offline, quiet

    go_offline()  # before diffusers/transformers read their settings
    quiet()  # imports diffusers/torch once in the parent, so forked children start warm
    rt = runtime.WorkerRuntime(settings, boot_id)
    runtime.install(rt)
    celery = create_celery(settings)
    celery.task(name=RUN_JOB_TASK, ignore_result=True)(run_job)
    celery.task(name=SYNC_TASK, ignore_result=True)(sync)  # R6: same queue, so a sync never overtakes a job
    heartbeat = Heartbeat(settings, create_redis(settings), boot_id=boot_id, device=detect_device())

    def on_lease_lost() -> None:
        # Another worker runs this machine now: stop writing its heartbeat and verified set at
        # once, and stop as on SIGTERM (Celery's warm shutdown: the running job ends first).
        heartbeat.abandon()
        os.kill(os.getpid(), signal.SIGTERM)

    lease.on_lost(on_lease_lost)  # at once if it was lost while torch was imported

    def on_ready(**_: Any) -> None:
        heartbeat.start()

    def on_shutdown(**_: Any) -> None:
        heartbeat.stop()

    # In the pool process: which job it runs, for the watchdog (R19).
    def on_task_start(task: Any = None, args: Any = (), **_: Any) -> None:
        if getattr(task, "name", None) == RUN_JOB_TASK:
            mark_running(rt.redis, rt.keys, settings.machine, str(args[0]))

    def on_task_end(task: Any = None, args: Any = (), **_: Any) -> None:
        if getattr(task, "name", None) == RUN_JOB_TASK:
            clear_running(rt.redis, rt.keys, settings.machine, str(args[0]))

    # In this, the parent process: a pool process died under a job (R21), not while stopping.
    def on_task_failure(sender: Any = None, args: Any = (), exception: BaseException | None = None,
                        **_: Any) -> None:
        # Celery sets these to an exit code when it stops (0 for a warm shutdown): "is not None".
        stopping = any(flag is not None and flag is not False
                       for flag in (worker_state.should_stop, worker_state.should_terminate))
        if getattr(sender, "name", None) == RUN_JOB_TASK and isinstance(exception, WorkerLostError) and not stopping:
            heartbeat.report_lost(str(args[0]), exception)

    worker_ready.connect(on_ready, weak=False)
    worker_process_init.connect(lambda **_: digest.single_threaded(), weak=False)  # fork-safe hashing
    worker_process_init.connect(lambda **_: record_fresh_pool(rt), weak=False)  # nothing warm in a new one
    worker_process_init.connect(lambda **_: start_preload(rt), weak=False)  # committed models warm (R16)
    worker_shutdown.connect(on_shutdown, weak=False)
    task_prerun.connect(on_task_start, weak=False)
    task_postrun.connect(on_task_end, weak=False)
    task_failure.connect(on_task_failure, weak=False)
    settings.models_dir.mkdir(parents=True, exist_ok=True)
    celery.worker_main(worker_argv(settings.machine, loglevel))
    if heartbeat.refused:
        raise SystemExit(EX_CONFIG)
