"""``homefleet worker --machine NAME``: one Celery worker process for one device (R7, R8). A
device of a multi-device host (``--machine box:1``) is bound to its card first
(``tasks.devices.bind_device``: ``CUDA_VISIBLE_DEVICES=1``).

It consumes only ``machine.<name>``, with the prefork pool, concurrency 1 and prefetch
disabled, so it holds only the job it runs; the rest wait in the Redis list, in order
(docs/design.md, "Devices and queues").
"""

from __future__ import annotations

import logging
import signal
import uuid
from typing import Any

import httpx

from app.core import keys
from app.core.celery_app import RUN_JOB_TASK, SYNC_TASK, create_celery
from app.core.config import WorkerSettings
from app.core.connections import create_redis
from app.core.errors import ConfigError, HomefleetError, Unauthorized
from tasks import runtime
from tasks.control import refuse_rule_breaking_commands
from tasks.devices import bind_device
from tasks.heartbeat import Heartbeat, refused_at_start
from tasks.hooks import WorkerParent
from tasks.lease import EX_CONFIG, WorkerLease
from tasks.logfork import hold_locks_across_fork
from tasks.run_job import JobNotSucceeded, run_job
from tasks.server_client import ServerClient
from tasks.sync import sync

log = logging.getLogger("homefleet.worker")


def worker_argv(machine: str, loglevel: str) -> list[str]:
    """The celery worker command line for one machine (docs/design.md, "Devices and queues", "Settings")."""
    return [
        "worker",
        "-Q",
        keys.queue(machine),
        "-n",
        f"{machine}@%h",
        "-c",
        "1",
        "-P",
        "prefork",
        "--prefetch-multiplier=1",
        "--disable-prefetch",
        "--without-gossip",
        "--without-mingle",
        "-E",
        f"--loglevel={loglevel}",
    ]


def check_models_dir(settings: WorkerSettings) -> None:
    """Refuse to start on a models folder that does not exist or is not a folder: a mistyped
    ``--models-dir`` would otherwise be created empty, advertise no model (R4) and still take
    the machine's queued jobs, failing each with ``integrity``. An existing empty folder is
    fine (a machine whose models are synced to it later, R6); ``homefleet worker join`` creates
    its own.

    Raises:
        ConfigError: reason ``models_dir_missing``, naming the folder, ``--models-dir`` and
            ``HOMEFLEET_MODELS_DIR``.
    """
    folder = settings.models_dir
    if folder.is_dir():
        return
    fault = "is not a folder" if folder.exists() else "does not exist"
    raise ConfigError(
        f"the models folder {folder} {fault}: create it, or name this machine's model folder with "
        "--models-dir or HOMEFLEET_MODELS_DIR",
        reason="models_dir_missing",
    )


def check_token(settings: WorkerSettings) -> None:
    """Ask the server, before consuming anything, whether this worker's token is its machine's
    (the token's machine must be the one it names). A server that cannot be reached now is
    left to the heartbeat, which keeps trying.

    Raises:
        SystemExit: ``EX_CONFIG`` (78) when the server refuses the token.
    """
    server = ServerClient.for_worker(settings)
    try:
        server.manifest()
    except Unauthorized as refusal:
        log.critical("%s", refused_at_start(settings.machine, refusal))
        raise SystemExit(EX_CONFIG) from refusal
    except (HomefleetError, httpx.HTTPError) as error:
        log.warning(
            "%s: the server could not be asked at start (%s); the heartbeat keeps trying", settings.machine, error
        )
    finally:
        server.close()


def start_worker(settings: WorkerSettings, loglevel: str = "INFO") -> None:
    """Run the worker in the foreground until it is stopped (SIGTERM/SIGINT).

    Raises:
        ConfigError: the models folder does not exist (:func:`check_models_dir`); nothing started.
        SystemExit: ``EX_CONFIG`` (78) when the server refused the worker's token at start or
            while it ran (a claim or a beat's duty refused with 401: the machine's token was
            rotated; the worker stops consuming first, ``tasks/run_job.py``), or another worker
            of the same machine holds its lease, or took it while it ran (:class:`WorkerLease`).
    """
    check_models_dir(settings)  # before anything else: a folder that is not there is a mistyped setting
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
        raise SystemExit(EX_CONFIG if lease.lost or heartbeat.refused else 0)

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
    hold_locks_across_fork()  # a pool process forked mid-log-line or mid-call could hang (tasks/logfork.py)
    rt = runtime.WorkerRuntime(settings, boot_id)
    runtime.install(rt)
    celery = create_celery(settings, consumer=True)  # it pops messages: dead letters moved aside
    # throws: a job that failed is the task's expected FAILURE (Flower agrees), logged without a traceback
    celery.task(name=RUN_JOB_TASK, ignore_result=True, throws=(JobNotSucceeded,))(run_job)
    celery.task(name=SYNC_TASK, ignore_result=True)(sync)  # R6: same queue, so a sync never overtakes a job
    refuse_rule_breaking_commands(settings.machine, keys.queue(settings.machine))  # R7, R8: Flower, celery control
    parent = WorkerParent(rt, lease)
    parent.connect()  # its signal handlers, and the lease's loss (at once if lost while torch was imported)
    parent.heartbeat.start()
    if not wait_first_beat(parent.heartbeat, lease):
        parent.heartbeat.stop()
        if parent.heartbeat.refused:
            raise SystemExit(EX_CONFIG)
        return  # another worker took the lease meanwhile: start_worker exits EX_CONFIG
    celery.worker_main(worker_argv(settings.machine, loglevel))
    if rt.token_refused or parent.heartbeat.refused:  # a claim or a beat got 401 (a rotated token): stopped
        raise SystemExit(EX_CONFIG)
