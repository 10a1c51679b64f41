"""Screening a change to Auto in seconds: Auto alone over random cases, against baselines and
clairvoyant references computed once and kept in a file (docs/benchmarks.md, "Screening a
change"). Prints figures; asserts nothing.

    python -m bench.screen --seed S[,S...] [--cases N] [--moves M] [--no-outages] [--refresh] [--cache PATH]
                           [--bootstrap R]

A full ``bench/placement.py --random`` run searches a reference for every case anew (about
three minutes for 200 cases); between two versions of the routing code only Auto's schedule
changes. The first screen of a (seed, cases, moves, outages) runs :func:`bench.placement.run_case`
on every case, as the full run does, and keeps each case's figures in ``--cache`` (default
``bench/.screen/<seed>-<cases>-<moves>[-no-outages].json``, ignored by git) with the commit
they were computed at. Every screen then replays Auto alone on each case (about 20 s for 200)
and prints the distributions the full run prints (:func:`bench.placement.distribution_lines`).
Several seeds print each seed's distributions, then the same over all their cases pooled.
``--bootstrap R`` adds, per regret figure, how many cases exceed the goal's 2x and a 90 %
interval of the cases' p95 over ``R`` resamples of the cases (with replacement): how far one
draw of 200 cases can move that figure.

The kept reference was seeded with the Auto of the commit that computed it; a full run seeds
its search with the Auto being judged. A case where the new Auto does better than the kept
reference counts the new Auto as the reference (regret 1), so a screen's regret can differ from
a full run's by what the search would find from the new schedule: screen to choose, then judge
with the full run. ``--refresh`` recomputes the file (after a change to the simulator, the
baselines or the cases, which the file does not detect).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import subprocess
import time
from pathlib import Path

from bench import clairvoyant
from bench.placement import BOUND_FLOOR_S, RANDOM_MOVES, distribution_lines, run_case
from bench.random_cases import Case, case_seeds, random_case
from bench.sim import BENCH, POLICIES, Simulation, Trace, load_fleet_file, lower_bounds, percentile, true_factors

CACHE_DIR = BENCH / ".screen"
REGRET_GOAL = 2.0
"""The regret's goal at the cases' 95th percentile (docs/benchmarks.md, "Random fleets")."""
KEPT = ("best_mean", "best_p95", "ref_mean", "ref_p95", "auto_mean", "auto_p95")
"""The figures of :func:`bench.placement.run_case` a cache keeps per case (``auto_*``: the Auto
that seeded the reference, printed beside the new one)."""


def without_outages(case: Case) -> Case:
    """``case`` with every machine online throughout (its trace's outages removed)."""
    trace = case.trace
    return dataclasses.replace(case, trace=Trace(trace.name, {**trace.header, "offline": []}, trace.jobs))


def cases(seed: int, n: int, outages: bool) -> list[Case]:
    """The ``n`` random cases of ``seed`` (``bench.random_cases``), without outages when asked."""
    catalogue = load_fleet_file(BENCH / "fleet.toml")
    found = [random_case(case_seed, catalogue) for case_seed in case_seeds(n, seed)]
    return found if outages else [without_outages(c) for c in found]


def commit() -> str:
    """The repository's commit (``+`` when the work tree has changes), or ``unknown``."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=BENCH, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=BENCH, capture_output=True, text=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+" if dirty else "")


def build(found: list[Case], moves: int) -> dict[str, dict[str, float]]:
    """Case seed (a string, as JSON keeps it) -> the :data:`KEPT` figures of
    :func:`bench.placement.run_case` (``moves`` search moves per figure)."""
    return {
        str(case.seed): {k: v for k, v in run_case(case.fleet, case.trace, moves, case.seed).items() if k in KEPT}
        for case in found
    }


def load_or_build(path: Path, found: list[Case], moves: int, refresh: bool) -> dict:
    """The cache at ``path`` (``{"commit", "made", "cases": {seed: figures}}``), built first when
    missing, asked to be refreshed, or lacking one of ``found``'s cases."""
    if path.exists() and not refresh:
        kept = json.loads(path.read_text())
        if all(str(c.seed) in kept["cases"] for c in found):
            return kept
    started = time.perf_counter()
    kept = {"commit": commit(), "made": time.strftime("%Y-%m-%d %H:%M"), "cases": build(found, moves)}
    kept["build_s"] = round(time.perf_counter() - started, 1)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(kept, indent=1, sort_keys=True))
    return kept


def auto_figures(case: Case) -> tuple[float, float]:
    """Auto's (mean, p95) bounded slowdown on ``case``, simulated as the full run does."""
    factors = true_factors(case.fleet)
    bounds = lower_bounds(case.fleet, case.trace, factors)
    out = Simulation(case.fleet, case.trace, POLICIES["auto"], factors).run()
    return clairvoyant.slowdown_figures(out.completion_s, bounds, BOUND_FLOOR_S)


