"""Submission latency: ``POST /v1/jobs`` -> the task's start on an idle machine with
the model warm, beside raw Celery's ``apply_async`` -> start of a no-op task on the same Redis,
and beside the same Homefleet path with target ``auto``. Figures only, never asserts.

A private redis-server, a real ``homefleet serve`` (SQLite journal) and one real
``homefleet worker`` (machine ``server``, the tiny SD model of app/devtools/tiny_models.py,
warmed by one job first). A Homefleet job starts at its claim: the journal's ``started_at``,
written when the worker's task claims it (``POST /internal/jobs/{id}/claim``), before any
pipeline work. Each job is submitted only once the previous one ended (an idle machine); the
clock is the host's (the client, the server and the worker share it).

Raw Celery: a ``celery worker`` of ``bench/celery_noop.py`` (Homefleet's Celery settings:
prefork, concurrency 1, prefetch disabled, early ack) whose task body pushes its start time.

The breakdown then times the dispatcher's steps in this process (the same code the server
runs, on the same Redis and journal) for jobs pinned to a machine with no worker, and the
claim's steps for those jobs (model manifest, journal claim, reservation start).

    python -m bench.latency [--jobs 500] [--steps 1] [--forkserver]

Last line: ``submit_p50_ms=X submit_p99_ms=X celery_p50_ms=X ratio_p50=R auto_p50_ms=X``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import redis

from app.context import build_context
from app.core.celery_app import create_celery
from app.core.config import BrokerSettings, Settings
from app.core.secret_files import write_private
from app.core.states import ENDED
from app.devtools.localfleet import LocalFleet
from app.devtools.procs import stop_process_group
from app.devtools.redis_server import free_port, start_redis_server
from app.devtools.tiny_models import make_tiny
from app.fleet.config import Fleet, Machine
from bench import add_forkserver_flag
from bench.celery_noop import NOOP_QUEUE, NOOP_TASK, STARTS_KEY

MODEL = "tiny-sd"
IDLE = "bench-idle"  # a machine with no worker: the breakdown's jobs wait there, never run
API_KEY = "bench-latency-key-".ljust(40, "x")


def quantile(values: list[float], q: float) -> float:
    """The ``q`` quantile (inclusive method) of at least one value."""
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[max(0, round(q * 100) - 1)]


def _unix(iso: str) -> float:
    stamp = datetime.fromisoformat(iso)
    return stamp.timestamp()


def _fleet() -> Fleet:
    def machine(name: str) -> Machine:
        return Machine(
            name=name,
            backend="cpu",
            memory_kind="unified",
            memory_bytes=4_000_000_000,
            families=frozenset({"sd1"}),
            token=f"token-{name}-".ljust(32, "x"),
        )

    return Fleet(machines={n: machine(n) for n in ("server", IDLE)})


def homefleet_starts(
    client: httpx.Client, jobs: int, target: str, params: dict[str, Any]
) -> tuple[list[float], list[float]]:
    """(submit -> claim seconds, POST round trip seconds) for ``jobs`` jobs, one at a time."""
    starts, posts = [], []
    for i in range(jobs):
        sent = time.time()
        answer = client.post(
            "/v1/jobs",
            json={"model": MODEL, "kind": "txt2img", "target": target, "params": {**params, "prompt": f"latency {i}"}},
        )
        answered = time.time()
        answer.raise_for_status()
        job_id = answer.json()["id"]
        while True:
            job = client.get(f"/v1/jobs/{job_id}").json()
            if job["state"] in ENDED:
                break
            time.sleep(0.02)
        if job["state"] != "succeeded" or not job["started_at"]:
            raise RuntimeError(f"job {job_id} ended {job['state']} ({job.get('reason')}: {job.get('message')})")
        starts.append(_unix(job["started_at"]) - sent)
        posts.append(answered - sent)
    return starts, posts


def celery_starts(redis_url: str, jobs: int) -> list[float]:
    """``apply_async`` -> no-op task start, seconds, ``jobs`` times, one at a time."""
    app = create_celery(BrokerSettings(redis_url=redis_url))  # a publisher of the same configuration
    client = redis.Redis.from_url(redis_url)
    client.delete(STARTS_KEY)
    samples = []
    for i in range(jobs + 1):  # the first one warms the pool process: not counted
        sent = time.time()
        app.send_task(NOOP_TASK, args=[str(i)], queue=NOOP_QUEUE)
        popped = client.blpop([STARTS_KEY], timeout=60)
        if popped is None:
            raise RuntimeError("the no-op task did not start within 60 s")
        token, started = popped[1].decode().split()
        if token != str(i):
            raise RuntimeError(f"unexpected no-op start {token!r} (expected {i})")
        if i:
            samples.append(float(started) - sent)
    return samples


class Spans:
    """Seconds spent per named step, one list per name."""

    def __init__(self) -> None:
        self.seconds: dict[str, list[float]] = defaultdict(list)

    def wrap(self, owner: Any, name: str, label: str) -> None:
        original: Callable[..., Any] = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds[label].append(time.perf_counter() - started)

        setattr(owner, name, timed)

    @contextmanager
    def span(self, label: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[label].append(time.perf_counter() - started)


def breakdown(settings: Settings, fleet: Fleet, jobs: int) -> Spans:
    """Time the dispatcher's steps and the claim's steps in this process, for ``jobs`` jobs
    pinned to :data:`IDLE` (given a heartbeat here; no worker takes them)."""
    spans = Spans()
    ctx = build_context(settings, fleet)
    try:
        ctx.redis.set(ctx.keys.heartbeat(IDLE), json.dumps({"machine": IDLE, "at": time.time()}), ex=3600)
        ctx.redis.sadd(ctx.keys.verified(IDLE), MODEL)
        dispatcher = ctx.dispatcher
        lock = dispatcher.lock
        original_held = lock.held

        @contextmanager
        def held(*args: Any, **kwargs: Any) -> Iterator[Any]:
            started = time.perf_counter()
            with original_held(*args, **kwargs) as fence:
                spans.seconds["lock acquire"].append(time.perf_counter() - started)
                yield fence
                released = time.perf_counter()
            spans.seconds["lock release"].append(time.perf_counter() - released)

        lock.held = held  # type: ignore[method-assign]
        for name, label in (
            ("snapshot", "snapshot (machines, demand, reservations)"),
            ("_place", "placement"),
            ("_journal", "journal insert"),
            ("_reserve", "reserve (fenced Lua)"),
            ("_publish", "publish (Celery)"),
        ):
            spans.wrap(dispatcher, name, label)
        ids = []
        for i in range(jobs + 5):
            with spans.span("submit (dispatcher, total)"):
                ids.append(
                    dispatcher.submit(
                        MODEL, "txt2img", {"prompt": f"b{i}", "steps": 1, "width": 64, "height": 64}, IDLE
                    ).job.id
                )
        for job_id in ids:
            with spans.span("claim: model manifest (verification cache)"):
                ctx.registry.manifest(MODEL)
            with spans.span("claim: journal claim"):
                ctx.journal.claim(job_id, IDLE, "bench-boot", f"claim-{job_id}")
            with spans.span("claim: reservation start"):
                ctx.machines.reservations.start(IDLE, job_id)
        for label in list(spans.seconds):  # the first five of each are warm-up
            spans.seconds[label] = spans.seconds[label][5:]
    finally:
        ctx.close()
    return spans


def run(jobs: int, steps: int, forkserver: bool = False) -> dict[str, float]:
    params = {"steps": steps, "width": 64, "height": 64}
    with tempfile.TemporaryDirectory(prefix="hf-latency-") as tmp:
        root = Path(tmp)
        redis_process = start_redis_server(root / "redis")
        fleet = _fleet()
        fleet_file = root / "fleet.toml"
        write_private(fleet_file, fleet.to_toml())
        settings = Settings(
            data_dir=root / "server",
            redis_url=redis_process.url,
            fleet_file=fleet_file,
            api_port=free_port(),
            api_keys=[API_KEY],
            heartbeat_interval_s=0.5,
            max_queued_per_machine=1_000_000,
            max_pending_total=1_000_000,
        )
        local = LocalFleet(settings, fleet, fleet_file, forkserver=forkserver)
        noop_worker: subprocess.Popen[bytes] | None = None
        try:
            ctx = build_context(settings, fleet, migrate=True)
            try:
                folder = make_tiny(root / "tiny", ["txt2img"])["txt2img"]
                ctx.registry.add(folder, MODEL)
            finally:
                ctx.close()
            local.start_api()
            local.start_worker("server")
            local.wait_online(["server"], model_id=MODEL, timeout_s=180)
            env = {**os.environ, "HOMEFLEET_REDIS_URL": redis_process.url, "PYTHONUNBUFFERED": "1"}
            with open(root / "noop-worker.log", "wb") as log:
                noop_worker = subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "celery",
                        "-A",
                        "bench.celery_noop",
                        "worker",
                        "-Q",
                        NOOP_QUEUE,
                        "--pool",
                        "prefork",
                        "-c",
                        "1",
                        "--without-gossip",
                        "--without-mingle",
                        "-l",
                        "WARNING",
                    ],
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            with httpx.Client(base_url=local.api_url, headers=local.auth_headers, timeout=120) as client:
                homefleet_starts(client, 2, "server", params)  # the model loads: warm from here on
                submit, post = homefleet_starts(client, jobs, "server", params)
                auto, auto_post = homefleet_starts(client, jobs, "auto", params)
            celery = celery_starts(redis_process.url, jobs)
            spans = breakdown(settings, fleet, jobs)
        finally:
            if noop_worker is not None:
                stop_process_group(noop_worker)
            local.stop()
            redis_process.stop()

    def ms(values: list[float], q: float) -> float:
        return 1000 * quantile(values, q)

    print(f"{'path':<48} {'p50 ms':>8} {'p99 ms':>8}")
    for label, values in (
        ("homefleet submit -> claim (pinned)", submit),
        ("  of which POST round trip", post),
        ("homefleet submit -> claim (auto)", auto),
        ("  of which POST round trip", auto_post),
        ("celery apply_async -> no-op start", celery),
    ):
        print(f"{label:<48} {ms(values, 0.5):>8.2f} {ms(values, 0.99):>8.2f}")
    after_post = [s - p for s, p in zip(submit, post, strict=True)]
    print(
        f"{'  answer -> claim (delivery, pool, claim HTTP)':<48} "
        f"{ms(after_post, 0.5):>8.2f} {ms(after_post, 0.99):>8.2f}"
    )
    print(f"\nbreakdown in-process ({jobs} pinned submissions and claims, no worker):")
    for label, values in spans.seconds.items():
        print(f"  {label:<46} {ms(values, 0.5):>8.3f} {ms(values, 0.99):>8.3f}")
    return {
        "submit_p50_ms": ms(submit, 0.5),
        "submit_p99_ms": ms(submit, 0.99),
        "celery_p50_ms": ms(celery, 0.5),
        "ratio_p50": quantile(submit, 0.5) / quantile(celery, 0.5),
        "auto_p50_ms": ms(auto, 0.5),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=500, help="jobs per path (default 500)")
    parser.add_argument("--steps", type=int, default=1, help="denoising steps per Homefleet job (default 1)")
    add_forkserver_flag(parser)
    args = parser.parse_args(argv)
    figures = run(args.jobs, args.steps, args.forkserver)
    print(" ".join(f"{k}={v:.2f}" if k != "ratio_p50" else f"{k}={v:.3f}" for k, v in figures.items()))


if __name__ == "__main__":
    main()
