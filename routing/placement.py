"""Placement rules R9–R12: the default target, explicit targets (there or nowhere), and Auto's
five filters with a rank by earliest expected finish.

Everything here is pure: it takes :class:`MachineView` snapshots, a :class:`JobRequest` and a
:class:`~routing.estimate.CostModel` and returns a :class:`Decision` or raises a domain error.
No machine is ever chosen that the request did not allow: an explicit target is never
rerouted (R10). The same code drives the API (``app/jobs/dispatch.py``) and the simulator
(``bench/placement.py``).

Reason codes (in filter order, R11): ``machine_unavailable``, ``machine_syncing``,
``machine_draining``, ``family_not_supported``, ``model_not_verified``,
``residency_conflict``, ``video_on_reserved_machine``,
``too_large``, ``remembered_oom``, ``queue_full`` (R23); and ``unknown_machine`` (explicit only), ``no_machine``
(Auto, nothing left).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import lru_cache

from residency.device import MemoryKind
from routing.demand import BOUND_FLOOR_S, Pressure, eviction_s, scarcity_s
from routing.errors import Full, Refused, Unavailable
from routing.estimate import CostModel, Estimator, readable_bytes
from routing.finish import (
    COLD_LOAD_CREDIT,
    Breakdown,
    Drains,
    Tail,
    WorkItem,
    drain,
    expected_finish,
    expected_parts,
    working_of,
)

SERVER = "server"
"""The server's own machine name: the server also runs jobs on its own device (R1)."""

DEFAULT_TARGET = SERVER
"""R9: a job that names no target runs on the server."""

AUTO = "auto"
"""R11: the target that lets placement choose (opt-in)."""


@dataclass(frozen=True)
class MachineView:
    """What placement knows of one machine at the moment of the decision.

    ``commitments`` (residency commitments, R16) and ``oom_sizes`` (remembered OOMs, R21) are
    filled by the residency work; until then they are empty.
    """

    name: str
    online: bool  # a live heartbeat
    families: frozenset[str]  # model families it supports (fleet config)
    verified_models: frozenset[str]  # models whose files it verified against the manifest (R4)
    backlog: int = 0  # jobs reserved on it: queued + running
    queue: tuple[WorkItem, ...] = ()  # the reserved jobs in FIFO order (running first), when known
    warm_models: tuple[str, ...] = ()  # resident models, least recently used first
    commitments: frozenset[str] = frozenset()  # models it must keep resident (protected set)
    oom_sizes: Mapping[tuple[str, str], int] = field(
        default_factory=dict
    )  # (model, kind) -> smallest size that ran out of memory
    draining: bool = False  # an operator drains it (`homefleet drain`): nothing new is placed there
    syncing: bool = False  # a sync holds its reservation: model files are being copied to it (R6)
    max_queued: int | None = None  # R23: backlog at which it takes no more jobs (None: no limit)


@dataclass(frozen=True)
class JobRequest:
    """What placement needs of a job: its model, family, kind, target, steps and size
    (``app.core.kinds.job_request`` builds it from a job's params and its kind's defaults)."""

    model_id: str
    family: str
    kind: str
    target: str = DEFAULT_TARGET  # a machine name, or "auto" (R11: opt-in)
    steps: int = 30
    size: int = 1024 * 1024  # pixels x frames x batch (routing.timings.job_size)
    adapters: tuple[str, ...] = ()  # LoRA adapter ids: each must be verified there too (R4)
    batch: int = 1  # images in the job (its size's batch: a batch is priced linearly, R13)


