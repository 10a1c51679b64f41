"""What the per-key quota check costs a submission: the median (and p90) latency of
``Dispatcher.submit`` for a key under a quota (both limits set, never reached) beside a key
under none, in one process, on one journal and one Redis.

A private redis-server, a SQLite journal in a temporary folder and a header-only model (a real
safetensors file; nothing is loaded); no worker consumes. Before timing, each key gets
``HISTORY`` jobs that ended in the last hour (the GPU-seconds query reads them all). Each loop
first runs ``WARM_UP`` uncounted submissions, then the counted ones alternate in blocks of
``BLOCK`` (unlimited, quota, unlimited, ...), so a load change on a shared machine weighs on
both alike. The key under a quota also has its queued jobs counted, which grow as it submits.

    python -m bench.quotas [SUBMISSIONS]

Then the check alone, ``KeyQuotas.check`` of the key under a quota, 200 times (its median:
``check_p50_ms``, what the quota adds under the fleet lock, less noisy than the difference of two
submission medians on a shared host).

Last line: ``no_quota_p50_ms=X quota_p50_ms=X delta_p50_ms=X no_quota_p90_ms=X quota_p90_ms=X check_p50_ms=X``.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

from app.context import ServerContext, build_context
from app.core.config import Settings
from app.core.states import JobState
from app.db.tables import Job
from app.devtools.redis_server import start_redis_server
from app.fleet.config import Fleet, Machine
from bench import parse_submissions
from bench.submit import _model_folder

SUBMISSIONS = 200  # counted per loop
WARM_UP = 20
BLOCK = 25
HISTORY = 100  # jobs of each key that ended in the last hour
QUOTA_KEY = "ci-key-0123456789abcdef"
FREE_KEY = "free-key-0123456789abcdef"


def _history(ctx: ServerContext, key_id: str, model: str) -> None:
    now = datetime.now(UTC)
    for i in range(HISTORY):
        ended = now - timedelta(seconds=30 * (i + 1))
        ctx.journal.add(
            Job(
                state=JobState.succeeded,
                model_id=model,
                kind="txt2img",
                params={"prompt": "old"},
                target="server",
                machine="server",
                api_key_id=key_id,
                started_at=ended,
                finished_at=ended,
                load_s=0.1,
                run_s=1.0,
            )
        )


def quota_latencies(submissions: int = SUBMISSIONS) -> tuple[list[float], list[float], list[float]]:
    """(seconds per submission of the key under no quota, of the key under a quota, per check alone)."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        redis_process = start_redis_server(root / "redis")
        try:
            fleet = Fleet(
                machines={
                    "server": Machine(
                        name="server",
                        backend="cpu",
                        memory_kind="unified",
                        memory_bytes=8_000_000_000,
                        families=frozenset({"sd1"}),
                        token="token-server-".ljust(32, "x"),
                    )
                }
            )
            settings = Settings(
                data_dir=root / "server",
                redis_url=redis_process.url,
                api_keys=[QUOTA_KEY, FREE_KEY],
                api_key_quotas={
                    "ci": {"key_prefix": "ci-key-", "max_queued_jobs": 1_000_000, "max_gpu_seconds_per_hour": 1e9}
                },
                max_queued_per_machine=1_000_000,
                max_pending_total=1_000_000,
            )
            ctx = build_context(settings, fleet, migrate=True)
            try:
                model = ctx.registry.add(_model_folder(root), "bench-sd").id
                ctx.redis.set(ctx.keys.heartbeat("server"), '{"machine": "server"}', ex=3600)
                ctx.redis.sadd(ctx.keys.verified("server"), model)
                quota_id, free_id = settings.api_key_id(QUOTA_KEY), settings.api_key_id(FREE_KEY)
                assert (
                    ctx.dispatcher.quotas.quota(quota_id) is not None and ctx.dispatcher.quotas.quota(free_id) is None
                )
                _history(ctx, quota_id, model)
                _history(ctx, free_id, model)

                def submit(key_id: str, i: int) -> float:
                    started = time.perf_counter()
                    ctx.dispatcher.submit(model, "txt2img", {"prompt": f"p{i}"}, "server", api_key_id=key_id)
                    return time.perf_counter() - started

                for i in range(WARM_UP):
                    submit(free_id, -1 - i)
                    submit(quota_id, -1 - i)
                free: list[float] = []
                quota: list[float] = []
                for first in range(0, submissions, BLOCK):
                    block = range(first, min(first + BLOCK, submissions))
                    free.extend(submit(free_id, i) for i in block)
                    quota.extend(submit(quota_id, i) for i in block)
                checks = []
                for _ in range(SUBMISSIONS):
                    started = time.perf_counter()
                    ctx.dispatcher.quotas.check(quota_id)
                    checks.append(time.perf_counter() - started)
            finally:
                ctx.close()
        finally:
            redis_process.stop()
    return free, quota, checks


def _p(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[int(q) - 1] * 1000


def main(argv: list[str] | None = None) -> None:
    submissions = parse_submissions(argv, __doc__ or "", SUBMISSIONS)
    free, quota, checks = quota_latencies(submissions)
    free_p50, quota_p50 = statistics.median(free) * 1000, statistics.median(quota) * 1000
    print(
        f"no_quota_p50_ms={free_p50:.3f} quota_p50_ms={quota_p50:.3f} delta_p50_ms={quota_p50 - free_p50:.3f} "
        f"no_quota_p90_ms={_p(free, 90):.3f} quota_p90_ms={_p(quota, 90):.3f} "
        f"check_p50_ms={statistics.median(checks) * 1000:.3f}"
    )


if __name__ == "__main__":
    main()