def screen(seed: int, n: int, moves: int, outages: bool, refresh: bool, cache: Path | None = None) -> list[dict]:
    """Auto's figures on the ``n`` cases of ``seed`` against the kept ones; prints the
    distributions and returns the rows (:func:`bench.placement.distribution_lines`'s keys, and
    ``kept_auto_mean`` / ``kept_auto_p95``: the Auto that seeded the reference)."""
    found = cases(seed, n, outages)
    path = cache or CACHE_DIR / f"{seed}-{n}-{moves}{'' if outages else '-no-outages'}.json"
    kept = load_or_build(path, found, moves, refresh)
    started = time.perf_counter()
    rows = []
    for case in found:
        figures = kept["cases"][str(case.seed)]
        mean, p95 = auto_figures(case)
        rows.append(
            {
                "seed": case.seed,
                "auto_mean": mean,
                "auto_p95": p95,
                "best_mean": figures["best_mean"],
                "best_p95": figures["best_p95"],
                "ref_mean": min(figures["ref_mean"], mean),
                "ref_p95": min(figures["ref_p95"], p95),
                "kept_auto_mean": figures["auto_mean"],
                "kept_auto_p95": figures["auto_p95"],
            }
        )
    print(
        f"== screen: {n} cases from seed {seed}{'' if outages else ' without outages'} "
        f"({time.perf_counter() - started:.0f} s); references of {moves} moves kept in {path} at commit "
        f"{kept['commit']} ({kept['made']})"
    )
    for line in distribution_lines(rows):
        print(line)
    changed = sum(1 for r in rows if (r["auto_mean"], r["auto_p95"]) != (r["kept_auto_mean"], r["kept_auto_p95"]))
    print(f"cases where Auto's figures differ from the kept Auto's: {changed} of {n}")
    return rows


def bootstrap_lines(rows: list[dict], resamples: int, seed: int = 0) -> list[str]:
    """Per figure (mean, p95 bounded slowdown), the cases whose regret (Auto / reference)
    exceeds :data:`REGRET_GOAL`, the regret at the cases' p95 (as
    :func:`bench.placement.distribution_lines` takes it) and the 5th and 95th percentiles of
    that p95 over ``resamples`` resamples of the cases with replacement (``seed`` fixes them)."""
    rng = random.Random(seed)
    lines = []
    for figure in ("mean", "p95"):
        regret = [r[f"auto_{figure}"] / r[f"ref_{figure}"] for r in rows]
        over = sum(1 for v in regret if v > REGRET_GOAL)
        drawn = sorted(percentile(rng.choices(regret, k=len(regret)), 0.95) for _ in range(resamples))
        lines.append(
            f"{figure:<5} auto/reference cases over {REGRET_GOAL:g}: {over} of {len(regret)}; at the cases' p95 "
            f"{percentile(regret, 0.95):.3f}, 90 % of {resamples} resamples within "
            f"{percentile(drawn, 0.05):.3f}-{percentile(drawn, 0.95):.3f}"
        )
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--seed",
        type=lambda text: [int(part) for part in text.split(",")],
        default=[1],
        help="the seed of the random cases (tune on 1 and 3), or several, comma-separated, then also pooled",
    )
    parser.add_argument("--cases", type=int, default=200, help="how many cases")
    parser.add_argument("--moves", type=int, default=RANDOM_MOVES, help="clairvoyant search moves per figure")
    parser.add_argument("--no-outages", action="store_true", help="every machine online throughout")
    parser.add_argument("--refresh", action="store_true", help="recompute the kept figures")
    parser.add_argument("--cache", type=Path, help="the file of kept figures (one seed only)")
    parser.add_argument("--bootstrap", type=int, default=0, metavar="R", help="resamples of the cases (0: none)")
    args = parser.parse_args(argv)
    if args.cache is not None and len(args.seed) > 1:
        parser.error("--cache names one seed's file: give one --seed with it")
    pooled = []
    for seed in args.seed:
        rows = screen(seed, args.cases, args.moves, not args.no_outages, args.refresh, args.cache)
        if args.bootstrap:
            print("\n".join(bootstrap_lines(rows, args.bootstrap)))
        pooled += rows
    if len(args.seed) > 1:
        print(f"== pooled: {len(pooled)} cases from seeds {','.join(map(str, args.seed))}")
        print("\n".join(distribution_lines(pooled)))
        if args.bootstrap:
            print("\n".join(bootstrap_lines(pooled, args.bootstrap)))


if __name__ == "__main__":
    main()
