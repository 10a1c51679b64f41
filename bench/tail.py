"""Where Auto's p95 bounded slowdown exceeds the clairvoyant reference's, job by job
(docs/benchmarks.md, "The tail"). Prints figures; asserts nothing.

    python -m bench.tail --seed S [--moves M] [--above R] [--no-outages] [--follow] [CASE ...]

For each random case (``bench.random_cases``; the listed case seeds, else every case of
``--seed`` whose regret, Auto's p95 bounded slowdown over the reference's, exceeds ``--above``):
the reference (``bench.clairvoyant.reference``, ``--moves`` tried moves per figure, seeded with
every policy's schedule, as ``bench/placement.py --random`` runs it), and Auto's *excess jobs*:
those above the reference's p95 slowdown that the reference keeps at or under it. Each excess
job gets one cause, from Auto's schedule replayed line by line (FIFO per machine, R8):

- ``outage``: its machine was offline at some time between its arrival and its end;
- ``long_job``: one job ahead of it on its machine held the machine over ``LONG_S`` seconds and
  for more than half of its wait; ``_choice`` or ``_forced`` says whether that long job could
  have gone elsewhere, ``_slow`` that it ran there over ``SLOW`` x its bound;
- ``own``: its own load and run there exceed ``SLOW`` x its bound and its wait;
- ``queue``: it waited behind shorter jobs (``_forced``: the excess job itself had no choice:
  default target, pinned, or one able machine; ``_flex``: it had one).

``--no-outages`` also runs each case without its outages and prints that regret (a case whose
regret falls under ``--above`` then needs its outages to exceed it, though its excess jobs may
not have waited through one: an outage moves the other jobs too).

``--follow`` also replays Auto with one kind of job at a time (videos, edits, the rest) placed
where the reference's p95 schedule put it and every other job placed by Auto as it arrives
(:func:`follow`), and prints each such regret and their geometric means over the cases: the
kind whose few decisions carry the regret.
"""

from __future__ import annotations

import argparse
from collections import Counter, defaultdict
from statistics import geometric_mean
from typing import NamedTuple

from bench import clairvoyant
from bench.placement import BOUND_FLOOR_S, MOVES, run_case
from bench.random_cases import case_seeds, random_case
from bench.sim import BENCH, POLICIES, SimFleet, Simulation, Trace, load_fleet_file, lower_bounds, true_factors

LONG_S = 600.0
"""Seconds of machine time from which a job ahead counts as a long job."""

SLOW = 2.0
"""A run over this many times its bound (the job's fastest run anywhere) counts as slow."""


def timeline(p: clairvoyant.Problem, placed: dict[int, str]) -> dict[int, tuple[str, float, float]]:
    """Job -> (machine, start, end), seconds on the trace's clock, of the schedule ``placed``
    (machine per job) replayed as :func:`bench.clairvoyant.replay` runs each line: FIFO, a cold
    model loads first, an offline machine starts nothing."""
    lines: dict[str, list[int]] = {}
    for j in sorted(p.arrival, key=lambda i: (p.arrival[i], i)):
        lines.setdefault(placed.get(j, p.choices[j][0]), []).append(j)
    out = {}
    for m, line in lines.items():
        free_s, warm = 0.0, sorted(p.machines[m][2])
        for j in line:
            start, free_s = clairvoyant.run_next(p, m, j, free_s, warm)
            out[j] = (m, start, free_s)
    return out


def cause(p: clairvoyant.Problem, line: dict[int, tuple[str, float, float]], j: int) -> str:
    """The cause of job ``j``'s slowdown in the schedule ``line`` (:func:`timeline`), as the
    module docstring names them."""
    m, start, end = line[j]
    arrival = p.arrival[j]
    if any(a < end and b > arrival for a, b in p.offline[m]):
        return "outage"
    wait = start - arrival
    ahead = {
        k: min(e, start) - max(s, arrival) for k, (mk, s, e) in line.items() if mk == m and e > arrival and s < start
    }
    if ahead:
        k = max(ahead, key=ahead.__getitem__)
        held = line[k][2] - line[k][1]
        if held > LONG_S and ahead[k] > 0.5 * wait:
            return (
                "long_job"
                + ("_slow" if p.run_s[(k, m)] > SLOW * p.bound[k] else "")
                + ("_choice" if len(p.choices[k]) > 1 else "_forced")
            )
    own = end - start
    if own > SLOW * p.bound[j] and own > wait:
        return "own"
    return "queue_" + ("flex" if len(p.choices[j]) > 1 else "forced")


def excess(
    p: clairvoyant.Problem, auto: dict[int, str], reference: clairvoyant.Schedule, threshold: float
) -> dict[int, str]:
    """Auto's excess jobs (above ``threshold``, the reference's p95 bounded slowdown, where the
    reference keeps them at or under it) -> their :func:`cause`."""
    line = timeline(p, auto)
    slow = {j: (end - p.arrival[j]) / p.bound[j] for j, (_, _, end) in line.items()}
    return {
        j: cause(p, line, j)
        for j in sorted(slow, key=lambda i: -slow[i])
        if slow[j] > threshold and reference.slow.get(j, 0.0) <= threshold
    }


class Versus(NamedTuple):
    """One case's Auto run beside its reference's p95 schedule (:func:`versus`)."""

    factors: dict[tuple[str, str], float]
    bounds: dict[int, float]
    problem: clairvoyant.Problem
    auto_placed: dict[int, str]
    auto_p95: float
    reference: clairvoyant.Schedule


