"""Expected finish of a job on one machine (R12): the work ahead of it, a cold load if its
model will not be warm when it starts, the load of its LoRA adapters onto the warm pipeline
(loaded for the job, unloaded after, never kept warm), its run time, and the reload
cost of the warm models its load would evict. Residency is simulated along the machine's queue in FIFO order.

Residency model (R15): the worker's own admission rule (``residency.policy.admit``, which plans
with ``plan_load`` as the worker's cache does): a cold load needs the model's weights plus the
job's working memory (``costs.job_bytes - costs.weights_bytes``, the figure the worker gets in its
claim); on unified memory warm models stay while that fits in the usable bytes and the least
recently used unprotected one goes first; committed (protected) models are never evicted. On
dedicated memory exactly one checkpoint is resident.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from residency.policy import admit
from routing.estimate import CostModel
from routing.timings import ADAPTER_KIND, job_size

EVICTION_WEIGHT = 3.0
"""Weight of an evicted warm model's reload seconds. More than 1: the reload lands on the
machine later (its own occupancy), and every job queued behind it waits for it too. Without
demand data (explicit targets, dry runs) an eviction costs this many seconds per second of
reload; Auto prices the same weighted reload in the slowdown of the jobs that need the model
(``routing.demand.eviction_s``). Chosen on bench/placement.py's traces (cold loads fell by half
for ~1-2 % slowdown)."""


COLD_LOAD_CREDIT = 1.0
"""Share of a cold load that Auto does not count against the job that pays it when the job's
model has recent demand that the machine could serve (``routing.demand.Pressure.reload_weight``
lists the model there): the load then also warms the model for its next jobs, which would
otherwise each weigh a cold load elsewhere (a burst of edits piled onto the one machine already
warm, its queue growing, while a machine three times faster stayed cold). At 1.0 such a job is
ranked by its run, the work ahead and the charges, as if the model were warm; ties go to the
earlier expected finish (``routing.placement.place``). Without recent demand (a model's first
job, or no demand data: explicit targets, dry runs without it) the load counts in full, as R12
ranks. The load always counts in full in the expected finish (``Breakdown.finish_s``), in the
occupancy the scarcity charge prices and in what a move must beat. Chosen on
``bench/placement.py --random 200 --seed 1`` and ``--seed 3`` (tuning seeds; judged on
``--seed 2026``): counted for every job, 0.75, 0.9 and 1.0 each gained over 0.5 on both seeds
and 1.25 lost on the p95 figure; the gate on recent demand gives up a few tenths of a percent
of 1.0's gain (docs/benchmarks.md, "Random fleets")."""


@dataclass(frozen=True)
class StepReport:
    """What a running job's worker reported of its steps (``app.fleet.running.step_report``).

    step: steps done (0: the job is claimed, no step done yet: loading, or on its first step).
    total: its steps (0 before the first step report).
    since_s: seconds since the last report (or since the claim).
    step_s: seconds per step measured between its first step report and its last; None until
        two step reports (the load before the first step is not in it).
    """

    step: int
    total: int
    since_s: float
    step_s: float | None = None

    def aged(self, seconds: float) -> StepReport:
        """The same report ``seconds`` later (nothing new reported meanwhile)."""
        return replace(self, since_s=self.since_s + seconds)


@dataclass(frozen=True)
class WorkItem:
    """A job already reserved on a machine (queued, or running when ``elapsed_s`` is set)."""

    model_id: str
    kind: str
    steps: int = 30
    size: int = 1024 * 1024  # pixels x frames x batch (routing.timings.job_size)
    elapsed_s: float | None = None  # seconds since it started; None while queued
    batch: int = 1  # images in the job (its size's batch)
    report: StepReport | None = None  # its worker's last step report (running only); None: none read


