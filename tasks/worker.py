"""``homefleet worker --machine NAME``: one Celery worker process for one device (R7, R8). A
device of a multi-device host (``--machine box:1``) is bound to its card first
(``tasks.devices.bind_device``: ``CUDA_VISIBLE_DEVICES=1``).

It consumes only ``machine.<name>``, with the prefork pool, concurrency 1 and prefetch
disabled, so it holds only the job it runs; the rest wait in the Redis list, in order
(docs/design.md, "Devices and queues").
"""

from __future__ import annotations

import logging
import os
import signal
import uuid
from typing import Any

import httpx
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
from celery.worker import state as worker_state

from app.core import digest, keys
from app.core.celery_app import RUN_JOB_TASK, SYNC_TASK, create_celery
from app.core.config import WorkerSettings
from app.core.connections import create_redis
from app.core.errors import HomefleetError, Unauthorized
from tasks import runtime
from tasks.devices import bind_device, detect_device, limit_threads
from tasks.heartbeat import Heartbeat
from tasks.lease import EX_CONFIG, WorkerLease
from tasks.preload import start_preload
from tasks.revocations import Revocations
from tasks.run_job import JobNotSucceeded, run_job
from tasks.server_client import ServerClient
from tasks.sync import sync
from tasks.verify import Verifier
from tasks.watchdog import Watchdog, clear_running, mark_running

log = logging.getLogger("homefleet.worker")

DELIVERED_TTL_S = 24 * 3600  # how long a job's "delivered" mark is kept (Keys.delivered)


def worker_argv(machine: str, loglevel: str) -> list[str]:
    """The celery worker command line for one machine (docs/design.md, "Devices and queues", "Settings")."""
    return [
        "worker", "-Q", keys.queue(machine), "-n", f"{machine}@%h", "-c", "1", "-P", "prefork",
        "--prefetch-multiplier=1", "--disable-prefetch", "--without-gossip", "--without-mingle", "-E",
        f"--loglevel={loglevel}",
    ]


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
        log.critical(
            "%s: the server refused this worker's token (%s); set HOMEFLEET_WORKER_TOKEN "
            "(or HOMEFLEET_WORKER_TOKEN_FILE) to the token of machine %r in the server's fleet config; stopping",
            settings.machine,
            refusal.message,
            settings.machine,
        )
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
    bind_device(settings.machine)  # before torch is imported: box:1 drives card 1 only
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


def wait_first_beat(heartbeat: Heartbeat, lease: WorkerLease) -> bool:
    """Wait, before Celery consumes anything, until the start-up verification is done and the
    first heartbeat is written (``Heartbeat.wait_first_beat``): a job is claimed only by a boot
    that reconciliation sees alive (R19), and no message is taken while the server cannot be
    reached to claim it. SIGTERM meanwhile stops the worker at once (exit 0, or ``EX_CONFIG``
    when it is the lease's loss); SIGINT raises ``KeyboardInterrupt``. True once beating.

    Once beating, that SIGTERM handler stays until Celery installs its own (its warm shutdown)
    while it starts: a lease lost in between (``on_lease_lost`` signals this process) still
    exits ``EX_CONFIG``, not 143 from the default handler (seen on a slow host, where Celery's
    start took seconds)."""
    def stop(_signum: int, _frame: Any) -> None:
        raise SystemExit(EX_CONFIG if lease.lost else 0)

    previous = signal.signal(signal.SIGTERM, stop)
    beating = False
    try:
        beating = heartbeat.wait_first_beat()
        return beating
    except BaseException:
        heartbeat.stop()
        raise
    finally:
        if not beating:
            signal.signal(signal.SIGTERM, previous)