@dataclass(frozen=True)
class Decision:
    """Where a job goes and why: ``excluded`` maps machine -> (reason, message); ``candidates``
    maps each eligible machine to its expected-finish breakdown (Auto; the target alone when
    explicit)."""

    machine: str
    excluded: dict[str, tuple[str, str]] = field(default_factory=dict)
    candidates: dict[str, Breakdown] = field(default_factory=dict)

    @property
    def breakdown(self) -> Breakdown:
        return self.candidates[self.machine]

    def as_json(self) -> dict[str, object]:
        rows: dict[str, object] = {}
        for name, part in sorted(self.candidates.items()):
            rows[name] = {"eligible": True, **part.as_json()}
        for name, (reason, message) in sorted(self.excluded.items()):
            rows[name] = {"eligible": False, "reason": reason, "message": message}
        return {"machine": self.machine, "machines": rows}


Placement = Decision  # the name the walking skeleton used


def job_bytes(job: JobRequest, costs: CostModel) -> int:
    """The job's memory estimate in bytes: ``costs.job_bytes`` (weights + working memory) plus
    its LoRA adapters' weights (resident beside the model while it runs)."""
    return costs.job_bytes(job.model_id, job.kind, job.size) + sum(costs.weights_bytes(a) for a in job.adapters)


@lru_cache(maxsize=4096)
def too_large(name: str, model: str, need: int, weights: int, usable: int) -> tuple[str, str]:
    """The ``too_large`` verdict of :func:`exclusion` (reason, message): a job of ``model``
    needing ``need`` bytes (``weights`` of them its weights) on machine ``name`` with ``usable``
    bytes. Kept per figures: at hundreds of machines most of them exclude the large models at
    every decision, and formatting the message anew was a tenth of the decision."""
    decided = "the weights alone exceed it" if weights > usable else "the working memory tips it over"
    return (
        "too_large",
        f"job needs an estimated {readable_bytes(need)} (model {model!r}: weights {readable_bytes(weights)} as "
        f"its variant loads + working memory {readable_bytes(need - weights)}) but machine {name!r} has "
        f"{readable_bytes(usable)} usable: {decided}",
    )


TEMPORARY = frozenset({"machine_unavailable", "machine_draining", "machine_syncing"})
"""The exclusions that pass by themselves (offline, drained, syncing: R10, R11): a 503 to retry
later, never a 422. A pinned target in one of them is :class:`Unavailable`; so is Auto when every
machine that could run the job is in one (:func:`only_for_now`)."""


def only_for_now(job: JobRequest, machine: MachineView, costs: CostModel) -> bool:
    """Whether ``machine``, excluded for a :data:`TEMPORARY` reason, would take ``job`` once it is
    back (online, not draining, not syncing): no permanent filter of :func:`exclusion` excludes it
    then. A full queue counts as for now too (it drains)."""
    back = replace(machine, online=True, draining=False, syncing=False)
    refusal = exclusion(job, back, costs)
    return refusal is None or refusal[0] == "queue_full"


def lasting_reason(job: JobRequest, machine: MachineView, reason: str, costs: CostModel) -> str:
    """``reason``, ``machine``'s exclusion for ``job``; for a :data:`TEMPORARY` one, the filter
    that would still exclude it once back first (``family_not_supported (and machine_draining)``):
    undraining it would not help, and the refusal says so."""
    if reason not in TEMPORARY:
        return reason
    refusal = exclusion(job, replace(machine, online=True, draining=False, syncing=False), costs)
    return f"{refusal[0]} (and {reason})" if refusal is not None else reason


