"""Placement's cost data on the server (R12, R13): the :class:`~routing.estimate.Estimator`
built from the fleet config (speed, load rate, usable memory, working-memory coefficients by
kind and family), the registry (family, kinds,
exact weight bytes from safetensors headers) and the persisted learned timings; and the recent
demand per model kept in Redis for Auto's scarcity charge (``routing.demand``).
"""

from __future__ import annotations

import json
import time

import redis

from app.fleet import Fleet
from app.keys import Keys
from app.model_sizes import model_weight_bytes
from app.registry import Registry
from app.timings import TimingStore
from routing.demand import Demand
from routing.estimate import Estimator, MachineProfile, ModelProfile


class FleetCosts:
    """Builds a fresh :class:`Estimator` per decision (learned timings change as jobs finish);
    weight bytes are read once per (model, total bytes) and cached."""

    def __init__(self, fleet: Fleet, registry: Registry, timings: TimingStore) -> None:
        self.fleet = fleet
        self.registry = registry
        self.timings = timings
        self._weights: dict[tuple[str, int], int] = {}
        self._working = fleet.working()  # working-memory coefficients by kind and family

    def machine_profiles(self) -> dict[str, MachineProfile]:
        return {
            name: MachineProfile(name, m.speed, m.load_bytes_per_s, str(m.memory_kind), m.memory_bytes)
            for name, m in self.fleet.machines.items()
        }

    def model_profiles(self) -> dict[str, ModelProfile]:
        profiles = {}
        for record in self.registry.list():
            key = (record.id, record.total_bytes)
            if key not in self._weights:
                self._weights[key] = model_weight_bytes(self.registry.folder(record.id))
            kind = record.kinds[0] if record.kinds else "txt2img"
            profiles[record.id] = ModelProfile(record.id, record.family, self._weights[key], kind=kind)
        return profiles

    def estimator(self) -> Estimator:
        return Estimator(self.machine_profiles(), self.model_profiles(), self.timings.load(), self._working)


class DemandStore:
    """The fleet's :class:`Demand` in the Redis hash ``<prefix>:demand`` (class -> JSON
    ``[work_s, jobs, at_s]``); written under the fleet lock at each submission."""

    def __init__(self, client: redis.Redis, keyspace: Keys) -> None:
        self.redis = client
        self.keys = keyspace

    def load(self) -> Demand:
        raw = self.redis.hgetall(self.keys.demand())
        return Demand(levels={k: tuple(json.loads(v)) for k, v in raw.items()})  # type: ignore[misc]

    def add(self, demand_class: str, work_s: float, now_s: float | None = None, *, current: Demand | None = None,
            pipe: redis.client.Pipeline | None = None) -> None:
        """Record one submission of ``work_s`` speed-1.0 seconds in ``demand_class``.

        ``current``: the demand just read by :meth:`load` under the same fleet lock (saves a
        read); ``pipe``: queue the write on that pipeline instead of sending it at once."""
        now_s = time.time() if now_s is None else now_s
        if current is None:
            raw = self.redis.hget(self.keys.demand(), demand_class)
            level = tuple(json.loads(raw)) if raw else None
        else:
            level = current.levels.get(demand_class)
        demand = Demand(levels={demand_class: level} if level else {})  # type: ignore[dict-item]
        demand.add(demand_class, work_s, now_s)
        (pipe or self.redis).hset(self.keys.demand(), demand_class, json.dumps(list(demand.levels[demand_class])))
