"""``homefleet bench``: a concurrency sweep of submissions (after TGI's benchmark tool).

At each concurrency level C, C client threads each submit a job and wait for it to end,
then submit the next, until ``jobs`` jobs have been sent at that level (a closed loop).
Reported per level and machine: jobs, queue time (submission to start, seconds, from the
journal's ``created_at``/``started_at``), run time (the worker's ``run_s``) as p50/p95, and
refused submissions by reason (422 validation, 429 backpressure, 503…). Figures only, never
asserts: the numbers depend on the machines.
"""

from __future__ import annotations

import statistics
import threading
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import httpx

from app.client import ApiError, HomefleetClient


@dataclass
class LevelReport:
    """One concurrency level: per machine ``queue_s`` and ``run_s`` lists, refusals by reason."""

    concurrency: int
    wall_s: float = 0.0
    queue_s: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    run_s: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    ended: Counter[str] = field(default_factory=Counter)  # final states (succeeded, failed…)
    rejections: Counter[str] = field(default_factory=Counter)  # reason -> count

    def rows(self) -> list[dict[str, Any]]:
        """One row per machine: jobs, queue and run p50/p95 in seconds."""
        return [
            {
                "concurrency": self.concurrency,
                "machine": machine,
                "jobs": len(self.run_s[machine]),
                "queue_p50_s": quantile(self.queue_s[machine], 0.5),
                "queue_p95_s": quantile(self.queue_s[machine], 0.95),
                "run_p50_s": quantile(self.run_s[machine], 0.5),
                "run_p95_s": quantile(self.run_s[machine], 0.95),
            }
            for machine in sorted(self.run_s)
        ]


def quantile(values: list[float], q: float) -> float | None:
    """The ``q`` quantile (inclusive method), or None without values."""
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[round(q * 100) - 1]


def seconds_between(start: str | None, end: str | None) -> float | None:
    if not start or not end:
        return None
    return max(0.0, (datetime.fromisoformat(end) - datetime.fromisoformat(start)).total_seconds())


UNREACHABLE = "server_unreachable"
"""The reason a submission or its wait counts under when the server did not answer (a transport
error): a run with any exits 1 (``homefleet bench``)."""


def run_level(
    client: HomefleetClient,
    model: str,
    params: dict[str, Any],
    target: str,
    concurrency: int,
    jobs: int,
    timeout_s: float = 600.0,
) -> LevelReport:
    """Send ``jobs`` submissions from ``concurrency`` threads (closed loop) and measure them."""
    import time

    report = LevelReport(concurrency)
    guard = threading.Lock()
    remaining = [jobs]

    def take() -> bool:
        with guard:
            if remaining[0] == 0:
                return False
            remaining[0] -= 1
            return True

    def loop() -> None:
        while take():
            try:
                accepted = client.submit(model, "txt2img", dict(params), target)
                job = client.wait(accepted["id"], timeout_s=timeout_s)
            except ApiError as refused:
                with guard:
                    report.rejections[refused.reason] += 1
                continue
            except httpx.HTTPError:  # the server went away mid-run: counted, the level goes on
                with guard:
                    report.rejections[UNREACHABLE] += 1
                continue
            with guard:
                report.ended[job["state"]] += 1
                if job["state"] == "succeeded" and job["machine"]:
                    queued = seconds_between(job["created_at"], job["started_at"])
                    if queued is not None:
                        report.queue_s[job["machine"]].append(queued)
                    report.run_s[job["machine"]].append(float(job["run_s"] or 0.0))

    started = time.monotonic()
    threads = [threading.Thread(target=loop, name=f"bench-{i}") for i in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    report.wall_s = time.monotonic() - started
    return report


def sweep(
    client: HomefleetClient, model: str, levels: list[int], jobs: int, params: dict[str, Any], target: str = "auto"
) -> list[LevelReport]:
    """:func:`run_level` at every concurrency in ``levels``, in order."""
    return [run_level(client, model, params, target, level, jobs) for level in levels]