@dataclass(frozen=True)
class Breakdown:
    """Seconds from now until the job would finish on that machine, in parts."""

    work_ahead_s: float  # remaining of the running job + every queued job (with their loads)
    cold_load_s: float  # 0 when the model will be warm when this job starts
    run_s: float
    eviction_s: float  # reload cost of the warm models this job's load would evict
    queued: int  # jobs ahead of it (queued + running)
    evicts: tuple[str, ...] = ()
    scarcity_s: float = 0.0  # charge for taking time that scarcer work needs (routing.demand)
    adapter_load_s: float = 0.0  # loading its LoRA adapters onto the warm pipeline
    load_credit_s: float = 0.0  # the part of cold_load_s Auto's rank does not count (COLD_LOAD_CREDIT)

    @property
    def finish_s(self) -> float:
        return self.work_ahead_s + self.cold_load_s + self.adapter_load_s + self.run_s + self.eviction_s

    @property
    def occupancy_s(self) -> float:
        """Seconds this job itself keeps the machine busy: its cold load, its adapters' load and its run."""
        return self.cold_load_s + self.adapter_load_s + self.run_s

    @property
    def charged_s(self) -> float:
        """Expected finish + scarcity charge: what a move onto an idle machine must beat
        (``routing.placement.best_move``; a move gains only what it really gains)."""
        return self.finish_s + self.scarcity_s

    @property
    def score_s(self) -> float:
        """What Auto minimises (seconds): expected finish + scarcity charge, less the load
        credit (``COLD_LOAD_CREDIT`` of the cold load when the model's later jobs may use it)."""
        return self.charged_s - self.load_credit_s

    def as_json(self) -> dict[str, object]:
        return {
            "finish_s": round(self.finish_s, 3),
            "work_ahead_s": round(self.work_ahead_s, 3),
            "cold_load_s": round(self.cold_load_s, 3),
            "adapter_load_s": round(self.adapter_load_s, 3),
            "run_s": round(self.run_s, 3),
            "eviction_s": round(self.eviction_s, 3),
            "scarcity_s": round(self.scarcity_s, 3),
            "load_credit_s": round(self.load_credit_s, 3),
            "score_s": round(self.score_s, 3),
            "queued": self.queued,
            "evicts": list(self.evicts),
        }


def working_of(costs: CostModel, model_id: str, kind: str, size: int) -> int:
    """A job's working memory beyond its weights (bytes): ``costs.job_bytes`` less the model's
    weights, the figure journaled at submission and sent to the worker in its claim (R10)."""
    return max(costs.job_bytes(model_id, kind, size) - costs.weights_bytes(model_id), 0)


def drain(
    machine: str,
    *,
    warm_models: Sequence[str],
    queue: Sequence[WorkItem],
    protected: frozenset[str],
    costs: CostModel,
) -> tuple[float, list[str]]:
    """Seconds until ``machine`` has run its whole queue (remaining of the running job, then
    each queued job with a cold load where its model will not be warm), and the warm models
    (LRU order) it will hold then.

    A running job whose model is not in ``warm_models`` is still loading it (a worker reports a
    model warm once loaded): its remaining time includes the rest of that load."""
    memory_kind = costs.memory_kind(machine)
    usable = costs.usable_bytes(machine)
    warm = list(warm_models)
    ahead_s = 0.0
    for item in queue:
        cold = item.model_id not in warm
        admit(
            warm,
            item.model_id,
            memory_kind=memory_kind,
            usable_bytes=usable,
            protected=protected,
            weights_bytes=costs.weights_bytes,
            working_bytes=working_of(costs, item.model_id, item.kind, item.size),
        )
        run_s = costs.run_s(machine, item.model_id, item.kind, item.steps, item.size, item.batch)
        load_s = costs.load_s(machine, item.model_id, item.kind) if cold else 0.0
        if item.elapsed_s is None:
            ahead_s += load_s + run_s
        else:
            ahead_s += remaining_s(run_s, load_s, item.elapsed_s, item.report)
    return ahead_s, warm


def remaining_s(run_s: float, load_s: float, elapsed_s: float, report: StepReport | None = None) -> float:
    """Seconds a running job still needs: expected ``run_s`` (and ``load_s`` of a load still
    under way), ``elapsed_s`` since it started, and its worker's last ``report`` (None when none
    was read).

    - No report: what the estimate leaves, at least 5 % of it.
    - Claimed, no step done yet: the whole run is still ahead, and the rest of the load.
    - Steps done: the steps left at the measured seconds per step (the estimate's, ``run_s`` /
      steps, until two step reports measure it), and never less than the step under way has
      taken already (``since_s``: a step slower than every estimate shows so before it ends),
      less the part of that step done. A job estimated at 5 s that runs at 20 s a step is given
      its truth from its second step on, not 5 % of the estimate.
    """
    if report is None:
        return max(run_s + load_s - elapsed_s, 0.05 * (run_s + load_s))
    if report.step <= 0 or report.total <= 0:
        return run_s + max(load_s - elapsed_s, 0.0)
    per_step_s = report.step_s if report.step_s is not None else run_s / report.total
    per_step_s = max(per_step_s, report.since_s)
    return max(per_step_s * (report.total - report.step) - report.since_s, 0.0)


TAILS_KEPT = 64
"""Appended jobs' outcomes :class:`Drains` keeps per machine (by model, kind, steps, size,
adapters and working memory) while its queue is unchanged; more are forgotten, all at once."""

Tail = tuple[float, float, tuple[str, ...], tuple[float, ...], float, float]
"""What a job appended to a drained queue costs there (:func:`appended`): run seconds, cold
load seconds, the models its load evicts (in order), their reload seconds there, the eviction
charge without demand data (``EVICTION_WEIGHT`` x their sum) and its adapters' load seconds."""

