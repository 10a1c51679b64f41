"""What each machine is scarce for: recent demand per model and the pressure it puts on the
machines able to run it (used by Auto's rank, R12).

A model that only a few machines can hold (a 57 GB edit model fits only the server) makes
those machines precious: a small job that could run anywhere should not take their time.
``pressure`` spreads each model's recent work over the machines able to run it, in proportion
to their speed (a fluid allocation), and gives each machine its utilisation u and the
slowdown-weighted rate of jobs sent there. Auto charges a job the slowdown its occupancy
would add to those jobs (:func:`scarcity_s`): a long job on the only home of a busy model
costs much more than the same job where the work has other places to go.

Pure: the caller keeps the :class:`Demand` (the simulator in memory, the server in Redis) and
may cache :func:`pressure` between decisions; it changes slowly.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import cached_property

from routing.finish import EVICTION_WEIGHT

HALF_LIFE_S = 3600.0
"""Demand decays with this half-life (seconds): the last hour or so counts."""

DEFAULT_SHARE = 0.05
"""The least share of each model's recorded demand (work and jobs) that the default target is
assumed to receive as jobs naming no target (R9), pinned there, while little is recorded
(:func:`with_default_share`; it fades as ``DEFAULT_PRIOR_JOBS`` says). Without it a trace's
first default-target jobs found the server busy with long Auto work: no pinned demand was
recorded there yet, so the scarcity charge priced nothing. Chosen on ``bench/placement.py
--random 200 --seed 1`` and ``--seed 3`` (tuning seeds; judged on ``--seed 2026``): 0.01-0.1
all gained, 0.03-0.05 most; the six seeded traces, whose default target gets ~15 % of the
jobs, are unchanged (docs/benchmarks.md, "Random fleets")."""

DEFAULT_PRIOR_JOBS = 60.0
"""What the default target's assumed share is worth, in jobs: with ``n`` jobs recorded (decayed,
over all classes) the share is ``DEFAULT_SHARE x 60 / (60 + n)``, so a fleet whose jobs all name
a target or Auto stops keeping long work off the server (held at full strength, the prior sent
edits onto machines whose pinned jobs then waited, on a tuning case with no default-target job).
20, 60 and 150 did alike on the tuning seeds; 60 lost fewest cases."""

MAX_UTILISATION = 0.95
BOUND_FLOOR_S = 10.0
"""Bounded slowdown's floor: completion / max(fastest run, 10 s)."""


@dataclass(frozen=True)
class Pressure:
    """One machine's share of recent demand when each model's work is spread over the machines
    able to run it, in proportion to their speed.

    utilisation: busy fraction under that spread (0 .. ``MAX_UTILISATION``).
    weight_per_s: jobs per second sent there, each weighted by 1 / its bounded-slowdown floor
        (1 / max(fastest run seconds, 10 s)) and by the share of a delay there it would
        suffer (1 / the number of machines able to run it: the others can take it instead).
    """

    utilisation: float = 0.0
    weight_per_s: float = 0.0
    reload_weight: Mapping[str, float] = field(default_factory=dict)
    """model -> 1 / the bounded-slowdown floor of its recent jobs (per second), for the models
    with recent demand that this machine can run: what one second of reloading that model here,
    after an eviction, costs the job that needs it, in slowdown (:func:`eviction_s`)."""


@dataclass
class Demand:
    """Exponentially decayed submissions per model: work (speed-1.0 seconds) and job count."""

    half_life_s: float = HALF_LIFE_S
    levels: dict[str, tuple[float, float, float]] = field(default_factory=dict)  # model -> (work_s, jobs, at_s)

    def _decay(self, at_s: float, now_s: float) -> float:
        return math.exp(-math.log(2) * max(0.0, now_s - at_s) / self.half_life_s)

    def add(self, model_id: str, work_s: float, now_s: float) -> None:
        """Record one submission of ``work_s`` seconds of work (run time on a speed-1.0 machine).

        ``model_id`` is the demand class: the model id for Auto jobs, :func:`pinned_class` for
        jobs pinned to a machine (their work can go nowhere else)."""
        work, jobs, at_s = self.levels.get(model_id, (0.0, 0.0, now_s))
        factor = self._decay(at_s, now_s)
        self.levels[model_id] = (work * factor + work_s, jobs * factor + 1.0, now_s)

    def rates(self, now_s: float) -> dict[str, tuple[float, float]]:
        """model -> (work seconds per second, jobs per second) over the mean lifetime
        ``half_life_s / ln 2`` of the decayed sums."""
        tau_s = self.half_life_s / math.log(2)
        out = {}
        for model_id, (work, jobs, at_s) in self.levels.items():
            factor = self._decay(at_s, now_s) / tau_s
            out[model_id] = (work * factor, jobs * factor)
        return out


