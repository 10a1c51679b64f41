"""Where the test suite's CPU goes: each test file run on its own, with its CPU accounted.

Usage::

    .venv/bin/python bench/suite_cpu.py                  # every tier but unit file by file, unit in one go
    .venv/bin/python bench/suite_cpu.py tests/e2e/test_sync.py tests/drills   # only these
    .venv/bin/python bench/suite_cpu.py --top 20 --json out.json

The last line: ``files=N failed=F orphans=O cpu_s=X`` (F: files whose run failed; O: orphaned
descendants reaped here).

Each file runs as ``python -m pytest -q -p no:cacheprovider FILE`` in its own process; its CPU is
the user + system seconds of that process and of every descendant (this process's
``RUSAGE_CHILDREN`` before and after). A descendant orphaned before it was reaped (the fork
server of ``app/devtools/forkserver.py``, which forks the fleets' API and worker processes and
CLI calls, outlives pytest by a moment) would be lost: this process makes itself their
subreaper (``PR_SET_CHILD_SUBREAPER``) and reaps them before the file's figure is read, so the
files run one at a time. Each file pays the session fixtures it
uses (its own Redis, the tiny models: a few CPU-seconds) that one ``make test`` worker pays once.

CPU seconds rather than wall seconds: they hardly change with the machine's load (other
processes), wall time does. The figures are printed, never asserted (docs/benchmarks.md,
"The test suite").
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: file by file: these tiers; tests/unit runs in one process (its files are in-process and small)
FILE_TIERS = ("tests/e2e", "tests/integration", "tests/cli", "tests/drills", "tests/netns", "tests/fuzz")


PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> None:
    """Orphaned descendants are re-parented to this process (Linux), so their CPU is counted."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")


def reap_orphans(grace_s: float = 120.0) -> int:
    """Wait for every child left (orphans re-parented here), killing those alive after
    ``grace_s``; the number reaped."""
    reaped, deadline = 0, time.monotonic() + grace_s
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return reaped
        if pid:
            reaped += 1
        elif time.monotonic() > deadline:
            for line in os.popen(f"pgrep -P {os.getpid()}").read().split():
                os.kill(int(line), 9)  # our own children only: what the file's run left behind
            deadline = time.monotonic() + grace_s
        else:
            time.sleep(0.1)


def run_one(target: str, timeout_s: float) -> dict[str, object]:
    """Run pytest on ``target``; ``{target, group, cpu_s, user_s, sys_s, wall_s, rc, orphans, summary}``."""
    command = [sys.executable, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider", target]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.monotonic()
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    timer = threading.Timer(timeout_s, process.kill)
    timer.start()
    assert process.stdout is not None
    output = process.stdout.read()
    _, status = os.waitpid(process.pid, 0)
    timer.cancel()
    process.returncode = os.waitstatus_to_exitcode(status)
    orphans = reap_orphans()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    user, system = after.ru_utime - before.ru_utime, after.ru_stime - before.ru_stime
    lines = [line for line in output.splitlines() if line.strip()]
    return {
        "target": target,
        "group": group_of(target),
        "cpu_s": round(user + system, 1),
        "user_s": round(user, 1),
        "sys_s": round(system, 1),
        "wall_s": round(time.monotonic() - started, 1),
        "rc": process.returncode,
        "orphans": orphans,
        "summary": lines[-1] if lines else "",
        "failures": [line for line in lines if line.startswith(("FAILED", "ERROR"))],
    }


def number(row: dict[str, object], key: str) -> float:
    """A row's figure ``key`` as a float."""
    value = row[key]
    assert isinstance(value, int | float), (key, value)
    return float(value)


def group_of(target: str) -> str:
    """The tier (``e2e``, ``integration``, ``unit``...) a target belongs to."""
    parts = Path(target).parts
    return parts[1] if len(parts) > 1 and parts[0] == "tests" else target


def targets_of(paths: list[str]) -> list[str]:
    """Expand folders of :data:`FILE_TIERS` to their ``test_*.py`` files; others pass as given."""
    if not paths:
        paths = ["tests/unit", *FILE_TIERS]
    out: list[str] = []
    for path in paths:
        folder = ROOT / path
        if folder.is_dir() and path.rstrip("/") != "tests/unit":
            out += sorted(p.relative_to(ROOT).as_posix() for p in folder.rglob("test_*.py"))
        else:
            out.append(path)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="*", help="files or folders (default: the whole suite)")
    parser.add_argument("--top", type=int, default=20, help="rows of the table (files by CPU)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds before a file's run is killed")
    parser.add_argument("--json", type=Path, help="also write every row here")
    args = parser.parse_args()

    targets = targets_of(args.paths)
    become_subreaper()
    rows: list[dict[str, object]] = []
    for target in targets:  # one at a time: orphans are reaped into the file that left them
        row = run_one(target, args.timeout)
        rows.append(row)
        print(
            f"{row['cpu_s']:8.1f} CPU-s {row['wall_s']:8.1f} s rc={row['rc']} orphans={row['orphans']}  "
            f"{row['target']}  {row['summary']}",
            flush=True,
        )
        for line in row["failures"]:  # type: ignore[attr-defined]
            print(f"    {line}", flush=True)
    rows.sort(key=lambda row: -number(row, "cpu_s"))
    total = sum(number(row, "cpu_s") for row in rows)
    print(f"\nTop {args.top} of {len(rows)} by CPU seconds (user + sys, the run and its reaped children)")
    print("| file | CPU-s | user | sys | wall s | result |\n|---|---|---|---|---|---|")
    for row in rows[: args.top]:
        print(
            f"| {row['target']} | {row['cpu_s']} | {row['user_s']} | {row['sys_s']} | {row['wall_s']} | "
            f"{row['summary']} |"
        )
    groups: dict[str, float] = {}
    for row in rows:
        groups[str(row["group"])] = groups.get(str(row["group"]), 0.0) + number(row, "cpu_s")
    print("\n| tier | CPU-s |\n|---|---|")
    for name, cpu in sorted(groups.items(), key=lambda item: -item[1]):
        print(f"| {name} | {cpu:.1f} |")
    print(f"| total | {total:.1f} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    failed = sum(1 for row in rows if row["rc"] not in (0, 5))  # 5: no test collected
    orphans = sum(int(number(row, "orphans")) for row in rows)
    print(f"files={len(rows)} failed={failed} orphans={orphans} cpu_s={total:.1f}")


if __name__ == "__main__":
    main()
