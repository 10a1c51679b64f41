"""The placement simulator's parts: fleet and trace files, a virtual-clock fleet, and the
policies compared (Auto = the production ``routing.placement.place``; baselines use the same
filters). Used by ``bench/placement.py`` and ``bench/make_traces.py``.

Ground truth: a job's true run seconds are the fleet file's guess times a fixed factor per
(machine, model) (lognormal, sigma 0.2, seed 7) times a per-job factor (uniform 0.9-1.1, from
the trace's seed), so Auto starts from imperfect guesses and learns (R13).
"""

from __future__ import annotations

import heapq
import json
import random
import tomllib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from app.fleet.config import Machine
from residency.policy import admit
from routing.demand import Demand, Pressure, pinned_class
from routing.errors import Refused
from routing.estimate import Estimator, MachineProfile, ModelProfile
from routing.finish import Drains, WorkItem, working_of
from routing.placement import AUTO, JobRequest, MachineView, best_move, exclusion, place
from routing.scarcity import Scarcity
from routing.timings import LearnedTimings, job_size

BENCH = Path(__file__).resolve().parent


@dataclass(frozen=True)
class SimFleet:
    machines: dict[str, Machine]
    models: dict[str, ModelProfile]
    kinds: dict[str, str]  # model -> kind
    # machine -> models it must keep resident (R16): warm from the start, never evicted, and
    # placement's residency filters apply (``MachineView.commitments``). Random fleets only.
    commitments: dict[str, frozenset[str]] = field(default_factory=dict)

    def estimator(self, learned: LearnedTimings | None = None) -> Estimator:
        profiles = {
            n: MachineProfile(n, m.speed, m.load_bytes_per_s, str(m.memory_kind), m.memory_bytes)
            for n, m in self.machines.items()
        }
        return Estimator(profiles, self.models, learned or LearnedTimings())


def load_fleet_file(path: Path) -> SimFleet:
    data = tomllib.loads(path.read_text())
    machines = {m["name"]: Machine.model_validate(m) for m in data["machines"]}
    models = {
        m["id"]: ModelProfile(
            m["id"], m["family"], int(m["weights_bytes"]), m.get("step_s"), m["kind"], m.get("load_s")
        )
        for m in data["models"]
    }
    return SimFleet(machines, models, {m["id"]: m["kind"] for m in data["models"]})


@dataclass(frozen=True)
class TraceJob:
    index: int
    t_s: float
    model_id: str
    kind: str
    steps: int
    size: int
    target: str
    noise: float  # true run time factor of this job


@dataclass
class Trace:
    name: str
    header: dict
    jobs: list[TraceJob]

    @property
    def offline(self) -> list[tuple[str, float, float]]:
        return [(o["machine"], o["from_s"], o["to_s"]) for o in self.header.get("offline", [])]


def load_trace(path: Path) -> Trace:
    lines = path.read_text().splitlines()
    header = json.loads(lines[0])
    jobs = []
    for i, line in enumerate(lines[1:]):
        j = json.loads(line)
        size = job_size(j["width"] * j["height"], j.get("frames", 1), j.get("batch", 1))
        jobs.append(TraceJob(i, j["t"], j["model"], j["kind"], j["steps"], size, j["target"], j["noise"]))
    return Trace(header.get("name", path.stem), header, jobs)


def true_factors(fleet: SimFleet, seed: int = 7) -> dict[tuple[str, str], float]:
    rng = random.Random(seed)
    return {(m, model): rng.lognormvariate(0.0, 0.2) for m in sorted(fleet.machines) for model in sorted(fleet.models)}


@dataclass
class SimMachine:
    name: str
    queue: list[TraceJob] = field(default_factory=list)  # FIFO, not yet started
    running: TraceJob | None = None
    started_s: float = 0.0
    warm: list[str] = field(default_factory=list)  # LRU order, most recent last
    online: bool = True
    measured: tuple[float, float, bool] = (0.0, 0.0, False)  # the running job's (load_s, run_s, cold)
    # What the worker reports while it cold-loads the running job's model: the warm models as
    # before (a worker reports a model warm once loaded, tasks/run_job.py), until loaded_s.
    reported_warm: tuple[str, ...] = ()
    loaded_s: float = 0.0