def versus(fleet: SimFleet, trace: Trace, moves: int, seed: int = 0) -> Versus:
    """Every policy run on one case, and the reference's p95 schedule searched from their
    schedules as :func:`bench.placement.run_case` searches it (``moves`` tried moves)."""
    factors = true_factors(fleet)
    bounds = lower_bounds(fleet, trace, factors)
    p = clairvoyant.problem(fleet, trace, factors, bounds, BOUND_FLOOR_S)
    runs = {name: Simulation(fleet, trace, policy, factors).run() for name, policy in POLICIES.items()}
    _, by_p95 = clairvoyant.reference(p, [out.placed_on for out in runs.values()], moves, seed)
    auto_p95 = clairvoyant.slowdown_figures(runs["auto"].completion_s, bounds, BOUND_FLOOR_S)[1]
    return Versus(factors, bounds, p, runs["auto"].placed_on, auto_p95, by_p95)


def diagnose(fleet: SimFleet, trace: Trace, moves: int, seed: int = 0) -> tuple[float, float, dict[int, str]]:
    """(Auto's p95 bounded slowdown, the reference's, Auto's excess jobs with their causes) on
    one case; the reference as :func:`bench.placement.run_case` searches it."""
    v = versus(fleet, trace, moves, seed)
    return v.auto_p95, v.reference.p95, excess(v.problem, v.auto_placed, v.reference, v.reference.p95)


FOLLOWED = {"video": ("video",), "edit": ("edit",), "other": ("txt2img", "upscale", "text")}
"""The job kinds ``--follow`` places as the reference does, one group at a time."""


def follow(fleet: SimFleet, trace: Trace, v: Versus) -> dict[str, float]:
    """Per :data:`FOLLOWED` group, Auto's p95 bounded slowdown when that group's jobs with a
    choice go where the reference's p95 schedule (``v``, :func:`versus` of this case) put them
    and every other job is placed by Auto as it arrives. A group whose figure falls near the
    reference's holds the case's regret."""
    followed = {}
    for group, kinds in FOLLOWED.items():
        placed = {
            j.index: v.reference.placed[j.index]
            for j in trace.jobs
            if j.kind in kinds and j.index in v.reference.placed and len(v.problem.choices[j.index]) > 1
        }
        out = Simulation(fleet, trace, POLICIES["auto"], v.factors, placed=placed).run()
        followed[group] = clairvoyant.slowdown_figures(out.completion_s, v.bounds, BOUND_FLOOR_S)[1]
    return followed


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cases", type=int, nargs="*", help="case seeds (default: every case of --seed above --above)")
    parser.add_argument("--seed", type=int, default=1, help="the seed of the random cases")
    parser.add_argument("--random", type=int, default=200, metavar="N", help="cases of --seed to look through")
    parser.add_argument("--moves", type=int, default=MOVES, help="clairvoyant search: tried moves per figure")
    parser.add_argument("--above", type=float, default=2.0, help="regret (p95 figure) from which a case is shown")
    parser.add_argument("--no-outages", action="store_true", help="also each case's regret without its outages")
    parser.add_argument(
        "--follow", action="store_true", help="also the regret with one kind of job placed as the reference places it"
    )
    args = parser.parse_args(argv)
    catalogue = load_fleet_file(BENCH / "fleet.toml")
    chosen = args.cases
    if not chosen:
        chosen = []
        for case_seed in case_seeds(args.random, args.seed):
            case = random_case(case_seed, catalogue)
            figures = run_case(case.fleet, case.trace, args.moves, case_seed)
            if figures["auto_p95"] / figures["ref_p95"] > args.above:
                chosen.append(case_seed)
    totals: Counter[str] = Counter()
    regrets: dict[str, list[float]] = defaultdict(list)
    for case_seed in chosen:
        case = random_case(case_seed, catalogue)
        v = versus(case.fleet, case.trace, args.moves, case_seed)
        auto_p95, ref_p95 = v.auto_p95, v.reference.p95
        found = excess(v.problem, v.auto_placed, v.reference, ref_p95)
        causes = Counter(found.values())
        totals.update(causes)
        line = (
            f"case {case_seed} regret_p95={auto_p95 / ref_p95:.3f} (auto {auto_p95:.2f}, reference {ref_p95:.2f}) "
            f"outages={len(case.trace.offline)} excess_jobs={len(found)} "
            + " ".join(f"{c}={n}" for c, n in sorted(causes.items()))
        )
        if args.no_outages and case.trace.offline:
            calm = Trace(case.trace.name, {**case.trace.header, "offline": []}, case.trace.jobs)
            calm_auto, calm_ref, _ = diagnose(case.fleet, calm, args.moves, case_seed)
            line += f" regret_without_outages={calm_auto / calm_ref:.3f}"
        if args.follow:
            followed = follow(case.fleet, case.trace, v)
            regrets["none"].append(auto_p95 / ref_p95)
            for group, p95 in followed.items():
                regrets[group].append(p95 / ref_p95)
                line += f" following_{group}={p95 / ref_p95:.3f}"
        print(line, flush=True)
    if regrets:
        means = {("alone" if g == "none" else f"following_{g}"): geometric_mean(v) for g, v in regrets.items()}
        print("regret_p95 over these cases (geometric mean): " + " ".join(f"{k}={v:.3f}" for k, v in means.items()))
    print(
        f"\n== {len(chosen)} cases, excess jobs {sum(totals.values())}: "
        + " ".join(f"{c}={n}" for c, n in sorted(totals.items()))
    )


if __name__ == "__main__":
    main()