TailKey = tuple[str, str, int, int, tuple[str, ...], int, int]
"""The shape of an appended job whose :data:`Tail` :class:`Drains` keeps: model, kind, steps,
size, adapters, working memory (bytes) and batch."""


def appended(
    machine: str,
    model_id: str,
    kind: str,
    steps: int,
    size: int,
    *,
    warm: list[str],
    protected: frozenset[str],
    costs: CostModel,
    adapters: Sequence[str] = (),
    working_bytes: int,
    batch: int = 1,
) -> Tail:
    """The :data:`Tail` of a job appended to a queue that leaves ``warm`` (model ids, least
    recently used first; mutated: the job's model is admitted as the worker admits it, with
    ``working_bytes`` of working memory beyond its weights, bytes)."""
    run_s = costs.run_s(machine, model_id, kind, steps, size, batch)
    cold_load_s = 0.0 if model_id in warm else costs.load_s(machine, model_id, kind)
    evicted = admit(
        warm,
        model_id,
        memory_kind=costs.memory_kind(machine),
        usable_bytes=costs.usable_bytes(machine),
        protected=protected,
        weights_bytes=costs.weights_bytes,
        working_bytes=working_bytes,
    )
    reload_s = tuple(costs.reload_s(machine, m) for m in evicted)
    eviction_s = EVICTION_WEIGHT * sum(reload_s)
    adapter_load_s = sum(costs.load_s(machine, adapter, ADAPTER_KIND) for adapter in adapters)
    return run_s, cold_load_s, tuple(evicted), reload_s, eviction_s, adapter_load_s


class Drains:
    """:func:`drain` per machine, remembered between decisions.

    Between two decisions most machines' queues are as they were (a submission adds one job to
    one machine), so a machine is drained again only when its queued jobs, warm models,
    commitments or costs changed: the same ``costs`` object at the same
    :attr:`~routing.estimate.CostModel.revision`, and equal queued items (the server's snapshot
    reuses their objects, so comparing them is cheap). Running jobs at the head of a queue are
    counted again at every call: their elapsed time moves. At 500 machines this halves a
    decision (``bench/placement.py``, decision time). While a queue is unchanged, what a job
    appended to it costs (:func:`appended`) is kept too, per job shape (:meth:`tail`).
    """

    def __init__(self) -> None:
        # machine -> (costs, revision, warm models, protected, queued items, (seconds, warm after),
        # appended jobs' tails by (model, kind, steps, size, adapters, working bytes))
        self._last: dict[
            str,
            tuple[
                object,
                int,
                tuple[str, ...],
                frozenset[str],
                tuple[WorkItem, ...],
                tuple[float, tuple[str, ...]],
                dict[TailKey, Tail],
            ],
        ] = {}

    def _entry(
        self,
        machine: str,
        warm_models: Sequence[str],
        queue: Sequence[WorkItem],
        protected: frozenset[str],
        costs: CostModel,
    ) -> tuple[float, tuple[float, tuple[str, ...]], dict[TailKey, Tail]]:
        """(seconds of the running jobs at the head, the kept (seconds, warm after) of the
        queued ones, the kept tails of that queue)."""
        head, count = 0, len(queue)
        while head < count and queue[head].elapsed_s is not None:
            head += 1
        if head:
            running_s, warm = drain(
                machine, warm_models=warm_models, queue=queue[:head], protected=protected, costs=costs
            )
            start = tuple(warm)
        else:  # as drain() of no job: nothing ahead, the warm models as they are
            running_s, start = 0.0, tuple(warm_models)
        queued, revision = tuple(queue[head:]), costs.revision
        last = self._last.get(machine)
        if (
            last is not None
            and last[0] is costs
            and last[1] == revision
            and last[2] == start
            and last[3] == protected
            and last[4] == queued
        ):
            return running_s, last[5], last[6]
        queued_s, after = drain(machine, warm_models=start, queue=queued, protected=protected, costs=costs)
        drained, tails = (queued_s, tuple(after)), dict[TailKey, Tail]()
        self._last[machine] = (costs, revision, start, protected, queued, drained, tails)
        return running_s, drained, tails

    def __call__(
        self,
        machine: str,
        *,
        warm_models: Sequence[str],
        queue: Sequence[WorkItem],
        protected: frozenset[str],
        costs: CostModel,
    ) -> tuple[float, list[str]]:
        """As :func:`drain`."""
        running_s, (queued_s, end), _ = self._entry(machine, warm_models, queue, protected, costs)
        return running_s + queued_s, list(end)

    def tail(
        self,
        machine: str,
        model_id: str,
        kind: str,
        steps: int,
        size: int,
        *,
        warm_models: Sequence[str],
        queue: Sequence[WorkItem],
        protected: frozenset[str],
        costs: CostModel,
        adapters: Sequence[str] = (),
        working_bytes: int,
        batch: int = 1,
    ) -> tuple[float, Tail]:
        """As :func:`drain`'s seconds, and the :func:`appended` tail of a job after that queue
        (kept while the queue is unchanged; ``working_bytes``: its working memory, bytes)."""
        running_s, (queued_s, end), tails = self._entry(machine, warm_models, queue, protected, costs)
        key = (model_id, kind, steps, size, tuple(adapters), working_bytes, batch)
        found = tails.get(key)
        if found is None:
            if len(tails) >= TAILS_KEPT:
                tails.clear()
            found = appended(
                machine,
                model_id,
                kind,
                steps,
                size,
                warm=list(end),
                protected=protected,
                costs=costs,
                adapters=adapters,
                working_bytes=working_bytes,
                batch=batch,
            )
            tails[key] = found
        return running_s + queued_s, found