@dataclass
class Outcome:
    completion_s: dict[int, float] = field(default_factory=dict)
    placed_on: dict[int, str] = field(default_factory=dict)
    rejected: int = 0
    cold_loads: int = 0
    evictions: int = 0
    moves: int = 0


Policy = Callable[[JobRequest, dict[str, MachineView], "Simulation"], str]


class Simulation:
    """One trace on one fleet under one policy, on a virtual clock (seconds)."""

    def __init__(
        self,
        fleet: SimFleet,
        trace: Trace,
        policy: Policy,
        factors: dict[tuple[str, str], float],
        moves: bool = False,
        placed: dict[int, str] | None = None,
    ) -> None:
        """``moves``: when a machine falls idle, move a queued Auto job onto it where
        :func:`routing.placement.best_move` says so (a proposal: the server does not move jobs).
        ``placed``: job index -> machine for Auto jobs placed there instead of by ``policy`` (a
        what-if: another schedule's choice for some jobs, ``bench/tail.py --follow``)."""
        self.fleet, self.trace, self.policy, self.factors, self.moves = fleet, trace, policy, factors, moves
        self.placed = placed or {}
        self.machines = {n: SimMachine(n, warm=sorted(fleet.commitments.get(n, ()))) for n in fleet.machines}
        self.learned = LearnedTimings()
        self.estimator = fleet.estimator(self.learned)
        self.truth = fleet.estimator()
        self.now_s = 0.0
        self.out = Outcome()
        self.rr = 0
        self.demand = Demand()
        self.scarcity = Scarcity()
        self.drains = Drains()

    def true_run_s(self, machine: str, job: TraceJob) -> float:
        return (
            self.truth.run_s(machine, job.model_id, job.kind, job.steps, job.size)
            * self.factors[(machine, job.model_id)]
            * job.noise
        )

    def true_load_s(self, machine: str, model_id: str, kind: str) -> float:
        return self.truth.load_s(machine, model_id, kind) * self.factors[(machine, model_id)]

    def request(self, job: TraceJob) -> JobRequest:
        return JobRequest(
            job.model_id, self.fleet.models[job.model_id].family, job.kind, job.target, job.steps, job.size
        )

    def view(self, m: SimMachine) -> MachineView:
        config = self.fleet.machines[m.name]
        items = []
        if m.running is not None:
            r = m.running
            items.append(WorkItem(r.model_id, r.kind, r.steps, r.size, elapsed_s=self.now_s - m.started_s))
        items += [WorkItem(j.model_id, j.kind, j.steps, j.size) for j in m.queue]
        return MachineView(
            name=m.name,
            online=m.online,
            families=config.families,
            verified_models=frozenset(self.fleet.models),
            backlog=len(items),
            queue=tuple(items),
            warm_models=m.reported_warm if self.now_s < m.loaded_s else tuple(m.warm),
            commitments=self.fleet.commitments.get(m.name, frozenset()),
        )

    def views(self) -> dict[str, MachineView]:
        return {n: self.view(m) for n, m in self.machines.items()}

    def run(self) -> Outcome:
        events: list[tuple[float, int, str, object]] = []
        seq = 0

        def push(t: float, kind: str, payload: object) -> None:
            nonlocal seq
            heapq.heappush(events, (t, seq, kind, payload))
            seq += 1

        for job in self.trace.jobs:
            push(job.t_s, "arrive", job)
        for machine, from_s, to_s in self.trace.offline:
            push(from_s, "offline", machine)
            push(to_s, "online", machine)
        while events:
            self.now_s, _, kind, payload = heapq.heappop(events)
            if kind == "arrive":
                job = payload  # type: ignore[assignment]
                assert isinstance(job, TraceJob)
                name = self.decide(job)
                if name is None:
                    continue
                self.machines[name].queue.append(job)
                self.out.placed_on[job.index] = name
                self.start_next(self.machines[name], push)
            elif kind == "done":
                m = self.machines[str(payload)]
                job = m.running
                assert job is not None
                self.out.completion_s[job.index] = self.now_s - job.t_s
                load_s, run_s, cold = m.measured  # learned on finish, as the server does (R13)
                guess = self.estimator.guess(m.name, job.model_id, job.kind)
                self.learned.observe(
                    m.name,
                    job.model_id,
                    job.kind,
                    guess=guess,
                    run_s=run_s,
                    steps=job.steps,
                    size=job.size,
                    load_s=load_s if cold else None,
                )
                m.running = None
                self.start_next(m, push)
            elif kind == "offline":
                self.machines[str(payload)].online = False
            elif kind == "online":
                m = self.machines[str(payload)]
                m.online = True
                self.start_next(m, push)
        return self.out

    def pressure(self, views: dict[str, MachineView]) -> dict[str, Pressure]:
        catalogue = {m: (p.family, p.kind) for m, p in self.fleet.models.items()}
        speed = {n: m.speed for n, m in self.fleet.machines.items()}
        return self.scarcity.pressure(views, self.estimator, catalogue, self.demand.rates(self.now_s), speed)

    def decide(self, job: TraceJob) -> str | None:
        """The machine for ``job`` (None: refused), as the server decides: with the demand of the
        jobs before it, then recording its own (app/jobs/dispatch.py), for every policy alike."""
        request = self.request(job)
        views = self.views()
        if job.target != AUTO:
            view = views.get(job.target)
            if view is None or exclusion(request, view, self.estimator) is not None:
                self.out.rejected += 1
                return None
            chosen = job.target
        elif job.index in self.placed:
            chosen = self.placed[job.index]
        else:
            try:
                chosen = self.policy(request, views, self)
            except Exception as error:  # a refusal (no machine): counted, as the API would answer 4xx
                if getattr(error, "reason", None) is None:
                    raise
                self.out.rejected += 1
                return None
        demand_class = job.model_id if job.target == AUTO else pinned_class(job.model_id, chosen)
        self.demand.add(demand_class, self.estimator.work_s(job.model_id, job.kind, job.steps, job.size), self.now_s)
        return chosen

    def start_next(self, m: SimMachine, push: Callable[[float, str, object], None]) -> None:
        self._start(m, push)
        if self.moves and m.running is None and not m.queue and m.online:
            views = self.views()
            offset = {n: int(o.running is not None) for n, o in self.machines.items()}
            movable = {
                n: [(offset[n] + i, self.request(j)) for i, j in enumerate(o.queue) if j.target == AUTO]
                for n, o in self.machines.items()
                if o is not m and o.queue
            }
            move = best_move(m.name, views, movable, self.estimator, self.pressure(views))
            if move is not None:
                job = self.machines[move.source].queue.pop(move.position - offset[move.source])
                m.queue.append(job)
                self.out.placed_on[job.index] = m.name
                self.out.moves += 1
                self._start(m, push)

    def _start(self, m: SimMachine, push: Callable[[float, str, object], None]) -> None:
        if m.running is not None or not m.queue or not m.online:
            return
        job = m.queue.pop(0)
        cold = job.model_id not in m.warm
        m.reported_warm = tuple(m.warm)
        evicted = admit(
            m.warm,
            job.model_id,
            memory_kind=self.fleet.machines[m.name].memory_kind,
            usable_bytes=self.fleet.machines[m.name].memory_bytes,
            protected=self.fleet.commitments.get(m.name, frozenset()),
            weights_bytes=self.truth.weights_bytes,
            working_bytes=working_of(self.truth, job.model_id, job.kind, job.size),
        )  # as the worker admits
        self.out.evictions += len(evicted)
        load_s = self.true_load_s(m.name, job.model_id, job.kind) if cold else 0.0
        self.out.cold_loads += int(cold)
        run_s = self.true_run_s(m.name, job)
        m.running, m.started_s, m.measured, m.loaded_s = job, self.now_s, (load_s, run_s, cold), self.now_s + load_s
        push(self.now_s + load_s + run_s, "done", m.name)


