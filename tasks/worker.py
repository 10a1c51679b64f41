"""``homefleet worker --machine NAME``: one Celery worker process for one device (R7, R8).

It consumes only ``machine.<name>``, with the prefork pool, concurrency 1 and prefetch
disabled, so it holds only the job it runs; the rest wait in the Redis list, in order
(shared/notes/celery-redis.md).
"""

from __future__ import annotations

import uuid
from typing import Any

from celery.signals import worker_process_init, worker_ready, worker_shutdown

from app import digest, keys
from app.celery_app import RUN_JOB_TASK, SYNC_TASK, create_celery
from app.config import WorkerSettings
from app.connections import create_redis
from tasks import runtime
from tasks.heartbeat import Heartbeat
from tasks.preload import start_preload
from tasks.run_job import run_job
from tasks.sync import sync


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


EX_CONFIG = 78  # sysexits.h: a configuration error (here: the server refused the worker's token)


def start_worker(settings: WorkerSettings, loglevel: str = "INFO") -> None:
    """Run the worker in the foreground until it is stopped (SIGTERM/SIGINT).

    Raises:
        SystemExit: ``EX_CONFIG`` (78) when the server refused the worker's token at start.
    """
    from tasks.pipelines import go_offline, quiet

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

    worker_ready.connect(on_ready, weak=False)
    worker_process_init.connect(lambda **_: digest.single_threaded(), weak=False)  # fork-safe hashing
    worker_process_init.connect(lambda **_: start_preload(rt), weak=False)  # committed models warm (R16)
    worker_shutdown.connect(on_shutdown, weak=False)
    settings.models_dir.mkdir(parents=True, exist_ok=True)
    celery.worker_main(worker_argv(settings.machine, loglevel))
    if heartbeat.refused:
        raise SystemExit(EX_CONFIG)