def exclusion(
    job: JobRequest, machine: MachineView, costs: CostModel | None = None, need_bytes: int | None = None
) -> tuple[str, str] | None:
    """The first filter that excludes ``machine`` for ``job`` as (reason, message), or None.

    ``need_bytes``: the job's memory estimate (``costs.job_bytes``) when the caller already
    has it (it does not depend on the machine; :func:`survey` computes it once per job).

    Order: online (not drained by an operator, not receiving a sync, R6); supports the family;
    holds the model (verified); fits its residency commitments (and no video beside a
    reservation, R17); has memory for the job (estimate <= usable bytes, and no remembered OOM
    at this size or smaller, R21). R11 lists the family after the verified model; it is checked
    first here so that a machine that can never run the model is not answered with a sync to
    run (the sync would be refused for the same family).
    """
    name, model = machine.name, job.model_id
    if not machine.online:
        return "machine_unavailable", f"machine {name!r} is offline (no live heartbeat)"
    if machine.syncing:
        return (
            "machine_syncing",
            f"machine {name!r} is receiving model files (a sync holds it); nothing is placed there until the sync ends",
        )
    if machine.draining:
        return "machine_draining", f"machine {name!r} is being drained; `homefleet drain {name} --undo` resumes it"
    if job.family not in machine.families:
        supported = ", ".join(sorted(machine.families)) or "none"
        return (
            "family_not_supported",
            f"machine {name!r} does not support family {job.family!r} of model {model!r}; it supports: {supported}",
        )
    if model not in machine.verified_models:
        return (
            "model_not_verified",
            f"model {model!r} is not verified on machine {name!r}; run `homefleet sync {name} {model}` first",
        )
    for adapter in job.adapters:  # an adapter is a registry entry, synced and verified like a model
        if adapter not in machine.verified_models:
            return (
                "model_not_verified",
                f"adapter {adapter!r} is not verified on machine {name!r}; run `homefleet sync {name} {adapter}` first",
            )
    costs = costs or Estimator()
    need = job_bytes(job, costs) if need_bytes is None else need_bytes
    usable = costs.usable_bytes(name)
    if machine.commitments:
        if job.kind == "video":
            return (
                "video_on_reserved_machine",
                f"machine {name!r} holds residency commitments ({', '.join(sorted(machine.commitments))}); "
                f"a video job needs the memory they hold (R17)",
            )
        if model not in machine.commitments:
            if costs.memory_kind(name) == MemoryKind.dedicated:
                return (
                    "residency_conflict",
                    f"machine {name!r} is committed to keep {', '.join(sorted(machine.commitments))} resident "
                    f"and holds one checkpoint; {model!r} would evict it",
                )
            held = sum(costs.weights_bytes(m) for m in machine.commitments)
            if usable > 0 and held + need > usable:
                return (
                    "residency_conflict",
                    f"model {model!r} needs {readable_bytes(need)} but machine {name!r} keeps "
                    f"{readable_bytes(held)} committed of {readable_bytes(usable)} usable",
                )
    if usable > 0 and need > usable:
        return too_large(name, model, need, costs.weights_bytes(model), usable)
    oom_size = machine.oom_sizes.get((model, job.kind))
    if oom_size is not None and job.size >= oom_size:
        return (
            "remembered_oom",
            f"{job.kind} with {model!r} ran out of memory on machine {name!r} at size {oom_size} "
            f"(pixels x frames x batch); this job's size is {job.size}; to try again: "
            f"`homefleet oom clear {name} --model {model} --kind {job.kind}`",
        )
    if machine.max_queued is not None and machine.backlog >= machine.max_queued:
        return (
            "queue_full",
            f"machine {name!r} has {machine.backlog} jobs queued or running, the limit is "
            f"max_queued_per_machine = {machine.max_queued}; retry later",
        )
    return None


def finish(job: JobRequest, machine: MachineView, costs: CostModel, drains: Drains | None = None) -> Breakdown:
    """Expected-finish breakdown of ``job`` appended to ``machine``'s queue (R12)."""
    return expected_finish(
        machine.name,
        job.model_id,
        job.kind,
        job.steps,
        job.size,
        warm_models=machine.warm_models,
        queue=machine.queue,
        extra_queued=max(0, machine.backlog - len(machine.queue)),
        protected=machine.commitments,
        costs=costs,
        drains=drains,
        adapters=job.adapters,
        batch=job.batch,
    )


