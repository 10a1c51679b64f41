"""A reachable reference for the placement benchmark: the best schedule an offline search
finds when it knows the whole trace and every true run and load time (``bench/placement.py``).

The schedule keeps the server's rules: every job goes to one machine at its arrival, among the
machines Auto could choose then (online, filters passed: ``routing.placement.exclusion``), and
each machine runs its line first in, first out (R8) with the simulator's residency
(``residency.policy.admit``) and outages. Jobs with no choice (default target, pinned, or one
able machine) stay where they must. Given the machine of every job, each machine's completions
follow exactly (``MachineLine``), so the search moves one job at a time and replays only the
two lines it touched.

The search (``reference``): seeded with the given schedules (Auto's and the baselines', as the
simulator ran them) and a clairvoyant greedy (each job, in arrival order, on the machine where
it finishes first), it keeps the best seed and improves it by local search (a job moved to
another machine, or two jobs swapped), accepting a move only when it lowers the objective. Two
objectives, each its own search: the mean bounded slowdown, and the p95 bounded slowdown (ties
broken by the mean). A search never returns worse than its best seed, so the reference is at
least as good as every seeded policy on both figures. The budget is a number of tried moves,
so a run is repeatable.
"""

from __future__ import annotations

import bisect
import random
from dataclasses import dataclass

from bench.sim import SimFleet, Simulation, Trace, TraceJob, least_queue, percentile
from residency.policy import admit
from routing.finish import working_of
from routing.placement import AUTO, exclusion

P95 = 0.95


@dataclass(frozen=True)
class Problem:
    """Everything the search needs, in true times: per job its arrival, bound (seconds,
    ``max(lower bound, floor)``) and able machines (one: forced); per (job, machine) its true
    run seconds; per (machine, model) its true load seconds; per machine its outages."""

    arrival: dict[int, float]
    bound: dict[int, float]
    choices: dict[int, tuple[str, ...]]
    model: dict[int, str]
    run_s: dict[tuple[int, str], float]
    working: dict[int, int]
    load_s: dict[tuple[str, str], float]
    offline: dict[str, list[tuple[float, float]]]
    machines: dict[str, tuple[str, int, frozenset[str]]]  # name -> (memory kind, usable bytes, commitments)
    weights: dict[str, int]


def problem(
    fleet: SimFleet, trace: Trace, factors: dict[tuple[str, str], float], bounds: dict[int, float], floor_s: float
) -> Problem:
    """The jobs the simulator accepts (a job whose target, or every machine, is excluded at its
    arrival is refused there, as in :class:`bench.sim.Simulation`) and their true costs."""
    sim = Simulation(fleet, trace, least_queue, factors)
    offline: dict[str, list[tuple[float, float]]] = {n: [] for n in fleet.machines}
    for machine, a, b in trace.offline:
        offline[machine].append((a, b))
    for spans in offline.values():
        spans.sort()

    def online(name: str, t: float) -> bool:
        return not any(a <= t < b for a, b in offline[name])

    views = sim.views()
    arrival, bound, choices, model, run_s, working = {}, {}, {}, {}, {}, {}
    for job in trace.jobs:
        request = sim.request(job)
        able = [n for n, v in views.items() if exclusion(request, v, sim.estimator) is None]
        now = [n for n in able if online(n, job.t_s)]
        if job.target != AUTO:
            now = [job.target] if job.target in now else []
        if not now:
            continue  # refused at arrival
        arrival[job.index], bound[job.index], model[job.index] = job.t_s, max(bounds[job.index], floor_s), job.model_id
        choices[job.index] = tuple(sorted(now))
        working[job.index] = working_of(sim.truth, job.model_id, job.kind, job.size)
        for n in now:
            run_s[(job.index, n)] = sim.true_run_s(n, job)
    load_s = {(n, m): sim.true_load_s(n, m, fleet.kinds[m]) for n in fleet.machines for m in fleet.models}
    machines = {
        n: (str(c.memory_kind), c.memory_bytes, fleet.commitments.get(n, frozenset()))
        for n, c in fleet.machines.items()
    }
    return Problem(
        arrival,
        bound,
        choices,
        model,
        run_s,
        working,
        load_s,
        offline,
        machines,
        {m: sim.truth.weights_bytes(m) for m in fleet.models},
    )


def start_s(p: Problem, machine: str, j: int, free_s: float) -> float:
    """When job ``j`` starts on ``machine`` free from ``free_s`` (trace seconds): once it has
    arrived, the job before it is done and the machine is online."""
    start = max(free_s, p.arrival[j])
    for a, b in p.offline[machine]:
        if a <= start < b:
            start = b
    return start