def _run(settings: WorkerSettings, loglevel: str, boot_id: str, lease: WorkerLease) -> None:
    from tasks.pipelines import go_offline, quiet

    go_offline()  # before diffusers/transformers read their settings
    quiet()  # imports diffusers/torch once in the parent, so forked children start warm
    rt = runtime.WorkerRuntime(settings, boot_id)
    runtime.install(rt)
    celery = create_celery(settings, consumer=True)  # it pops messages: dead letters moved aside
    # throws: a job that failed is the task's expected FAILURE (Flower agrees), logged without a traceback
    celery.task(name=RUN_JOB_TASK, ignore_result=True, throws=(JobNotSucceeded,))(run_job)
    celery.task(name=SYNC_TASK, ignore_result=True)(sync)  # R6: same queue, so a sync never overtakes a job
    client = create_redis(settings)
    verifier = Verifier(settings, client)
    watchdog = Watchdog(settings, client, boot_id)
    # No waiting out an unreachable server here: a report not taken is sent again at the next beat.
    reporter = ServerClient(settings.server_url, settings.worker_token, settings.http_timeout_s, boot_id,
                            machine=settings.machine)
    revocations = Revocations(reporter, settings.machine, RUN_JOB_TASK)  # C11
    heartbeat = Heartbeat(settings, client, boot_id=boot_id, device=detect_device(), verifier=verifier,
                          duties=[watchdog.obey_restart, verifier.follow_registry, verifier.check_unchanged,
                                  revocations.report])

    def on_lease_lost() -> None:
        # Another worker runs this machine now: stop writing its heartbeat and verified set at
        # once, and stop as on SIGTERM (Celery's warm shutdown: the running job ends first).
        heartbeat.abandon()
        os.kill(os.getpid(), signal.SIGTERM)

    lease.on_lost(on_lease_lost)  # at once if it was lost while torch was imported

    def on_ready(sender: Any = None, **_: Any) -> None:
        # The node name Flower knows this worker by, for the events the server sends of its jobs.
        if node := getattr(sender, "hostname", None):
            client.set(keys.Keys(settings.key_prefix).node(settings.machine), str(node))

    def on_shutdown(**_: Any) -> None:
        heartbeat.stop()
        reporter.close()

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
            watchdog.report_lost(str(args[0]), exception)

    # In this, the parent process, before the message is acked: it reached this worker. A job
    # whose message is gone unclaimed is then `lost` (this worker stopped first), not `purged`
    # (app/jobs/reconcile.py).
    def on_received(request: Any = None, **_: Any) -> None:
        if getattr(request, "name", None) == RUN_JOB_TASK:
            try:
                client.set(heartbeat.keys.delivered(str(request.id)), settings.machine, ex=DELIVERED_TTL_S)
            except redis.RedisError as error:
                log.warning("%s: job %s's delivery not recorded: %s", settings.machine, request.id, error)

    task_received.connect(on_received, weak=False)
    worker_ready.connect(on_ready, weak=False)
    worker_process_init.connect(lambda **_: digest.single_threaded(), weak=False)  # fork-safe hashing
    worker_process_init.connect(lambda **_: limit_threads(settings.torch_threads), weak=False)  # a share of the cores
    worker_process_init.connect(lambda **_: record_fresh_pool(rt), weak=False)  # nothing warm in a new one
    worker_process_init.connect(lambda **_: start_preload(rt), weak=False)  # committed models warm (R16)
    worker_shutdown.connect(on_shutdown, weak=False)
    task_prerun.connect(on_task_start, weak=False)
    task_postrun.connect(on_task_end, weak=False)
    task_failure.connect(on_task_failure, weak=False)
    task_revoked.connect(revocations.on_task_revoked, weak=False)
    settings.models_dir.mkdir(parents=True, exist_ok=True)
    heartbeat.start()
    if not wait_first_beat(heartbeat, lease):
        heartbeat.stop()
        if heartbeat.refused:
            raise SystemExit(EX_CONFIG)
        return  # another worker took the lease meanwhile: start_worker exits EX_CONFIG
    celery.worker_main(worker_argv(settings.machine, loglevel))