def eligible(request: JobRequest, views: dict[str, MachineView], sim: Simulation) -> list[MachineView]:
    found = [v for v in views.values() if exclusion(request, v, sim.estimator) is None]
    if not found:
        raise Refused("no machine", reason="no_machine")
    return found


def auto(request: JobRequest, views: dict[str, MachineView], sim: Simulation) -> str:
    return place(request, views, sim.estimator, sim.pressure(views), sim.drains).machine


def round_robin(request: JobRequest, views: dict[str, MachineView], sim: Simulation) -> str:
    names = sorted(views)
    ok = {v.name for v in eligible(request, views, sim)}
    for step in range(len(names)):
        name = names[(sim.rr + step) % len(names)]
        if name in ok:
            sim.rr = (sim.rr + step + 1) % len(names)
            return name
    raise AssertionError("unreachable")


def least_queue(request: JobRequest, views: dict[str, MachineView], sim: Simulation) -> str:
    return min(eligible(request, views, sim), key=lambda v: (v.backlog, v.name)).name


def model_affinity(request: JobRequest, views: dict[str, MachineView], sim: Simulation) -> str:
    ok = eligible(request, views, sim)
    warm = [v for v in ok if request.model_id in v.warm_models]
    return min(warm or ok, key=lambda v: (v.backlog, v.name)).name


