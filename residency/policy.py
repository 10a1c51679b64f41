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

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol


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
            return Plan(refused="residency_protected", message=(
                f"loading {request.model_id!r} needs {request.need_bytes} bytes; {free} bytes are free after "
                f"evicting every unprotected model, and only evicting the protected set ({held}, "
                f"{protected_bytes} bytes) would make room; protected models are never evicted (R15, R16)"))
        # Even evicting everything would not make room by the estimate: evict what may go and
        # try (an estimate is not a measurement; a real OOM is remembered, R21).
        return Plan(tuple(evict))


class DedicatedPolicy:
    """One checkpoint at a time (R15, dedicated memory)."""

    name = "dedicated"

    def plan(self, warm: Sequence[WarmModel], request: LoadRequest) -> Plan:
        return Plan(tuple(m.key for m in warm))


def policy_for(memory_kind: str) -> ResidencyPolicy:
    """The policy of a device's memory kind (``unified`` or ``dedicated``). Raises ``ValueError``."""
    if memory_kind == "unified":
        return UnifiedPolicy()
    if memory_kind == "dedicated":
        return DedicatedPolicy()
    raise ValueError(f"memory_kind must be unified or dedicated, got {memory_kind!r}")
