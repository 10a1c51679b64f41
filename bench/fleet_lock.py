"""How long a submission holds the fleet lock (R14): the p50 and p99 of the lock's hold, acquired
to released (what ``homefleet_fleet_lock_hold_seconds`` observes, app/fleet/lock.py), over N
``Dispatcher.submit`` calls, in one process, on a private redis-server and a SQLite journal.

A fleet of ``MACHINES`` machines, all online with a header-only model verified (a real
safetensors file; nothing is loaded); no worker consumes. A busy fleet is imitated: before each
submission the learned timings' change mark moves, as each job's end moves it (R13), so the cost
data are re-read for every decision. Auto submissions.

Two loops in the same run, alternating in blocks of ``BLOCK`` so a load change on a shared host
weighs on both alike: ``ahead`` is the server's submission (the cost data read before the lock,
``Dispatcher.read_ahead``); ``inside`` is the same submission with that read ahead turned off,
so everything is read under the lock (as before it was moved out).

    python -m bench.fleet_lock [SUBMISSIONS]

Figures are printed, never asserted. Last line:
``ahead_p50_ms=X ahead_p99_ms=X inside_p50_ms=X inside_p99_ms=X submit_p50_ms=X``
(``submit_p50_ms``: a whole submission, with the read ahead).
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

from app.context import build_context
from app.core.config import Settings
from app.devtools.redis_server import start_redis_server
from app.fleet.config import Fleet, Machine
from app.fleet.costs import ChangeMark
from bench import parse_submissions
from bench.submit import _model_folder

SUBMISSIONS = 300  # counted per loop
WARM_UP = 20
BLOCK = 25
MACHINES = 8


def cpu_fleet(count: int = MACHINES) -> Fleet:
    """A fleet of ``count`` unified-memory CPU machines (``server``, ``w001``...) that run sd1,
    8 GB each, tokens made up: what the in-process lock and snapshot benches place on."""
    names = ["server"] + [f"w{i:03d}" for i in range(1, count)]
    return Fleet(
        machines={
            name: Machine(
                name=name,
                backend="cpu",
                memory_kind="unified",
                memory_bytes=8_000_000_000,
                families=frozenset({"sd1"}),
                token=f"token-{name}-".ljust(32, "x"),
            )
            for name in names
        }
    )


def hold_times(submissions: int = SUBMISSIONS) -> tuple[list[float], list[float], list[float]]:
    """(seconds each submission held the lock with the read ahead, without it, seconds per whole
    submission with it)."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        redis_process = start_redis_server(root / "redis")
        try:
            fleet = cpu_fleet()
            settings = Settings(
                data_dir=root / "server",
                redis_url=redis_process.url,
                max_queued_per_machine=1_000_000,
                max_pending_total=1_000_000,
            )
            ctx = build_context(settings, fleet, migrate=True)
            try:
                model = ctx.registry.add(_model_folder(root), "bench-sd").id
                for name in fleet.machines:
                    ctx.redis.set(ctx.keys.heartbeat(name), json.dumps({"machine": name}), ex=3600)
                    ctx.redis.sadd(ctx.keys.verified(name), model)
                job_ended = ChangeMark(ctx.redis, ctx.keys.timings_changed())
                holds: list[float] = []
                ctx.lock.observe = holds.append
                read_ahead = ctx.dispatcher.read_ahead

                def submit(i: int, ahead: bool) -> tuple[float, float]:
                    job_ended.touch()
                    ctx.dispatcher.read_ahead = read_ahead if ahead else (lambda model_id: None)
                    started = time.perf_counter()
                    ctx.dispatcher.submit(model, "txt2img", {"prompt": f"p{i}"}, "auto")
                    return holds[-1], time.perf_counter() - started

                for i in range(WARM_UP):
                    submit(-1 - i, True)
                    submit(-1 - i, False)
                ahead: list[tuple[float, float]] = []
                inside: list[tuple[float, float]] = []
                for first in range(0, submissions, BLOCK):
                    block = range(first, min(first + BLOCK, submissions))
                    ahead.extend(submit(i, True) for i in block)
                    inside.extend(submit(i, False) for i in block)
            finally:
                ctx.close()
        finally:
            redis_process.stop()
    return [h for h, _ in ahead], [h for h, _ in inside], [s for _, s in ahead]


def _ms(values: list[float], q: int) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] * 1000


def main(argv: list[str] | None = None) -> None:
    submissions = parse_submissions(argv, __doc__ or "", SUBMISSIONS)
    ahead, inside, whole = hold_times(submissions)
    print(f"submissions per loop: {len(ahead)}; {MACHINES} machines; the timings' mark moved before each")
    print(
        f"ahead_p50_ms={_ms(ahead, 50):.3f} ahead_p99_ms={_ms(ahead, 99):.3f} inside_p50_ms={_ms(inside, 50):.3f} "
        f"inside_p99_ms={_ms(inside, 99):.3f} submit_p50_ms={statistics.median(whole) * 1000:.3f}"
    )


if __name__ == "__main__":
    main()
