"""What the server sees of its machines: heartbeats, verified models and backlog in Redis."""

from __future__ import annotations

import json
from typing import Any

import redis

from app import keys
from app.fleet import Fleet
from app.journal import Journal
from app.keys import Keys
from routing.placement import MachineView


class MachineStates:
    """Reads machine liveness (heartbeat key with a TTL), the verified model set (R4) and the
    backlog (the journal's queued + running jobs of that machine; ``queued_in_redis`` gives
    LLEN of its exact queue key)."""

    def __init__(self, client: redis.Redis, keyspace: Keys, fleet: Fleet, journal: Journal) -> None:
        self.redis = client
        self.keys = keyspace
        self.fleet = fleet
        self.journal = journal

    def heartbeat(self, machine: str) -> dict[str, Any] | None:
        raw = self.redis.get(self.keys.heartbeat(machine))
        return json.loads(raw) if raw else None

    def queued_in_redis(self, machine: str) -> int:
        """LLEN of ``machine.<name>``: jobs waiting in that machine's line (R8)."""
        return int(self.redis.llen(keys.queue(machine)))

    def view(self, machine: str) -> MachineView:
        config = self.fleet.machines[machine]
        return MachineView(
            name=machine,
            online=self.heartbeat(machine) is not None,
            families=config.families,
            verified_models=frozenset(self.redis.smembers(self.keys.verified(machine))),
            backlog=self.journal.count_active(machine),
            syncing=bool(self.redis.exists(self.keys.syncing(machine))),
        )

    def views(self) -> dict[str, MachineView]:
        return {name: self.view(name) for name in self.fleet.machines}
