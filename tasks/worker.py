"""``homefleet worker --machine NAME``: one Celery worker process for one device (R7, R8).

It consumes only ``machine.<name>``, with the prefork pool, concurrency 1 and prefetch
disabled, so it holds only the job it runs; the rest wait in the Redis list, in order
(shared/notes/celery-redis.md).
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from typing import Any

import redis
from celery.exceptions import WorkerLostError
from celery.signals import task_failure, task_postrun, task_prerun, worker_process_init, worker_ready, worker_shutdown
from celery.worker import state as worker_state

from app import digest, keys
from app.celery_app import RUN_JOB_TASK, SYNC_TASK, create_celery
from app.config import WorkerSettings
from app.connections import create_redis
from app.keys import Keys
from tasks import runtime
from tasks.heartbeat import Heartbeat, clear_running, mark_running
from tasks.preload import start_preload
from tasks.run_job import run_job
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


def refuse_a_second_worker(settings: WorkerSettings, client: redis.Redis, poll_s: float = 0.5) -> None:
    """One worker per machine: before consuming, watch the machine's heartbeat for up to
    ``heartbeat_ttl_s + heartbeat_interval_s`` seconds. Another worker refreshing it is alive:
    this one must not start (it would take that machine's jobs and replace its verified
    models with its own folder's). A heartbeat left by a worker that died lapses meanwhile
    (or is never refreshed), and this worker starts.

    Raises:
        SystemExit: ``EX_CONFIG`` (78) when another worker of this machine is alive.
    """
    key = Keys(settings.key_prefix).heartbeat(settings.machine)
    raw = client.get(key)
    if raw is None:
        return
    first = json.loads(raw)
    deadline = time.monotonic() + settings.heartbeat_ttl_s + settings.heartbeat_interval_s
    while time.monotonic() < deadline:
        time.sleep(poll_s)
        raw = client.get(key)
        if raw is None:
            return
        beat = json.loads(raw)
        if beat.get("at") != first.get("at"):
            log.critical("%s: another worker of this machine is alive (pid %s on %s, boot %s); one worker per "
                         "machine: stop it first, or start this one with its own --machine; stopping",
                         settings.machine, beat.get("pid"), beat.get("host"), beat.get("boot_id"))
            raise SystemExit(EX_CONFIG)


def start_worker(settings: WorkerSettings, loglevel: str = "INFO") -> None:
    """Run the worker in the foreground until it is stopped (SIGTERM/SIGINT).

    Raises:
        SystemExit: ``EX_CONFIG`` (78) when the server refused the worker's token at start, or
            another worker of the same machine is alive (:func:`refuse_a_second_worker`).
    """
    from tasks.pipelines import go_offline, quiet

    refuse_a_second_worker(settings, create_redis(settings))
    go_offline()  # before diffusers/transformers read their settings
    quiet()  # imports diffusers/torch once in the parent, so forked children start warm
    boot_id = uuid.uuid4().hex
    rt = runtime.WorkerRuntime(settings, boot_id)
    runtime.install(rt)
    celery = create_celery(settings)
    celery.task(name=RUN_JOB_TASK, ignore_result=True)(run_job)
    celery.task(name=SYNC_TASK, ignore_result=True)(sync)  # R6: same queue, so a sync never overtakes a job
    heartbeat = Heartbeat(settings, create_redis(settings), boot_id=boot_id, device=detect_device())

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
    worker_process_init.connect(lambda **_: start_preload(rt), weak=False)  # committed models warm (R16)
    worker_shutdown.connect(on_shutdown, weak=False)
    task_prerun.connect(on_task_start, weak=False)
    task_postrun.connect(on_task_end, weak=False)
    task_failure.connect(on_task_failure, weak=False)
    settings.models_dir.mkdir(parents=True, exist_ok=True)
    celery.worker_main(worker_argv(settings.machine, loglevel))
    if heartbeat.refused:
        raise SystemExit(EX_CONFIG)
