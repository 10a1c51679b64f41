"""The worker's parent process, assembled once per worker start (the composition root of
``homefleet worker``, ``tasks/worker.py``): its Redis client, verifier, watchdog, revocation
reporter and heartbeat, built from the process's :class:`tasks.runtime.WorkerRuntime`, and its
Celery signal handlers, named methods connected from one table (:data:`SIGNALS`) in one loop.

Handlers run in the parent (``worker_ready``, ``worker_shutdown``, ``task_received``,
``task_failure``, ``task_revoked``) or in a pool process (``worker_process_init``,
``task_prerun``, ``task_postrun``), as :data:`SIGNALS` says beside each.
"""

from __future__ import annotations

import gc
import logging
import os
import signal
from typing import Any

import redis
from celery.exceptions import WorkerLostError
from celery.signals import (
    task_failure,
    task_postrun,
    task_prerun,
    task_received,
    task_revoked,
    worker_process_init,
    worker_ready,
    worker_shutdown,
)
from celery.utils.dispatch import Signal
from celery.worker import state as worker_state

from app.core import digest
from app.core.celery_app import RUN_JOB_TASK
from app.core.connections import create_redis
from tasks.devices import detect_device, limit_threads
from tasks.heartbeat import Heartbeat
from tasks.lease import WorkerLease
from tasks.preload import start_preload
from tasks.retirements import start_following
from tasks.revocations import Revocations, default_sigterm
from tasks.runtime import WorkerRuntime
from tasks.server_client import ServerClient
from tasks.spool import SpoolRecovery
from tasks.verify import Verifier
from tasks.watchdog import Watchdog, clear_running, dump_stacks_on_signal, mark_running

log = logging.getLogger("homefleet.worker")

DELIVERED_TTL_S = 24 * 3600  # how long a job's "delivered" mark is kept (Keys.delivered)