def run_next(p: Problem, machine: str, j: int, free_s: float, warm: list[str]) -> tuple[float, float]:
    """Job ``j`` run next on ``machine``, free from ``free_s`` with ``warm`` models: (start,
    end), trace seconds; a cold model loads first (true load seconds), and ``warm`` is updated in
    place as residency admits the job's model (R15)."""
    kind, usable, protected = p.machines[machine]
    start = start_s(p, machine, j, free_s)
    model = p.model[j]
    cold = model not in warm
    admit(
        warm,
        model,
        memory_kind=kind,
        usable_bytes=usable,
        protected=protected,
        weights_bytes=p.weights.__getitem__,
        working_bytes=p.working[j],
    )
    return start, start + (p.load_s[(machine, model)] if cold else 0.0) + p.run_s[(j, machine)]


def replay(
    p: Problem,
    machine: str,
    jobs: list[int],
    state: tuple[float, tuple[str, ...]] | None = None,
    states: list[tuple[float, tuple[str, ...]]] | None = None,
) -> list[float]:
    """Bounded slowdowns of ``jobs`` (in arrival order) run FIFO on ``machine``: a job starts
    when it has arrived, the one before it is done and the machine is online; a cold model
    loads first (true load seconds), as :class:`bench.sim.Simulation` runs it. ``state``: the
    machine's (free from, warm models) before the first of ``jobs`` (None: idle, its
    commitments warm); ``states``, when given, gets the state after each job appended."""
    free_s, warm_models = state if state is not None else (0.0, tuple(sorted(p.machines[machine][2])))
    warm = list(warm_models)
    out = []
    for j in jobs:
        _, free_s = run_next(p, machine, j, free_s, warm)
        out.append((free_s - p.arrival[j]) / p.bound[j])
        if states is not None:
            states.append((free_s, tuple(warm)))
    return out


class Schedule:
    """A machine per accepted job, each machine's line in arrival order, and every job's
    bounded slowdown under it."""

    def __init__(self, p: Problem, placed: dict[int, str]) -> None:
        self.p = p
        self.lines: dict[str, list[int]] = {n: [] for n in p.machines}
        self.placed = {}
        for j in sorted(p.arrival, key=lambda i: (p.arrival[i], i)):
            m = placed.get(j)
            if m not in p.choices[j]:
                m = p.choices[j][0]
            self.placed[j] = m
            self.lines[m].append(j)
        self.slow: dict[int, float] = {}
        self.states: dict[str, list[tuple[float, tuple[str, ...]]]] = {}  # per line: the state after each job
        for m, line in self.lines.items():
            self.states[m] = []
            self.slow.update(zip(line, replay(p, m, line, None, self.states[m]), strict=False))
        self.total = sum(self.slow.values())
        self.sorted = sorted(self.slow.values())

    @property
    def mean(self) -> float:
        return self.total / max(len(self.slow), 1)

    @property
    def p95(self) -> float:
        return self.sorted[min(len(self.sorted) - 1, int(P95 * len(self.sorted)))] if self.sorted else float("nan")

    def key(self, j: int) -> tuple[float, int]:
        return (self.p.arrival[j], j)

    def trial(self, changes: dict[int, str]) -> tuple[dict[int, float], dict[str, list[int]], dict]:
        """If ``changes`` (job -> machine) were made: the new slowdowns of the jobs whose
        completion may change (those from the first changed place of each touched line on),
        the touched lines, and per line (first changed place, the states from there)."""
        # sorted: the touched lines' order sets the order of float sums, and a set's order
        # follows the string hash, which changes with PYTHONHASHSEED (a run must repeat exactly)
        touched = sorted({self.placed[j] for j in changes} | set(changes.values()))
        lines: dict[str, list[int]] = {}
        replayed: dict[str, tuple[int, list[tuple[float, tuple[str, ...]]]]] = {}
        slow: dict[int, float] = {}
        for m in touched:
            old = self.lines[m]
            line = [j for j in old if j not in changes]
            for j, to in changes.items():
                if to == m:
                    bisect.insort(line, j, key=self.key)
            changed = (i for i, (a, b) in enumerate(zip(old, line, strict=False)) if a != b)
            first = next(changed, min(len(old), len(line)))
            states: list[tuple[float, tuple[str, ...]]] = []
            before = self.states[m][first - 1] if first > 0 else None
            slow.update(zip(line[first:], replay(self.p, m, line[first:], before, states), strict=False))
            lines[m], replayed[m] = line, (first, states)
        return slow, lines, replayed

    def figures_after(self, slow: dict[int, float], lines: dict[str, list[int]], replayed: dict) -> tuple[float, float]:
        """(mean, p95) of the schedule with ``slow`` replacing the touched lines' slowdowns."""
        old = [self.slow[j] for m in lines for j in self.lines[m][replayed[m][0] :]]
        total = self.total - sum(old) + sum(slow.values())
        ordered = list(self.sorted)
        for v in old:
            del ordered[bisect.bisect_left(ordered, v)]
        for v in slow.values():
            bisect.insort(ordered, v)
        n = max(len(ordered), 1)
        return total / n, ordered[min(n - 1, int(P95 * n))]

    def commit(
        self, changes: dict[int, str], slow: dict[int, float], lines: dict[str, list[int]], replayed: dict
    ) -> None:
        for m in lines:
            first, states = replayed[m]
            for j in self.lines[m][first:]:
                v = self.slow.pop(j)
                del self.sorted[bisect.bisect_left(self.sorted, v)]
                self.total -= v
            self.states[m] = self.states[m][:first] + states
        for j, v in slow.items():
            self.slow[j] = v
            bisect.insort(self.sorted, v)
            self.total += v
        self.lines.update(lines)
        self.placed.update(changes)