def place(
    job: JobRequest,
    machines: Mapping[str, MachineView],
    costs: CostModel | None = None,
    pressure: Mapping[str, Pressure] | None = None,
    drains: Drains | None = None,
) -> Decision:
    """Choose the machine for ``job``: the explicit target, or Auto's candidate with the least
    expected finish + scarcity charge (``pressure``: machine -> :class:`~routing.demand.Pressure` from
    :func:`routing.demand.pressure`; none = no charge, and evictions priced at
    ``routing.finish.EVICTION_WEIGHT`` x their reload; with it, by the evicted models' recent
    demand, :func:`routing.demand.eviction_s`), less the cold-load credit
    (``routing.finish.COLD_LOAD_CREDIT``, with ``pressure`` only); ties: the earlier expected
    finish (a warm machine before a cold one), fewer queued, then name. ``drains``: the
    caller's :class:`~routing.finish.Drains`, kept between decisions (same decisions, faster).

    Raises:
        Refused: unknown machine (reason ``unknown_machine``), or a filter excludes the
            explicit target (its reason), or Auto finds no machine (reason ``no_machine``):
            every machine is excluded by a filter that does not pass by itself.
        Unavailable: the explicit target is offline, drained or syncing (R10: never rerouted);
            or, for Auto, every machine that could run the job is (:data:`TEMPORARY`), the
            message naming each one's reason (R11); the reason is theirs when they share one,
            else ``machine_unavailable``.
        Full: the target (or, for Auto, every machine not excluded otherwise) is full (R23).
    """
    costs = costs or Estimator()
    target = job.target or DEFAULT_TARGET
    if target != AUTO:
        machine = machines.get(target)
        if machine is None:
            known = ", ".join(sorted(machines))
            raise Refused(
                f"target {target!r} is not a machine of this fleet; machines: {known}", reason="unknown_machine"
            )
        refusal = exclusion(job, machine, costs)
        if refusal is not None:
            reason, message = refusal
            if reason in TEMPORARY:
                raise Unavailable(message, reason=reason)
            if reason == "queue_full":
                raise Full(message, reason=reason)
            raise Refused(message, reason=reason)
        return Decision(machine=target, candidates={target: finish(job, machine, costs, drains)})

    excluded, candidates = survey(job, machines, costs, pressure, drains)
    if not candidates:
        detail = ", ".join(f"{name}: {reason}" for name, (reason, _) in sorted(excluded.items()))
        if any(reason == "queue_full" for reason, _ in excluded.values()):
            raise Full(f"every machine able to run model {job.model_id!r} is full ({detail})", reason="queue_full")
        waiting = {
            name: reason
            for name, (reason, _) in sorted(excluded.items())
            if reason in TEMPORARY and only_for_now(job, machines[name], costs)
        }
        if waiting:  # R10/R11: a temporary state is a 503 to retry, as for a pinned target
            reasons = set(waiting.values())
            named = ", ".join(f"{name}: {reason}" for name, reason in waiting.items())
            raise Unavailable(
                f"every machine able to run model {job.model_id!r} is unavailable for now ({named}); "
                f"retry later (all machines: {detail})",
                reason=reasons.pop() if len(reasons) == 1 else "machine_unavailable",
            )
        lasting = ", ".join(
            f"{name}: {lasting_reason(job, machines[name], reason, costs)}"
            for name, (reason, _) in sorted(excluded.items())
        )
        raise Refused(f"no machine can run model {job.model_id!r} ({lasting})", reason="no_machine")
    best = min(
        candidates,
        key=lambda name: (candidates[name].score_s, candidates[name].finish_s, candidates[name].queued, name),
    )
    return Decision(machine=best, excluded=excluded, candidates=candidates)