POLICIES: dict[str, Policy] = {
    "auto": auto,
    "round_robin": round_robin,
    "least_queue": least_queue,
    "model_affinity": model_affinity,
}


def lower_bounds(fleet: SimFleet, trace: Trace, factors: dict[tuple[str, str], float]) -> dict[int, float]:
    """Each job on its fastest eligible machine: no waiting, no cold load (true run seconds)."""
    sim = Simulation(fleet, trace, auto, factors)
    views = sim.views()
    bounds = {}
    for job in trace.jobs:
        request = sim.request(job)
        runs = [sim.true_run_s(v.name, job) for v in views.values() if exclusion(request, v, sim.estimator) is None]
        bounds[job.index] = min(runs) if runs else float("nan")
    return bounds


def floor_slowdowns(
    fleet: SimFleet, trace: Trace, factors: dict[tuple[str, str], float], bounds: dict[int, float], floor_s: float
) -> dict[int, tuple[float, bool]]:
    """Job index -> (its bounded slowdown at the forced floor, whether it had a choice of
    machine), for the jobs that complete there (see :func:`forced_floor`)."""
    sim = Simulation(fleet, trace, least_queue, factors)
    views = sim.views()

    def flexible(job: TraceJob) -> bool:
        request = sim.request(job)
        return job.target == AUTO and sum(exclusion(request, v, sim.estimator) is None for v in views.values()) > 1

    choice = {job.index: flexible(job) for job in trace.jobs}
    forced = [job for job in trace.jobs if not choice[job.index]]
    out = Simulation(fleet, Trace(trace.name, trace.header, forced), least_queue, factors).run()
    slowdowns = {}
    for job in trace.jobs:
        bound = max(bounds[job.index], floor_s)
        if choice[job.index]:
            slowdowns[job.index] = (bounds[job.index] / bound, True)
        elif job.index in out.completion_s:
            slowdowns[job.index] = (out.completion_s[job.index] / bound, False)
    return slowdowns


def forced_floor(
    fleet: SimFleet, trace: Trace, factors: dict[tuple[str, str], float], bounds: dict[int, float], floor_s: float
) -> float:
    """Mean bounded slowdown no placement policy can beat by much on ``trace``: jobs with only
    one possible machine (default target, pinned, or a model only one machine can hold) run
    alone in their machines' FIFO lines, and every job with a choice finishes at its lower
    bound (fastest machine, no wait, no cold load). Placement only decides where the jobs with
    a choice go, so it can add to the forced jobs' waits, never remove from them. (Approximate:
    the simulated LRU residency could in principle gain from an extra job; it did not matter here.)
    """
    slowdowns = floor_slowdowns(fleet, trace, factors, bounds, floor_s)
    return sum(value for value, _ in slowdowns.values()) / len(slowdowns)


def excess_by_machine(
    completion_s: dict[int, float],
    placed_on: dict[int, str],
    bounds: dict[int, float],
    floor: dict[int, tuple[float, bool]],
    floor_s: float,
    jobs: int,
) -> dict[str, tuple[float, float]]:
    """Where a policy's mean bounded slowdown exceeds the forced floor: machine it ran the job
    on -> (excess of the jobs with a choice, excess of the forced ones), each summed over those
    jobs and divided by ``jobs`` (so the values add up to the policy's distance to the floor)."""
    out: dict[str, tuple[float, float]] = {}
    for index, done_s in completion_s.items():
        if index not in floor:
            continue
        at_floor, flexible = floor[index]
        excess = (done_s / max(bounds[index], floor_s) - at_floor) / jobs
        flex, forced = out.get(placed_on[index], (0.0, 0.0))
        out[placed_on[index]] = (flex + excess, forced) if flexible else (flex, forced + excess)
    return out


def percentile(values: Iterable[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]