class WorkerParent:
    """The parts of one worker start's parent process, each built once. Forked pool processes
    inherit the object; what they use of it goes through ``rt`` (created per process there)."""

    def __init__(self, rt: WorkerRuntime, lease: WorkerLease) -> None:
        settings = self.settings = rt.settings
        self.rt, self.lease, self.keys = rt, lease, rt.keys
        self.redis = create_redis(settings)
        self.verifier = Verifier(settings, self.redis, self.keys)
        self.watchdog = Watchdog(settings, self.redis, self.keys, rt.boot_id)
        # No waiting out an unreachable server here: a report not taken is sent again at the next beat.
        self.reporter = ServerClient.for_worker(settings, rt.boot_id)
        self.revocations = Revocations(
            self.reporter, settings.machine, RUN_JOB_TASK, settings.terminate_kill_after_s, self.watchdog.pool_process
        )  # C11
        self.heartbeat = Heartbeat(
            settings,
            self.redis,
            self.keys,
            boot_id=rt.boot_id,
            device=detect_device(),
            verifier=self.verifier,
            duties=[
                self.watchdog.obey_restart,
                self.verifier.follow_registry,
                self.verifier.check_unchanged,
                self.revocations.report,
                SpoolRecovery(settings, self.reporter, self.watchdog.running_job),
            ],
            on_refused=self.on_token_refused,
        )

    def connect(self) -> None:
        """Connect every handler of :data:`SIGNALS` (strongly: they live as long as the
        worker), and have the lease's loss stop the worker (at once if it was lost already)."""
        for sig, name in SIGNALS:
            sig.connect(getattr(self, name), weak=False)
        self.lease.on_lost(self.on_lease_lost)

    def on_lease_lost(self) -> None:
        """Another worker runs this machine now: stop writing its heartbeat and verified set at
        once, and stop as on SIGTERM (Celery's warm shutdown: the running job ends first)."""
        self.heartbeat.abandon()
        os.kill(os.getpid(), signal.SIGTERM)

    def on_token_refused(self) -> None:
        """The server refused this worker's token after it started (a beat's duty got 401: the
        machine's token was rotated): stop as on SIGTERM (Celery's warm shutdown: the running job
        ends first), then exit ``EX_CONFIG`` (78, tasks/worker.py). The machine goes offline at
        once: the heartbeat is deleted at the shutdown (``on_shutdown``)."""
        self.rt.refuse_token()
        os.kill(os.getpid(), signal.SIGTERM)

    def on_ready(self, sender: Any = None, **_: Any) -> None:
        """The node name Flower knows this worker by, for the events the server sends of its jobs."""
        if node := getattr(sender, "hostname", None):
            self.redis.set(self.keys.node(self.settings.machine), str(node))

    def on_shutdown(self, **_: Any) -> None:
        self.heartbeat.stop()
        self.reporter.close()

    def on_received(self, request: Any = None, **_: Any) -> None:
        """Before the message is acked: it reached this worker. A job whose message is gone
        unclaimed is then `lost` (this worker stopped first), not `purged` (app/jobs/reconcile.py)."""
        if getattr(request, "name", None) == RUN_JOB_TASK:
            try:
                self.redis.set(self.keys.delivered(str(request.id)), self.settings.machine, ex=DELIVERED_TTL_S)
            except redis.RedisError as error:
                log.warning("%s: job %s's delivery not recorded: %s", self.settings.machine, request.id, error)

    def on_task_failure(
        self, sender: Any = None, args: Any = (), exception: BaseException | None = None, **_: Any
    ) -> None:
        """A pool process died under a job (R21), not while stopping: the watchdog reports it."""
        # Celery sets these to an exit code when it stops (0 for a warm shutdown): "is not None".
        stopping = any(
            flag is not None and flag is not False for flag in (worker_state.should_stop, worker_state.should_terminate)
        )
        if getattr(sender, "name", None) == RUN_JOB_TASK and isinstance(exception, WorkerLostError) and not stopping:
            self.watchdog.report_lost(str(args[0]), exception)

    def on_task_revoked(self, **kwargs: Any) -> None:
        self.revocations.on_task_revoked(**kwargs)

    # In a pool process.

    def on_task_start(self, task: Any = None, args: Any = (), **_: Any) -> None:
        """Which job this pool process runs, for the watchdog (R19)."""
        if getattr(task, "name", None) == RUN_JOB_TASK:
            default_sigterm()  # a terminate ends this process at once, even in a native step (C11)
            mark_running(self.rt.redis, self.rt.keys, self.settings.machine, str(args[0]))

    def on_task_end(self, task: Any = None, args: Any = (), **_: Any) -> None:
        if getattr(task, "name", None) == RUN_JOB_TASK:
            clear_running(self.rt.redis, self.rt.keys, self.settings.machine, str(args[0]))

    def single_threaded_hashing(self, **_: Any) -> None:
        digest.single_threaded()  # fork-safe hashing

    def freeze_imports(self, **_: Any) -> None:
        """What the pool process inherited (torch, diffusers, transformers, celery: ~550,000
        objects) leaves the cyclic collector's scans for good: a collection (automatic, or the
        residency cache's after each eviction, R15) then scans what jobs made, ~0.3 CPU-s less
        each on the 2-core CI machine (docs/benchmarks.md, "The test suite"). Here, after the
        fork, not in the parent before it: frozen there, Celery's collection before each fork
        became instant, the fork followed a killed pool process's report at once, and loaded
        runs saw the new pool process hang: at its first log line (a log stream's lock inherited
        held mid-write; the handlers are now held across each fork, tasks/logfork.py) and, with
        that fixed, once after its claim (docs/benchmarks.md, "The test suite")."""
        gc.freeze()

    def stacks_on_signal(self, **_: Any) -> None:
        dump_stacks_on_signal()  # where a hung job's process is stuck, in the log (R19)

    def limit_threads(self, **_: Any) -> None:
        limit_threads(self.settings.torch_threads)  # a share of the cores

    def record_fresh_pool(self, **_: Any) -> None:
        """Publish the new pool process's warm models, none (at start, or replacing one that was
        killed: an OOM, the watchdog), so the heartbeat stops advertising the dead process's
        (R12 prices cold loads by them)."""
        try:
            self.rt.record_warm()
        except redis.RedisError as error:
            log.warning("%s: the new pool process could not publish its warm models: %s", self.settings.machine, error)

    def start_preload(self, **_: Any) -> None:
        start_preload(self.rt)  # committed models warm (R16)

    def follow_retirements(self, **_: Any) -> None:
        start_following(self.rt)  # a retired model leaves memory at once (R1)


# (signal, handler's name), connected in this order by WorkerParent.connect.
SIGNALS: tuple[tuple[Signal, str], ...] = (
    (task_received, "on_received"),  # parent
    (worker_ready, "on_ready"),  # parent
    (worker_process_init, "freeze_imports"),  # pool process, in this order
    (worker_process_init, "single_threaded_hashing"),
    (worker_process_init, "stacks_on_signal"),
    (worker_process_init, "limit_threads"),
    (worker_process_init, "record_fresh_pool"),
    (worker_process_init, "start_preload"),
    (worker_process_init, "follow_retirements"),
    (worker_shutdown, "on_shutdown"),  # parent
    (task_prerun, "on_task_start"),  # pool process
    (task_postrun, "on_task_end"),  # pool process
    (task_failure, "on_task_failure"),  # parent
    (task_revoked, "on_task_revoked"),  # parent
)
