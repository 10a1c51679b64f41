"""A server under a deep backlog: ``--queued`` jobs (default 10,000) queued over 8
machines with no worker consuming, then a real ``homefleet serve`` process is measured:
its idle RSS (psutil), ``GET /v1/jobs/{id}`` p99, ``GET /v1/jobs?state=queued`` p99 (paged,
100 a page, keyset cursor ``after``), ``POST /v1/jobs`` p99, one reconciliation pass
(``Reconciler.run_once``, in this process on the same journal and Redis) and
``homefleet status`` (a fresh CLI process, Python start-up and imports included). Figures
only, never asserts.

The backlog is written through the real dispatcher in this process (placement, fleet lock,
journal, fenced reservation, Celery publish: what ``POST /v1/jobs`` runs, without HTTP),
which is several times faster than through the API on a loaded host. The 8 machines get a
heartbeat from this process and a header-only model (nothing is ever loaded).

    python -m bench.backlog [--queued 10000] [--samples 200] [--journal postgresql://...] [--forkserver]

Last line: ``rss_mb=X get_p99_ms=X list_p99_ms=X submit_p99_ms=X reconcile_s=X status_s=X``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

from app.context import build_context
from app.core.config import Settings
from app.core.secret_files import write_private
from app.devtools.localfleet import LocalFleet
from app.devtools.redis_server import free_port, start_redis_server
from app.fleet.config import Fleet, Machine
from bench import add_forkserver_flag
from bench.latency import quantile
from bench.submit import _model_folder

MACHINES = 8
MODEL = "bench-sd"
API_KEY = "bench-backlog-key-".ljust(40, "x")


def _fleet() -> Fleet:
    names = ["server"] + [f"m{i}" for i in range(1, MACHINES)]
    return Fleet(
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


def _timed(call: object, samples: int) -> list[float]:
    values = []
    for _ in range(samples):
        started = time.perf_counter()
        call()  # type: ignore[operator]
        values.append(time.perf_counter() - started)
    return values


def _wait_idle(
    process: psutil.Process, busy_share: float = 0.05, window_s: float = 0.5, timeout_s: float = 120.0
) -> float:
    """Wait until ``process`` uses under ``busy_share`` of a core over ``window_s`` seconds (the
    server's start-up pass over a deep backlog runs for seconds after it answers /health;
    requests measured meanwhile measure that pass). Returns the seconds waited; gives up
    after ``timeout_s``."""
    started = time.perf_counter()
    while time.perf_counter() - started < timeout_s:
        before = sum(process.cpu_times()[:2])
        time.sleep(window_s)
        if sum(process.cpu_times()[:2]) - before < busy_share * window_s:
            break
    return time.perf_counter() - started


def run(
    queued: int,
    samples: int,
    journal_url: str | None,
    reconcile_interval_s: float | None = None,
    forkserver: bool = False,
) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="hf-backlog-") as tmp:
        root = Path(tmp)
        redis_process = start_redis_server(root / "redis")
        fleet = _fleet()
        fleet_file = root / "fleet.toml"
        write_private(fleet_file, fleet.to_toml())
        extra: dict[str, object] = {"database_url": journal_url} if journal_url else {}
        if reconcile_interval_s is not None:
            extra["reconcile_interval_s"] = reconcile_interval_s
        settings = Settings(
            data_dir=root / "server",
            redis_url=redis_process.url,
            fleet_file=fleet_file,
            api_port=free_port(),
            api_keys=[API_KEY],
            max_queued_per_machine=1_000_000,
            max_pending_total=1_000_000,
            **extra,
        )
        local = LocalFleet(settings, fleet, fleet_file, forkserver=forkserver)
        try:
            ctx = build_context(settings, fleet, migrate=True)
            try:
                ctx.registry.add(_model_folder(root), MODEL)

                def beat() -> None:
                    for name in fleet.machines:
                        ctx.redis.set(
                            ctx.keys.heartbeat(name), json.dumps({"machine": name, "at": time.time()}), ex=3600
                        )
                        ctx.redis.sadd(ctx.keys.verified(name), MODEL)

                beat()
                started = time.perf_counter()
                ids = [
                    ctx.dispatcher.submit(MODEL, "txt2img", {"prompt": f"b{i}", "steps": 1}, "auto").job.id
                    for i in range(queued)
                ]
                fill_s = time.perf_counter() - started
                print(
                    f"backlog: {queued} jobs queued over {MACHINES} machines through the dispatcher "
                    f"in {fill_s:.1f} s ({1000 * fill_s / max(1, queued):.2f} ms each)"
                )
                local.start_api()
                with httpx.Client(base_url=local.api_url, headers=local.auth_headers, timeout=60) as client:
                    for _ in range(20):  # warm-up: connections, first queries
                        client.get(f"/v1/jobs/{ids[0]}").raise_for_status()
                    settled_s = _wait_idle(psutil.Process(local.processes["api"].pid))
                    print(
                        f"server idle {settled_s:.1f} s after its health check (its start-up reconciliation "
                        f"pass over the backlog done)"
                    )
                    rss_mb = psutil.Process(local.processes["api"].pid).memory_info().rss / 1e6
                    chosen = random.Random(7).choices(ids, k=samples)
                    get_s = []
                    for job_id in chosen:
                        t = time.perf_counter()
                        client.get(f"/v1/jobs/{job_id}").raise_for_status()
                        get_s.append(time.perf_counter() - t)
                    list_s, listed, after = [], 0, None
                    while len(list_s) < samples:
                        t = time.perf_counter()
                        page = client.get(
                            "/v1/jobs",
                            params={
                                "state": "queued",
                                "order": "oldest",
                                "limit": 100,
                                **({"after": after} if after else {}),
                            },
                        )
                        list_s.append(time.perf_counter() - t)
                        page.raise_for_status()
                        rows = page.json()
                        listed += len(rows)
                        after = rows[-1]["id"] if rows else None
                    submit_s = []
                    for i in range(samples):
                        t = time.perf_counter()
                        client.post(
                            "/v1/jobs",
                            json={
                                "model": MODEL,
                                "kind": "txt2img",
                                "target": "auto",
                                "params": {"prompt": f"s{i}", "steps": 1},
                            },
                        ).raise_for_status()
                        submit_s.append(time.perf_counter() - t)
                beat()
                reconciler = ctx.reconciler()
                t = time.perf_counter()
                report = reconciler.run_once()
                reconcile_s = time.perf_counter() - t
                print(f"reconciliation pass: {report}")
            finally:
                ctx.close()
            env = {
                **os.environ,
                "HOMEFLEET_DATA_DIR": str(settings.data_dir),
                "HOMEFLEET_REDIS_URL": redis_process.url,
                "HOMEFLEET_FLEET_FILE": str(fleet_file),
                **({"HOMEFLEET_DATABASE_URL": journal_url} if journal_url else {}),
            }
            t = time.perf_counter()
            done = subprocess.run(
                [sys.executable, "-m", "app.cli", "status"],
                check=False,
                env=env,
                capture_output=True,
                text=True,
                timeout=120,
            )
            status_s = time.perf_counter() - t
            if done.returncode != 0:
                raise RuntimeError(f"homefleet status exited {done.returncode}: {done.stdout}\n{done.stderr}")
            t = time.perf_counter()
            subprocess.run(
                [sys.executable, "-c", "import app.cli.main"], check=False, env=env, capture_output=True, timeout=120
            )
            imports_s = time.perf_counter() - t
        finally:
            local.stop()
            redis_process.stop()

    def ms(values: list[float]) -> str:
        return f"p50 {1000 * quantile(values, 0.5):7.2f} ms  p99 {1000 * quantile(values, 0.99):7.2f} ms"

    print(f"journal: {'PostgreSQL' if journal_url else 'SQLite'}; server idle RSS {rss_mb:.1f} MB")
    print(f"GET /v1/jobs/{{id}}            {ms(get_s)}  ({samples} random ids)")
    print(f"GET /v1/jobs?state=queued     {ms(list_s)}  ({len(list_s)} pages of 100, {listed} jobs)")
    print(f"POST /v1/jobs (auto)          {ms(submit_s)}  ({samples} submissions)")
    print(f"reconciliation pass           {reconcile_s:.3f} s")
    print(
        f"homefleet status              {status_s:.3f} s (of which Python start-up and CLI imports {imports_s:.3f} s)"
    )
    return {
        "rss_mb": rss_mb,
        "get_p99_ms": 1000 * quantile(get_s, 0.99),
        "list_p99_ms": 1000 * quantile(list_s, 0.99),
        "submit_p99_ms": 1000 * quantile(submit_s, 0.99),
        "reconcile_s": reconcile_s,
        "status_s": status_s,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--queued", type=int, default=10_000, help="jobs queued before measuring (default 10,000)")
    parser.add_argument("--samples", type=int, default=200, help="requests per measured route (default 200)")
    parser.add_argument("--journal", default=None, help="a database URL for the journal (default: SQLite)")
    parser.add_argument(
        "--reconcile-interval-s",
        type=float,
        default=None,
        help="the server's reconciliation interval (default: the server's, 5 s); a long one keeps "
        "its passes out of the measured requests",
    )
    add_forkserver_flag(parser, "; rss_mb then counts the fork server's preloaded modules (torch) the server inherits")
    args = parser.parse_args(argv)
    figures = run(args.queued, args.samples, args.journal, args.reconcile_interval_s, args.forkserver)
    print(" ".join(f"{k}={v:.3f}" if k.endswith("_s") else f"{k}={v:.1f}" for k, v in figures.items()))


if __name__ == "__main__":
    main()
