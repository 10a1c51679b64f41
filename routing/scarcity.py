"""Auto's scarcity data at each decision (R12): which machines can run each model, and the
pressure that recent demand puts on them (:func:`routing.demand.pressure`).

Which machines can run a model changes only when a machine's capabilities do (online,
draining, syncing, verified models, commitments, remembered OOMs, a full queue) or the cost
model is replaced; recomputing it at every decision cost more than the decision itself at
hundreds of machines (``bench/placement.py``, decision time: about 10 ms of 15 at 500
machines). :class:`Scarcity` keeps it while those are unchanged; the demand rates are read
fresh at every decision. The server (``app/jobs/dispatch.py``), the simulator (``bench/sim.py``)
and the decision-time benchmark use the same class.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping

from routing.demand import Pressure, Spread, able_with_pinned, pressure, spread, with_default_share
from routing.estimate import CostModel
from routing.placement import DEFAULT_TARGET, MachineView, able_machines


def capabilities(machine: MachineView) -> Hashable:
    """What :func:`routing.placement.exclusion` reads of ``machine`` for a reference-size job:
    every field but its queue and warm models, and of its backlog only whether it is full."""
    full = machine.max_queued is not None and machine.backlog >= machine.max_queued
    return (
        machine.name,
        machine.online,
        machine.syncing,
        machine.draining,
        machine.families,
        machine.verified_models,
        machine.commitments,
        tuple(sorted(machine.oom_sizes.items())),
        full,
    )


class Scarcity:
    """The able sets of the last decision, reused while the machines' :func:`capabilities`,
    the models and the cost model (the same object) are unchanged; and their
    :class:`~routing.demand.Spread`, reused while those and the demand classes are.

    Each cache is one tuple, replaced whole: a dry run outside the fleet lock may use the same
    instance from another thread, and never sees one decision's key with another's result.
    """

    def __init__(self) -> None:
        self._able: tuple[CostModel | None, tuple[Hashable, ...], dict[str, frozenset[str]]] = (None, (), {})
        self._spread: tuple[dict[str, frozenset[str]] | None, tuple[tuple[str, ...], dict[str, float]], Spread] = (
            None,
            ((), {}),
            Spread({}, {}, {}),
        )

    def able(
        self, machines: Mapping[str, MachineView], costs: CostModel, models: Mapping[str, tuple[str, str]]
    ) -> dict[str, frozenset[str]]:
        """model -> the online machines whose filters pass a reference-size job of it
        (:func:`routing.placement.able_machines`). ``models``: model -> (family, kind)."""
        key = (tuple(models.items()), *(capabilities(v) for v in machines.values() if v.online))
        last_costs, last_key, able = self._able
        if costs is not last_costs or key != last_key:
            able = able_machines({n: v for n, v in machines.items() if v.online}, costs, models)
            self._able = (costs, key, able)
        return able

    def pressure(
        self,
        machines: Mapping[str, MachineView],
        costs: CostModel,
        models: Mapping[str, tuple[str, str]],
        rates: Mapping[str, tuple[float, float]],
        speed: Mapping[str, float],
    ) -> dict[str, Pressure]:
        """:class:`~routing.demand.Pressure` per online machine from the demand ``rates``
        (:meth:`routing.demand.Demand.rates`; pinned classes included) and ``speed`` (machine
        -> relative speed). The default target's pinned classes get at least
        ``routing.demand.DEFAULT_SHARE`` of each model's demand
        (:func:`routing.demand.with_default_share`)."""
        able = self.able(machines, costs, models)
        rates = with_default_share(rates, DEFAULT_TARGET)
        key = (tuple(sorted(rates)), {n: speed[n] for n, v in machines.items() if v.online})
        last_able, last_key, where = self._spread
        if able is not last_able or key != last_key:
            where = spread(key[0], able_with_pinned(able, key[0]), key[1])
            self._spread = (able, key, where)
        return pressure(rates, where)


__all__ = ["Scarcity", "capabilities"]
