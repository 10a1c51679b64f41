"""What reading running jobs' step reports adds to placement's snapshot of the fleet (R14):
``MachineStates.snapshot`` of ``MACHINES`` machines, each running one job that reported steps,
timed three ways: reading the reports at every snapshot (``every``), as the server does (at
most once per ``app.fleet.machines.STEPS_EVERY_S``, a burst of submissions in between reusing
the figures: ``server``), and with them left out (``without``, as before placement priced a
running job from its reports). One process, a private redis-server, a SQLite journal; no
worker. The loops alternate in blocks of ``BLOCK`` so a load change on a shared host weighs on
all alike.

    python -m bench.snapshot_progress [MACHINES]

Figures are printed, never asserted. Last line:
``machines=N every_p50_ms=X server_p50_ms=X without_p50_ms=X per_running_job_us=X`` (the last:
what reading one running job's report adds to a snapshot, ``every`` less ``without``).
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

from app.context import build_context
from app.core.config import Settings
from app.devtools.redis_server import start_redis_server
from app.fleet.lock import Fence
from bench.fleet_lock import cpu_fleet

MACHINES = 500
ROUNDS = 20
BLOCK = 10


def snapshot_times(count: int = MACHINES) -> dict[str, list[float]]:
    """Seconds per snapshot for each way (``every``, ``server``, ``without``, the module's)."""
    from app.fleet import machines as machines_module

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        redis_process = start_redis_server(root / "redis")
        try:
            settings = Settings(data_dir=root / "server", redis_url=redis_process.url)
            ctx = build_context(settings, cpu_fleet(count), migrate=True)
            try:
                machines, reservations = ctx.machines, ctx.machines.reservations
                ctx.redis.set(ctx.keys.fleet_lock(), "bench", px=600_000)
                held = Fence(ctx.keys.fleet_lock(), "bench", ttl_ms=600_000)
                for name in machines.fleet.machines:
                    job_id = f"job-{name}"
                    reservations.add(name, job_id, "tiny-sd", "txt2img", 30, 512 * 512, held)
                    reservations.start(name, job_id)
                    ctx.progress.report(job_id, 3, 30)
                    ctx.progress.report(job_id, 9, 30)
                machines.snapshot()  # parsed once: the snapshot knows which jobs run
                running, every_s = reservations.running, machines_module.STEPS_EVERY_S
                times: dict[str, list[float]] = {"every": [], "server": [], "without": []}
                try:
                    for _ in range(ROUNDS):
                        for way, spent in times.items():
                            machines_module.STEPS_EVERY_S = 0.0 if way == "every" else every_s
                            reservations.running = running if way != "without" else (lambda machine: [])  # type: ignore[method-assign]
                            for _ in range(BLOCK):
                                started = time.perf_counter()
                                machines.snapshot()
                                spent.append(time.perf_counter() - started)
                finally:
                    machines_module.STEPS_EVERY_S = every_s
                    reservations.running = running  # type: ignore[method-assign]
                return times
            finally:
                ctx.close()
        finally:
            redis_process.stop()


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    count = int(args[0]) if args else MACHINES
    times = snapshot_times(count)
    p50 = {way: statistics.median(spent) * 1000 for way, spent in times.items()}
    print(f"snapshot of {count} machines, each running a job that reported steps ({len(times['every'])} per way):")
    for way, ms in p50.items():
        print(f"  {way:<8} p50 {ms:.2f} ms")
    print(
        f"machines={count} every_p50_ms={p50['every']:.2f} server_p50_ms={p50['server']:.2f} "
        f"without_p50_ms={p50['without']:.2f} per_running_job_us={(p50['every'] - p50['without']) / count * 1000:.1f}"
    )


if __name__ == "__main__":
    main()
