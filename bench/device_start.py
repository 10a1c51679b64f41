"""Start time of a host's workers: one device against two. Figures only, never asserts.

A private redis-server, a real ``homefleet serve`` (SQLite journal) and, per round, the
workers of a one-device host (``solo-<r>``, ``devices = 1``) and then those of a two-device
host (``duo-<r>``, ``devices = 2``: machines ``duo-<r>:0`` and ``duo-<r>:1``, two worker
processes started together), each with the tiny SD model of app/devtools/tiny_models.py in
its own folder. A host's start time runs from spawning its workers
(``LocalFleet.start_host``) until every one of its machines is online with the model
verified (its first heartbeat, after the start-up check, R4); then its workers are stopped.
Each round's hosts are new machines, so no heartbeat of an earlier round is seen. Every
worker runs one torch thread.

    python -m bench.device_start [--rounds 3] [--forkserver]

Last line: ``one_s=X two_s=X ratio=R`` (medians over the rounds; ratio = two_s / one_s).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from app.context import build_context
from app.core.config import Settings
from app.core.secret_files import write_private
from app.devtools.localfleet import LocalFleet
from app.devtools.redis_server import free_port, start_redis_server
from app.devtools.tiny_models import make_tiny
from app.fleet.config import load_fleet
from bench import add_forkserver_flag

MODEL = "tiny-sd"
API_KEY = "bench-device-start-key-".ljust(40, "x")


def fleet_toml(rounds: int) -> str:
    """The fleet file: ``server`` (no worker) and, per round, hosts ``solo-<r>`` and ``duo-<r>``."""
    entries = [("server", None)] + [
        (f"{kind}-{r}", count) for r in range(rounds) for kind, count in (("solo", 1), ("duo", 2))
    ]
    lines = []
    for name, count in entries:
        token = f"token-{name}-".ljust(32, "x")
        lines += [
            "[[machines]]",
            f'name = "{name}"',
            'backend = "cpu"',
            'memory_kind = "unified"',
            "memory_bytes = 4_000_000_000",
            'families = ["sd1"]',
            f'token = "{token}"',
            *([f"devices = {count}"] if count else []),
            "",
        ]
    return "\n".join(lines)


def time_host(local: LocalFleet, host: str) -> float:
    """Seconds from spawning ``host``'s workers until all are online with the model verified."""
    machines = [m.name for m in local.fleet.hosts()[host]]
    started = time.monotonic()
    local.start_host(host)
    local.wait_online(machines, model_id=MODEL, timeout_s=300)
    seconds = time.monotonic() - started
    for machine in machines:
        local.stop_worker(machine)
    return seconds


def run(rounds: int, forkserver: bool = False) -> dict[str, float]:
    """The medians over ``rounds`` rounds, in seconds: ``{one_s, two_s, ratio}``. Sets
    ``HOMEFLEET_TORCH_THREADS=1`` in this process while it runs (``LocalFleet.torch_threads``:
    one per worker) and restores it after."""
    before = os.environ.get("HOMEFLEET_TORCH_THREADS")
    os.environ["HOMEFLEET_TORCH_THREADS"] = "1"
    try:
        return _run(rounds, forkserver)
    finally:
        if before is None:
            os.environ.pop("HOMEFLEET_TORCH_THREADS", None)
        else:
            os.environ["HOMEFLEET_TORCH_THREADS"] = before


def _run(rounds: int, forkserver: bool) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="hf-device-start-") as tmp:
        root = Path(tmp)
        redis_process = start_redis_server(root / "redis")
        fleet_file = root / "fleet.toml"
        write_private(fleet_file, fleet_toml(rounds))
        fleet = load_fleet(fleet_file)
        settings = Settings(
            data_dir=root / "server",
            redis_url=redis_process.url,
            fleet_file=fleet_file,
            api_port=free_port(),
            api_keys=[API_KEY],
            heartbeat_interval_s=0.5,
        )
        local = LocalFleet(settings, fleet, fleet_file, forkserver=forkserver)
        one, two = [], []
        try:
            ctx = build_context(settings, fleet, migrate=True)
            try:
                ctx.registry.add(make_tiny(root / "tiny", ["txt2img"])["txt2img"], MODEL)
            finally:
                ctx.close()
            for name in fleet.machines:
                local.copy_model(MODEL, name)
            local.start_api()
            for r in range(rounds):
                one.append(time_host(local, f"solo-{r}"))
                two.append(time_host(local, f"duo-{r}"))
                print(f"round {r}: one device {one[-1]:.2f} s, two devices {two[-1]:.2f} s", flush=True)
        finally:
            local.stop()
            redis_process.stop()
    one_s, two_s = statistics.median(one), statistics.median(two)
    return {"one_s": one_s, "two_s": two_s, "ratio": two_s / one_s}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="rounds of one host of each size (default 3)")
    add_forkserver_flag(parser, " (a forked worker skips the imports this bench's start time is mostly made of)")
    args = parser.parse_args(argv)
    figures = run(args.rounds, args.forkserver)
    print(" ".join(f"{k}={v:.2f}" if k != "ratio" else f"{k}={v:.3f}" for k, v in figures.items()))


if __name__ == "__main__":
    main()
