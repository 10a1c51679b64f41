"""Residency policies (R15): which warm models to evict before loading another. Pure: they
take the warm set and memory figures and return a decision; the model cache carries it out.

- :class:`UnifiedPolicy` (CPU, Apple MPS, the server): warm models are kept while there is
  headroom; the *protected set* (the machine's residency commitments, R16) is never evicted;
  unprotected warm models are evicted least-recently-used first when room is needed. A load
  that could only fit by evicting a protected model is refused with that reason.
- :class:`DedicatedPolicy` (CUDA): exactly one checkpoint resident; every other one is
  evicted before a load (the cache then drops every reference, collects garbage and empties
  the allocator cache, C05).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from residency.device import MemoryKind


@dataclass(frozen=True)
class WarmModel:
    """A resident pipeline as the policy sees it: its cache ``key``, ``model_id`` and ``bytes`` held."""

    key: str
    model_id: str
    bytes: int


@dataclass(frozen=True)
class Plan:
    """A policy's decision for one load: ``evict`` (cache keys, in order) then load, or
    ``refused`` (a reason code) with a ``message`` naming the models and bytes."""

    evict: tuple[str, ...] = ()
    refused: str | None = None
    message: str = ""


@dataclass(frozen=True)
class LoadRequest:
    """One load to plan: the model, the bytes it needs (weights + the job's working memory),
    the memory still free (``free_bytes``, not counting what the warm models hold) and the
    machine's ``protected`` model ids."""

    model_id: str
    need_bytes: int
    free_bytes: int
    protected: frozenset[str] = field(default_factory=frozenset)


class ResidencyPolicy(Protocol):
    name: str

    def plan(self, warm: Sequence[WarmModel], request: LoadRequest) -> Plan:
        """``warm`` is least recently used first."""
        ...


class UnifiedPolicy:
    """Headroom + protected set + LRU eviction (R15, unified memory)."""

    name = "unified"

    def plan(self, warm: Sequence[WarmModel], request: LoadRequest) -> Plan:
        if request.need_bytes <= request.free_bytes:
            return Plan()
        evict: list[str] = []
        free = request.free_bytes
        for model in warm:  # least recently used first
            if model.model_id in request.protected:
                continue
            evict.append(model.key)
            free += model.bytes
            if free >= request.need_bytes:
                return Plan(tuple(evict))
        protected_bytes = sum(m.bytes for m in warm if m.model_id in request.protected)
        if protected_bytes and free + protected_bytes >= request.need_bytes:
            held = ", ".join(sorted({m.model_id for m in warm if m.model_id in request.protected}))
            return Plan(
                refused="residency_protected",
                message=(
                    f"loading {request.model_id!r} needs {request.need_bytes} bytes; {free} bytes are free after "
                    f"evicting every unprotected model, and only evicting the protected set ({held}, "
                    f"{protected_bytes} bytes) would make room; protected models are never evicted (R15, R16)"
                ),
            )
        # Even evicting everything would not make room by the estimate: evict what may go and
        # try (an estimate is not a measurement; a real OOM is remembered, R21).
        return Plan(tuple(evict))


class DedicatedPolicy:
    """One checkpoint at a time (R15, dedicated memory)."""

    name = "dedicated"

    def plan(self, warm: Sequence[WarmModel], request: LoadRequest) -> Plan:
        return Plan(tuple(m.key for m in warm))


_POLICIES: dict[str, ResidencyPolicy] = {MemoryKind.unified: UnifiedPolicy(), MemoryKind.dedicated: DedicatedPolicy()}


def policy_for(memory_kind: str) -> ResidencyPolicy:
    """The policy of a device's memory kind (``unified`` or ``dedicated``). Raises ``ValueError``."""
    if memory_kind not in _POLICIES:
        raise ValueError(f"memory_kind must be unified or dedicated, got {memory_kind!r}")
    return _POLICIES[memory_kind]


def plan_load(
    policy: ResidencyPolicy,
    warm: Sequence[WarmModel],
    model_id: str,
    *,
    weights_bytes: int,
    working_bytes: int,
    free_bytes: int,
    protected: frozenset[str],
) -> Plan:
    """The admission rule of a cold load (R15), one for the worker's cache
    (``residency.cache.ModelCache.get``) and placement's simulation of it (:func:`admit`):
    ``policy`` plans room for the model's ``weights_bytes`` plus the job's ``working_bytes``
    (bytes; the working memory the job needs beyond the weights) in ``free_bytes`` (memory not
    held by the ``warm`` models, least recently used first), never evicting ``protected``."""
    return policy.plan(warm, LoadRequest(model_id, weights_bytes + working_bytes, free_bytes, protected))


def admit(
    warm: list[str],
    model_id: str,
    *,
    memory_kind: str,
    usable_bytes: int,
    protected: frozenset[str],
    weights_bytes: Callable[[str], int],
    working_bytes: int = 0,
) -> list[str]:
    """The residency model as placement simulates it along a machine's queue (R12, R15): make
    ``model_id`` the most recently used of ``warm`` (model ids, least recently used first;
    mutated), evicting as the worker's policy would; return the evicted models.

    The plan is the worker's own (:func:`plan_load`): a warm model is reused as it is; a cold
    one needs its weights plus the job's ``working_bytes`` (bytes) within ``usable_bytes``
    (bytes; 0 = unknown: nothing is evicted on unified memory), the warm models holding their
    ``weights_bytes``. Where the worker would refuse the load (only evicting a protected model
    makes room, ``residency_protected``), the simulation evicts every unprotected model and goes
    on: the worker's estimate is not a measurement either, and placement refuses such jobs up
    front (``residency_conflict``).
    """
    if model_id in warm:
        warm.remove(model_id)
        warm.append(model_id)
        return []
    policy = policy_for(memory_kind)
    if usable_bytes <= 0 and memory_kind == MemoryKind.unified:
        warm.append(model_id)
        return []
    held = [WarmModel(m, m, weights_bytes(m)) for m in warm]
    plan = plan_load(
        policy,
        held,
        model_id,
        weights_bytes=weights_bytes(model_id),
        working_bytes=working_bytes,
        free_bytes=usable_bytes - sum(m.bytes for m in held),
        protected=protected,
    )
    evicted = list(plan.evict) if plan.refused is None else [m for m in warm if m not in protected]
    for m in evicted:
        warm.remove(m)
    warm.append(model_id)
    return evicted