def expected_parts(
    machine: str,
    model_id: str,
    kind: str,
    steps: int,
    size: int,
    *,
    warm_models: Sequence[str],
    queue: Sequence[WorkItem],
    extra_queued: int,
    protected: frozenset[str],
    costs: CostModel,
    drains: Drains | None = None,
    adapters: Sequence[str] = (),
    working_bytes: int | None = None,
    batch: int = 1,
) -> tuple[float, Tail]:
    """The seconds of work ahead of a job appended to ``machine``'s queue (the
    :attr:`Breakdown.work_ahead_s`) and its :data:`Tail` there: :func:`expected_finish` in parts.

    Args:
        warm_models: resident models now, least recently used first.
        queue: reserved jobs in FIFO order (the running one first, with ``elapsed_s``).
        extra_queued: jobs known to be ahead but without details (counted at this job's run time).
        drains: the caller's :class:`Drains`, to reuse the drain of an unchanged queue.
        adapters: the job's LoRA adapter ids; each costs its load seconds
            (``costs.load_s(machine, adapter, "adapter")``: learned, else its bytes at the
            machine's load rate) on every job, warm base or not.
        working_bytes: the job's working memory beyond the weights (bytes), as journaled and
            claimed; default :func:`working_of`. Its load is admitted with it, as the worker does.
        batch: the images of the job (its ``size``'s batch; routing.timings.run_seconds).
    """
    if working_bytes is None:
        working_bytes = working_of(costs, model_id, kind, size)
    if drains is not None:
        ahead_s, tail = drains.tail(
            machine,
            model_id,
            kind,
            steps,
            size,
            warm_models=warm_models,
            queue=queue,
            protected=protected,
            costs=costs,
            adapters=adapters,
            working_bytes=working_bytes,
            batch=batch,
        )
    else:
        ahead_s, warm = drain(machine, warm_models=warm_models, queue=queue, protected=protected, costs=costs)
        tail = appended(
            machine,
            model_id,
            kind,
            steps,
            size,
            warm=warm,
            protected=protected,
            costs=costs,
            adapters=adapters,
            working_bytes=working_bytes,
            batch=batch,
        )
    return ahead_s + extra_queued * tail[0], tail


def expected_finish(
    machine: str,
    model_id: str,
    kind: str,
    steps: int,
    size: int,
    *,
    warm_models: Sequence[str],
    queue: Sequence[WorkItem],
    extra_queued: int,
    protected: frozenset[str],
    costs: CostModel,
    drains: Drains | None = None,
    adapters: Sequence[str] = (),
    working_bytes: int | None = None,
    batch: int = 1,
) -> Breakdown:
    """The :class:`Breakdown` of a job appended to ``machine``'s queue; the arguments as
    :func:`expected_parts`."""
    ahead_s, (run_s, cold_load_s, evicts, _, eviction_s, adapter_load_s) = expected_parts(
        machine,
        model_id,
        kind,
        steps,
        size,
        warm_models=warm_models,
        queue=queue,
        extra_queued=extra_queued,
        protected=protected,
        costs=costs,
        drains=drains,
        adapters=adapters,
        working_bytes=working_bytes,
        batch=batch,
    )
    return Breakdown(
        work_ahead_s=ahead_s,
        cold_load_s=cold_load_s,
        run_s=run_s,
        eviction_s=eviction_s,
        queued=len(queue) + extra_queued,
        evicts=evicts,
        adapter_load_s=adapter_load_s,
    )


__all__ = [
    "Breakdown",
    "Drains",
    "Tail",
    "WorkItem",
    "appended",
    "drain",
    "expected_finish",
    "expected_parts",
    "job_size",
    "working_of",
]