def greedy(p: Problem) -> dict[int, str]:
    """Each job in arrival order on the machine where it (knowing true times) finishes first."""
    state = {n: (0.0, sorted(p.machines[n][2])) for n in p.machines}
    placed = {}
    for j in sorted(p.arrival, key=lambda i: (p.arrival[i], i)):
        best = None
        for m in p.choices[j]:
            free_s, warm = state[m]
            start = start_s(p, m, j, free_s)
            done = start + (0.0 if p.model[j] in warm else p.load_s[(m, p.model[j])]) + p.run_s[(j, m)]
            if best is None or done < best[0]:
                best = (done, m)
        assert best is not None
        m = best[1]
        warm = list(state[m][1])
        _, done = run_next(p, m, j, state[m][0], warm)
        state[m] = (done, warm)
        placed[j] = m
    return placed


def search(
    p: Problem,
    seeds: list[dict[int, str]],
    objective: str,
    moves: int,
    seed: int = 0,
    mean_cap: float | None = None,
) -> Schedule:
    """Local search from the best of ``seeds`` (machine per job) by ``objective`` (``mean``,
    or ``p95`` with ties broken by the mean): ``moves`` tried moves (a job to another of its
    machines, or two jobs on different machines swapped), each kept only if it lowers the
    objective. Never worse than the best seed.

    ``mean_cap``: only schedules whose mean bounded slowdown is at most this count (the p95 at
    no cost to the mean: a p95 search may otherwise buy its figure by making the jobs already
    above it wait longer still); a seed over the cap is kept only when no seed meets it."""

    def score(mean: float, p95: float) -> tuple[float, float]:
        if mean_cap is not None and mean > mean_cap * (1 + 1e-12):
            return (float("inf"), mean)
        return (mean, p95) if objective == "mean" else (p95, mean)

    schedules = [Schedule(p, s) for s in seeds]
    best = min(schedules, key=lambda s: score(s.mean, s.p95))
    flexible = [j for j, c in p.choices.items() if len(c) > 1]
    if not flexible:
        return best
    rng = random.Random(seed)
    current = score(best.mean, best.p95)
    for _ in range(moves):
        if rng.random() < 0.5:
            # a job that waits long (its slowdown among the worst), or any job
            j = max(rng.sample(flexible, min(4, len(flexible))), key=best.slow.__getitem__)
        else:
            j = rng.choice(flexible)
        others = [m for m in p.choices[j] if m != best.placed[j]]
        to = rng.choice(others)
        changes = {j: to}
        if rng.random() < 0.3:  # a swap: a job on the target line, able to run where j was
            swap = [k for k in best.lines[to] if best.placed[j] in p.choices[k] and len(p.choices[k]) > 1]
            if swap:
                changes[rng.choice(swap)] = best.placed[j]
        slow, lines, replayed = best.trial(changes)
        after = score(*best.figures_after(slow, lines, replayed))
        if after < current:
            best.commit(changes, slow, lines, replayed)
            current = after
    return best


def reference(p: Problem, seeds: list[dict[int, str]], moves: int, seed: int = 0) -> tuple[Schedule, Schedule]:
    """(best schedule found by mean bounded slowdown, best by p95 bounded slowdown): seeded
    with ``seeds`` and the clairvoyant :func:`greedy`, ``moves`` tried moves each."""
    seeds = [*seeds, greedy(p)]
    by_mean = search(p, seeds, "mean", moves, seed)
    by_p95 = search(p, [*seeds, dict(by_mean.placed)], "p95", moves, seed + 1)
    return by_mean, by_p95


def slowdown_figures(completion_s: dict[int, float], bounds: dict[int, float], floor_s: float) -> tuple[float, float]:
    """(mean, p95) bounded slowdown of a simulated run (``percentile`` as the benchmark's)."""
    slow = [done / max(bounds[i], floor_s) for i, done in completion_s.items()]
    return sum(slow) / max(len(slow), 1), percentile(slow, P95)


__all__ = ["Problem", "Schedule", "TraceJob", "greedy", "problem", "reference", "replay", "search", "slowdown_figures"]