def pinned_class(model_id: str, machine: str) -> str:
    """The demand class of jobs for ``model_id`` pinned to ``machine``: ``model@machine``."""
    return f"{model_id}@{machine}"


def with_default_share(
    rates: Mapping[str, tuple[float, float]],
    machine: str,
    share: float = DEFAULT_SHARE,
    prior_jobs: float = DEFAULT_PRIOR_JOBS,
) -> dict[str, tuple[float, float]]:
    """``rates`` (demand class -> (work seconds per second, jobs per second), as
    :meth:`Demand.rates`) with each model's class pinned to ``machine`` (the default target)
    raised to at least ``share`` x ``prior_jobs / (prior_jobs + n)`` of that model's recorded
    demand over all its classes, ``n`` the jobs recorded (decayed: jobs per second x the
    decay's mean lifetime ``HALF_LIFE_S / ln 2``), over all classes.

    The default target receives the jobs that name no target whether or not any were recorded
    yet; this prior keeps its scarcity charge from pricing nothing while the record is young,
    and fades as the record grows.
    A class ``model@machine`` for a model ``machine`` cannot run has no able machine and adds
    no pressure (:func:`pressure`). ``share`` 0 returns the rates unchanged (a copy).
    """
    out = dict(rates)
    if share <= 0:
        return out
    total: dict[str, tuple[float, float]] = {}
    for name, (work, jobs) in rates.items():
        model_id = name.partition("@")[0]
        work_sum, jobs_sum = total.get(model_id, (0.0, 0.0))
        total[model_id] = (work_sum + work, jobs_sum + jobs)
    recorded = sum(jobs for _, jobs in total.values()) * HALF_LIFE_S / math.log(2)
    share *= prior_jobs / (prior_jobs + recorded)
    for model_id, (work, jobs) in total.items():
        name = pinned_class(model_id, machine)
        recorded_work, recorded_jobs = out.get(name, (0.0, 0.0))
        out[name] = (max(recorded_work, share * work), max(recorded_jobs, share * jobs))
    return out


def able_with_pinned(able: Mapping[str, frozenset[str]], classes: Iterable[str]) -> dict[str, frozenset[str]]:
    """``able`` (model -> machines) extended with the pinned classes among ``classes``."""
    out = dict(able)
    for name in classes:
        if "@" in name and name not in out:
            model_id, _, machine = name.partition("@")
            out[name] = able.get(model_id, frozenset()) & {machine}
    return out


@dataclass(frozen=True)
class Spread:
    """Where demand can go: for each entry (a demand class, or the model of a pinned class) the
    online machines able to take it, and the machines grouped by the entries they can take.
    Machines of one group get the same pressure up to their speed, so :func:`pressure` works
    per group, not per machine (built by :func:`spread`; reusable while ``able`` and the class
    names are unchanged, :class:`routing.scarcity.Scarcity`)."""

    machines: Mapping[str, tuple[str, ...]]  # entry -> machines able to take it (online, with a speed)
    groups: Mapping[frozenset[str], tuple[str, ...]]  # the entries a machine can take -> those machines
    speed: Mapping[str, float]

    @cached_property
    def capacity(self) -> dict[str, tuple[float, float]]:
        """entry -> (summed speed, fastest speed) of its machines, for the entries that have
        any; computed once per spread (:func:`pressure` reads them at every decision)."""
        speed = self.speed
        return {
            entry: (sum(speed[m] for m in names), max(speed[m] for m in names))
            for entry, names in self.machines.items()
            if names
        }


def spread(classes: Iterable[str], able: Mapping[str, frozenset[str]], speed: Mapping[str, float]) -> Spread:
    """The :class:`Spread` of ``classes`` (demand class names) over ``able`` (entry -> machines)
    for the machines of ``speed`` (machine -> relative speed)."""
    entries = set()
    for name in classes:
        entries.add(name)
        entries.add(name.partition("@")[0])
    machines = {e: tuple(sorted(m for m in able.get(e, frozenset()) if m in speed)) for e in sorted(entries)}
    takes: dict[str, set[str]] = {m: set() for m in speed}
    for entry, names in machines.items():
        for m in names:
            takes[m].add(entry)
    groups: dict[frozenset[str], list[str]] = {}
    for m, entry_set in takes.items():
        groups.setdefault(frozenset(entry_set), []).append(m)
    return Spread(machines, {k: tuple(v) for k, v in groups.items()}, dict(speed))