def survey(
    job: JobRequest,
    machines: Mapping[str, MachineView],
    costs: CostModel,
    pressure: Mapping[str, Pressure] | None = None,
    drains: Drains | None = None,
) -> tuple[dict[str, tuple[str, str]], dict[str, Breakdown]]:
    """Every machine: excluded with (reason, message), or its expected-finish breakdown."""
    pressure = pressure or {}
    excluded: dict[str, tuple[str, str]] = {}
    parts: dict[str, tuple[float, int, Tail]] = {}  # as finish() in parts: one Breakdown each, built below
    need = job_bytes(job, costs)
    working = working_of(costs, job.model_id, job.kind, job.size)  # the same on every machine
    model_id, kind, steps, size, adapters, batch = job.model_id, job.kind, job.steps, job.size, job.adapters, job.batch
    for machine in machines.values():
        refusal = exclusion(job, machine, costs, need)
        if refusal is None:
            queue = machine.queue
            extra = max(0, machine.backlog - len(queue))
            ahead_s, tail = expected_parts(
                machine.name,
                model_id,
                kind,
                steps,
                size,
                warm_models=machine.warm_models,
                queue=queue,
                extra_queued=extra,
                protected=machine.commitments,
                costs=costs,
                drains=drains,
                adapters=adapters,
                working_bytes=working,
                batch=batch,
            )
            parts[machine.name] = (ahead_s, len(queue) + extra, tail)
        else:
            excluded[machine.name] = refusal
    charged = bool(pressure and parts)
    if charged:
        bound_s = max(min(tail[0] for _, _, tail in parts.values()), BOUND_FLOOR_S)
        unevicted_s = eviction_s({}, Pressure(), bound_s)  # nothing evicted: the same on every machine
    candidates: dict[str, Breakdown] = {}
    for name, (ahead_s, queued, (run_s, cold_load_s, evicts, reload_s, evicted_s, adapter_load_s)) in parts.items():
        here = pressure.get(name) if charged else None
        charge_s = credit_s = 0.0
        if here is not None:
            evicted_s = eviction_s(dict(zip(evicts, reload_s, strict=True)), here, bound_s) if evicts else unevicted_s
            occupancy_s = cold_load_s + adapter_load_s + run_s  # as Breakdown.occupancy_s
            charge_s = scarcity_s(occupancy_s, here, bound_s, ahead_s)
            if cold_load_s and model_id in here.reload_weight:  # recent demand that the load also serves
                credit_s = COLD_LOAD_CREDIT * cold_load_s
        candidates[name] = Breakdown(
            work_ahead_s=ahead_s,
            cold_load_s=cold_load_s,
            run_s=run_s,
            eviction_s=evicted_s,
            queued=queued,
            evicts=evicts,
            scarcity_s=charge_s,
            adapter_load_s=adapter_load_s,
            load_credit_s=credit_s,
        )
    return excluded, candidates


@dataclass(frozen=True)
class Move:
    """A queued Auto job that would do better on a machine that has fallen idle:
    ``position`` in ``source``'s queue (as :attr:`MachineView.queue`, the running job first),
    and the seconds it gains: its expected finish where it is less its score on ``target``."""

    source: str
    position: int
    target: str
    gain_s: float


def best_move(
    idle: str,
    machines: Mapping[str, MachineView],
    movable: Mapping[str, Sequence[tuple[int, JobRequest]]],
    costs: CostModel,
    pressure: Mapping[str, Pressure] | None = None,
) -> Move | None:
    """The queued job to move onto ``idle``, a machine with nothing running or queued, or None.

    ``movable``: machine -> (position in its :attr:`MachineView.queue`, request) of its queued
    Auto jobs; a pinned or default job (R9, R10) or a running one is never moved. A job moves
    when its score on ``idle`` (expected finish + scarcity + eviction charges, as
    :func:`survey` ranks it beside its own machine) is less than its expected finish where it
    is (the drain of its queue up to and including it); the largest gain wins. Without the
    charges a move hurts: an idle server took flux jobs, evicted the edit model (a 150 s
    reload) and its forced jobs waited (docs/benchmarks.md, "Placement").

    Only the simulator moves jobs today (``bench/placement.py``, row ``auto+moves``); the
    server does not (docs/benchmarks.md says what it would need).
    """
    target = machines.get(idle)
    if target is None or target.queue or target.backlog:
        return None
    best: Move | None = None
    for source, jobs in movable.items():
        view = machines.get(source)
        if view is None or source == idle:
            continue
        for position, job in jobs:
            if job.target != AUTO or position >= len(view.queue) or view.queue[position].elapsed_s is not None:
                continue
            if exclusion(job, target, costs) is not None:
                continue
            there_s, _ = drain(
                source,
                warm_models=view.warm_models,
                queue=view.queue[: position + 1],
                protected=view.commitments,
                costs=costs,
            )
            _, candidates = survey(job, {idle: target, source: view}, costs, pressure)
            gain_s = there_s - candidates[idle].charged_s
            if gain_s > 0 and (best is None or gain_s > best.gain_s):
                best = Move(source, position, idle, gain_s)
    return best


