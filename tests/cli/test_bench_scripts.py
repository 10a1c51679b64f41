"""The benchmarks run from the commands in docs/benchmarks.md and print their last
line in its documented format, so the scripts cannot rot. Tiny parameters: the figures are
not judged here (benchmarks print figures; they never assert timings).

Each bench runs in this process, through its module's ``main(argv)`` (what ``python -m
bench.X ARGV`` calls), its output read with ``capsys``: a fresh interpreter per bench would pay
the imports of torch and diffusers each time. The benches that start a fleet get
``--forkserver``: their ``homefleet serve`` and ``homefleet worker`` processes are forked from
this process's preloaded fork server (app/devtools/forkserver.py, as the e2e fleets are)
instead of exec'd; :func:`forked` checks that they were. Each runs its own Redis (on a free
port), server and (latency, device_start) workers, so they run beside each other and beside any
test on the xdist workers. What a bench changes in this process (torch's thread count, the
environment, diffusers' and transformers' log levels) is put back after each test
(:func:`_process_state`). The suite's own bench (bench/suite_cpu.py) runs pytest, so it stays a
subprocess."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from app.devtools import forkserver

ROOT = Path(__file__).resolve().parents[2]
NUMBER = r"-?\d+(\.\d+)?"


@pytest.fixture(autouse=True)
def _process_state() -> Iterator[None]:
    """Put back what an in-process bench changes for the whole process: torch's CPU threads
    (bench/shapes.py sets them), the environment, diffusers' and transformers' log levels and
    progress bars (``tasks.pipelines.quiet``, bench/adapters.py)."""
    import diffusers.utils.logging as d_log
    import torch
    import transformers.utils.logging as t_log

    threads = torch.get_num_threads()
    environ = dict(os.environ)
    levels = d_log.get_verbosity(), t_log.get_verbosity()
    bars = d_log.is_progress_bar_enabled(), t_log.is_progress_bar_enabled()
    yield
    torch.set_num_threads(threads)
    for name in set(os.environ) - set(environ):
        del os.environ[name]
    os.environ.update(environ)
    d_log.set_verbosity(levels[0])
    t_log.set_verbosity(levels[1])
    for log, enabled in zip((d_log, t_log), bars, strict=True):
        if enabled:
            log.enable_progress_bar()
        else:
            log.disable_progress_bar()


@pytest.fixture
def forked(monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """The ``/proc/PID/cmdline`` of each process the fork server starts during the test, read
    as it starts (a forked process shows the fork server's command line, an exec'd one its own)."""
    cmdlines: list[bytes] = []
    start = forkserver.start

    def recorded(*args: Any, **kwargs: Any) -> forkserver.ForkedProcess:
        process = start(*args, **kwargs)
        try:
            cmdlines.append(Path(f"/proc/{process.pid}/cmdline").read_bytes())
        except OSError as error:  # ended already: the bench fails on it anyway
            cmdlines.append(f"pid {process.pid}: {error}".encode())
        return process

    monkeypatch.setattr(forkserver, "start", recorded)
    return cmdlines


def _last_line(capsys: pytest.CaptureFixture[str], main: Callable[[list[str]], object], *argv: str) -> str:
    """Run ``main(argv)`` here; the last line it printed."""
    main(list(argv))
    out = capsys.readouterr().out
    lines = out.strip().splitlines()
    assert lines, f"{main.__module__} printed nothing"
    return lines[-1]


def _assert_format(line: str, names: list[str]) -> None:
    pattern = " ".join(f"{name}={NUMBER}" for name in names)
    assert re.fullmatch(pattern, line), f"last line {line!r} is not {pattern!r}"


def _assert_forked(cmdlines: list[bytes], at_least: int) -> None:
    assert len(cmdlines) >= at_least, f"{len(cmdlines)} processes forked, expected at least {at_least}"
    for cmdline in cmdlines:
        assert b"multiprocessing.forkserver" in cmdline, cmdline


@pytest.mark.e2e
def test_latency_bench_prints_its_last_line(capsys: pytest.CaptureFixture[str], forked: list[bytes]) -> None:
    from bench import latency

    line = _last_line(capsys, latency.main, "--jobs", "3", "--forkserver")
    _assert_format(line, ["submit_p50_ms", "submit_p99_ms", "celery_p50_ms", "ratio_p50", "auto_p50_ms"])
    _assert_forked(forked, 2)  # the API and the worker


def test_backlog_bench_prints_its_last_line(capsys: pytest.CaptureFixture[str], forked: list[bytes]) -> None:
    from bench import backlog

    line = _last_line(capsys, backlog.main, "--queued", "20", "--samples", "5", "--forkserver")
    _assert_format(line, ["rss_mb", "get_p99_ms", "list_p99_ms", "submit_p99_ms", "reconcile_s", "status_s"])
    _assert_forked(forked, 1)


def test_placement_bench_prints_its_last_line(capsys: pytest.CaptureFixture[str]) -> None:
    from bench import placement

    trace = str(ROOT / "bench" / "traces" / "mixed_50.jsonl")
    line = _last_line(capsys, placement.main, "--trace", trace, "--no-submit", "--moves", "50")
    _assert_format(line, ["worst_auto_vs_best_baseline", "min_closed", "mean_closed", "decision_ms_500"])


def test_shapes_bench_prints_its_last_line(capsys: pytest.CaptureFixture[str]) -> None:
    from bench import shapes

    line = _last_line(capsys, shapes.main, "--images", "2")
    _assert_format(line, ["load_s", "image_s", "colour_ok", "background_ok", "shape_ok", "style_ok"])


def test_webhooks_bench_prints_its_last_line(capsys: pytest.CaptureFixture[str], forked: list[bytes]) -> None:
    from bench import webhooks

    line = _last_line(capsys, webhooks.main, "--jobs", "3", "--backoff", "0.05", "--forkserver")
    _assert_format(
        line, ["delivery_p50_ms", "delivery_p99_ms", "cancel_plain_p50_ms", "cancel_hooked_p50_ms", "retry_ms"]
    )
    _assert_forked(forked, 1)


def test_quota_bench_prints_its_last_line(capsys: pytest.CaptureFixture[str]) -> None:
    from bench import quotas

    line = _last_line(capsys, quotas.main, "30")
    _assert_format(
        line, ["no_quota_p50_ms", "quota_p50_ms", "delta_p50_ms", "no_quota_p90_ms", "quota_p90_ms", "check_p50_ms"]
    )


@pytest.mark.e2e
def test_device_start_bench_prints_its_last_line(capsys: pytest.CaptureFixture[str], forked: list[bytes]) -> None:
    from bench import device_start

    threads = os.environ.get("HOMEFLEET_TORCH_THREADS")
    line = _last_line(capsys, device_start.main, "--rounds", "1", "--forkserver")
    _assert_format(line, ["one_s", "two_s", "ratio"])
    _assert_forked(forked, 4)  # the API, one worker of solo-0, two of duo-0
    assert os.environ.get("HOMEFLEET_TORCH_THREADS") == threads, "the bench left its HOMEFLEET_TORCH_THREADS"


def test_adapters_bench_prints_its_last_line(capsys: pytest.CaptureFixture[str]) -> None:
    from bench import adapters

    line = _last_line(capsys, adapters.main, "--repeat", "1", "--steps", "1", "--side", "32")
    _assert_format(line, ["cold_load_s", "adapter_load_s", "unload_s", "run_s", "adapter_run_s"])


def test_fleet_lock_bench_prints_its_last_line(capsys: pytest.CaptureFixture[str]) -> None:
    from bench import fleet_lock

    line = _last_line(capsys, fleet_lock.main, "10")
    _assert_format(line, ["ahead_p50_ms", "ahead_p99_ms", "inside_p50_ms", "inside_p99_ms", "submit_p50_ms"])


def test_snapshot_progress_bench_prints_its_last_line(capsys: pytest.CaptureFixture[str]) -> None:
    from bench import snapshot_progress

    line = _last_line(capsys, snapshot_progress.main, "4")
    _assert_format(line, ["machines", "every_p50_ms", "server_p50_ms", "without_p50_ms", "per_running_job_us"])


def test_suite_cpu_bench_prints_its_last_line() -> None:
    """One small in-process test file, run and accounted (bench/suite_cpu.py), as a subprocess:
    it runs pytest itself."""
    done = subprocess.run(
        [sys.executable, "-m", "bench.suite_cpu", "tests/unit/core/test_variants.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, (
        f"bench.suite_cpu exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    )
    line = done.stdout.strip().splitlines()[-1]
    _assert_format(line, ["files", "failed", "orphans", "cpu_s"])
    assert line.startswith("files=1 failed=0 "), line