def pressure(
    rates: Mapping[str, tuple[float, float]],
    able: Mapping[str, frozenset[str]] | Spread,
    speed: Mapping[str, float] | None = None,
) -> dict[str, Pressure]:
    """:class:`Pressure` per machine of ``speed`` (machine -> relative speed).

    Args:
        rates: model -> (work rate in speed-1.0 seconds per second, jobs per second), from
            :meth:`Demand.rates`.
        able: model -> the machines able to run it now (online, verified, fits); or a
            :class:`Spread` of ``rates``' classes already built (then ``speed`` is its own).
    """
    where = able if isinstance(able, Spread) else spread(rates, able, speed or {})
    speed = where.speed
    capacity = where.capacity  # entry -> (summed speed, fastest speed) of its machines
    per_class: dict[str, tuple[float, float]] = {}  # class -> (load per machine, weight per unit of speed)
    per_model: dict[str, tuple[float, float]] = {}  # model -> (jobs per second, jobs x their floor per second)
    for model_id, (work_rate, job_rate) in rates.items():
        found = capacity.get(model_id)
        total = found[0] if found is not None else 0.0
        if found is None or total <= 0 or job_rate <= 0:
            continue
        machines = where.machines[model_id]
        # The bounded-slowdown floor is the job's run on the fastest machine able to run its
        # model anywhere, also for pinned classes (a job pinned to a slow machine still counts
        # its slowdown against the fleet's fastest run).
        model = model_id.partition("@")[0]
        pool = capacity.get(model) or found
        fastest_s = work_rate / job_rate / pool[1]
        per_job = 1.0 / max(fastest_s, BOUND_FLOOR_S)
        jobs, fastest_work = per_model.get(model, (0.0, 0.0))
        per_model[model] = (jobs + job_rate, fastest_work + job_rate * fastest_s)
        # Spread in proportion to speed: each machine's load is work_rate / total (= work_rate x
        # share / its speed); its weight is the jobs sent there (share = speed / total), each
        # suffering about 1/n of a delay there (n machines can take it; a forced class, all).
        per_class[model_id] = (work_rate / total, job_rate / total * per_job / len(machines))
    reload_weight = {
        model: 1.0 / max(fastest_work / jobs, BOUND_FLOOR_S) for model, (jobs, fastest_work) in per_model.items()
    }
    out = {}
    for entries, machines in where.groups.items():
        load = sum(per_class[e][0] for e in entries if e in per_class)
        weight = sum(per_class[e][1] for e in entries if e in per_class)
        reload = {model: w for model, w in reload_weight.items() if model in entries}
        by_speed: dict[float, Pressure] = {}  # machines of a group with one speed get equal pressure: one object
        for m in machines:
            here = by_speed.get(speed[m])
            if here is None:
                here = by_speed[speed[m]] = Pressure(min(load, MAX_UTILISATION), weight * speed[m], reload)
            out[m] = here
    return out


def scarcity_s(occupancy_s: float, machine: Pressure, bound_s: float, ahead_s: float = 0.0) -> float:
    """Seconds charged for occupying a machine for ``occupancy_s`` seconds, for a job whose
    bounded-slowdown floor is ``bound_s``.

    Adding ``d`` seconds of work extends the machine's busy period by about d / (1 - u); the
    jobs arriving meanwhile (``weight_per_s`` of them, slowdown-weighted) each wait d longer.
    Their summed slowdown, d^2 x weight / (1 - u), is turned into this job's seconds by
    multiplying with ``bound_s``, so it adds to the job's own expected finish on one scale.
    """
    u = min(max(machine.utilisation, 0.0), MAX_UTILISATION)
    return bound_s * occupancy_s * (occupancy_s + ahead_s) * machine.weight_per_s / (1.0 - u)


def eviction_s(reload_s: Mapping[str, float], machine: Pressure, bound_s: float) -> float:
    """Seconds charged for evicting warm models whose reloads here take ``reload_s`` (model ->
    seconds), for a job whose bounded-slowdown floor is ``bound_s``.

    An eviction costs whoever next needs that model here its reload. Priced in that job's
    slowdown (reload seconds x ``routing.finish.EVICTION_WEIGHT`` / its floor,
    :attr:`Pressure.reload_weight`; the weight: the jobs queued behind the reload wait for it
    too) and turned into this job's seconds by ``bound_s``, as :func:`scarcity_s` does:
    evicting a model that big jobs use costs a small job little, and a model without recent
    demand costs nothing. On bench/placement.py's traces the weight trades slowdown for cold
    loads (mean slowdown, cold loads, both over least-queue's): 1.5: 0.794, 0.619; 2.0: 0.794,
    0.607; 3.0: 0.796, 0.580.
    """
    return EVICTION_WEIGHT * bound_s * sum(s * machine.reload_weight.get(m, 0.0) for m, s in reload_s.items())
