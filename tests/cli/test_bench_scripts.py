"""The benchmarks run from the commands in docs/benchmarks.md and print their last
line in its documented format, so the scripts cannot rot. Tiny parameters: the figures are
not judged here (benchmarks print figures; they never assert timings). Each runs its own
Redis (on a free port), server and (latency) workers, so they run beside each other and
beside any test on the xdist workers."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NUMBER = r"-?\d+(\.\d+)?"


def _last_line(*args: str, timeout_s: float = 600) -> str:
    done = subprocess.run(
        [sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout_s, check=False
    )
    assert done.returncode == 0, (
        f"{' '.join(args)} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    )
    return done.stdout.strip().splitlines()[-1]


def _assert_format(line: str, names: list[str]) -> None:
    pattern = " ".join(f"{name}={NUMBER}" for name in names)
    assert re.fullmatch(pattern, line), f"last line {line!r} is not {pattern!r}"


@pytest.mark.e2e
def test_latency_bench_prints_its_last_line() -> None:
    line = _last_line("bench.latency", "--jobs", "3")
    _assert_format(line, ["submit_p50_ms", "submit_p99_ms", "celery_p50_ms", "ratio_p50", "auto_p50_ms"])


def test_backlog_bench_prints_its_last_line() -> None:
    line = _last_line("bench.backlog", "--queued", "20", "--samples", "5")
    _assert_format(line, ["rss_mb", "get_p99_ms", "list_p99_ms", "submit_p99_ms", "reconcile_s", "status_s"])


def test_placement_bench_prints_its_last_line() -> None:
    line = _last_line("bench.placement", "--trace", "bench/traces/mixed_50.jsonl", "--no-submit", "--moves", "50")
    _assert_format(line, ["worst_auto_vs_best_baseline", "min_closed", "mean_closed", "decision_ms_500"])


def test_shapes_bench_prints_its_last_line() -> None:
    line = _last_line("bench.shapes", "--images", "2")
    _assert_format(line, ["load_s", "image_s", "colour_ok", "background_ok", "shape_ok", "style_ok"])


def test_webhooks_bench_prints_its_last_line() -> None:
    line = _last_line("bench.webhooks", "--jobs", "3", "--backoff", "0.05")
    _assert_format(
        line, ["delivery_p50_ms", "delivery_p99_ms", "cancel_plain_p50_ms", "cancel_hooked_p50_ms", "retry_ms"]
    )


def test_quota_bench_prints_its_last_line() -> None:
    line = _last_line("bench.quotas", "30")
    _assert_format(
        line, ["no_quota_p50_ms", "quota_p50_ms", "delta_p50_ms", "no_quota_p90_ms", "quota_p90_ms", "check_p50_ms"]
    )


@pytest.mark.e2e
def test_device_start_bench_prints_its_last_line() -> None:
    line = _last_line("bench.device_start", "--rounds", "1")
    _assert_format(line, ["one_s", "two_s", "ratio"])


def test_adapters_bench_prints_its_last_line() -> None:
    line = _last_line("bench.adapters", "--repeat", "1", "--steps", "1", "--side", "32")
    _assert_format(line, ["cold_load_s", "adapter_load_s", "unload_s", "run_s", "adapter_run_s"])


def test_fleet_lock_bench_prints_its_last_line() -> None:
    line = _last_line("bench.fleet_lock", "10")
    _assert_format(line, ["ahead_p50_ms", "ahead_p99_ms", "inside_p50_ms", "inside_p99_ms", "submit_p50_ms"])


def test_suite_cpu_bench_prints_its_last_line() -> None:
    """One small in-process test file, run and accounted (bench/suite_cpu.py)."""
    line = _last_line("bench.suite_cpu", "tests/unit/core/test_variants.py", timeout_s=300)
    _assert_format(line, ["files", "failed", "orphans", "cpu_s"])
    assert line.startswith("files=1 failed=0 "), line