def able_machines(
    machines: Mapping[str, MachineView], costs: CostModel, models: Mapping[str, tuple[str, str]]
) -> dict[str, frozenset[str]]:
    """model -> machines whose filters pass a reference-size job of it (for routing.demand).

    ``models``: model -> (family, kind).
    """
    able = {}
    for model_id, (family, kind) in models.items():
        probe = JobRequest(model_id, family, kind, AUTO)
        able[model_id] = frozenset(n for n, v in machines.items() if exclusion(probe, v, costs) is None)
    return able


def memory_figures(job: JobRequest, machine: MachineView, costs: CostModel) -> dict[str, object]:
    """The memory figures behind ``machine``'s verdict for ``job`` (bytes, and ``text`` in
    readable units, :func:`routing.estimate.readable_bytes`): the model's ``weights_bytes`` as
    its variant loads, the job's ``working_bytes`` (and its adapters' ``adapters_bytes``), what
    the warm models hold (``warm_bytes``, their weights) and commitments keep (``committed_bytes``),
    and the machine's ``usable_bytes`` (0: not configured, no memory filter)."""
    weights = costs.weights_bytes(job.model_id)
    working = working_of(costs, job.model_id, job.kind, job.size)
    adapters = sum(costs.weights_bytes(a) for a in job.adapters)
    warm = sum(costs.weights_bytes(m) for m in machine.warm_models)
    committed = sum(costs.weights_bytes(m) for m in machine.commitments)
    usable = costs.usable_bytes(machine.name)
    text = f"weights {readable_bytes(weights)} + working {readable_bytes(working)}"
    if adapters:
        text += f" + adapters {readable_bytes(adapters)}"
    text += f"; warm models hold {readable_bytes(warm)}"
    if committed:
        text += f" (committed {readable_bytes(committed)})"
    text += f"; {readable_bytes(usable)} usable" if usable > 0 else "; usable memory not configured"
    return {
        "weights_bytes": weights,
        "working_bytes": working,
        "adapters_bytes": adapters,
        "warm_bytes": warm,
        "committed_bytes": committed,
        "usable_bytes": usable,
        "text": text,
    }


def dry_run(
    job: JobRequest,
    machines: Mapping[str, MachineView],
    costs: CostModel | None = None,
    pressure: Mapping[str, Pressure] | None = None,
) -> dict[str, object]:
    """The full decision without placing anything: every machine with the filter that excluded
    it or its breakdown, each with the memory figures that decided (:func:`memory_figures`),
    and the machine that would be chosen (None when none would)."""
    costs = costs or Estimator()
    try:
        decision = place(job, machines, costs, pressure)
        chosen: str | None = decision.machine
        error = None
    except Refused as refusal:
        chosen, error = None, {"reason": refusal.reason, "message": refusal.message}
    excluded, candidates = survey(job, machines, costs, pressure)
    body = Decision(machine=chosen or "", excluded=excluded, candidates=candidates).as_json()
    rows = body["machines"]
    assert isinstance(rows, dict)
    for name, row in rows.items():
        row["memory"] = memory_figures(job, machines[name], costs)
    body["machine"] = chosen
    body["target"] = job.target
    if error:
        body["error"] = error
    return body
