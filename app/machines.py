"""What the server sees of its machines: heartbeats, verified models, warm models, and the
reservations (queued + running jobs) in Redis."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import redis

from app import keys
from app.fleet import Fleet
from app.journal import Journal
from app.keys import Keys
from app.reservations import Reservations
from routing.placement import MachineView


class ResidencyFacts(Protocol):
    """Residency commitments (R16) and remembered OOMs (R21) per machine; the residency work
    provides the real one. Sizes are pixels x frames x batch (routing.timings.job_size)."""

    def commitments(self, machine: str) -> frozenset[str]: ...

    def oom_sizes(self, machine: str) -> Mapping[tuple[str, str], int]: ...


class NoResidencyFacts:
    """No commitments and no remembered OOM anywhere (until the residency work fills them)."""

    def commitments(self, machine: str) -> frozenset[str]:
        return frozenset()

    def oom_sizes(self, machine: str) -> Mapping[tuple[str, str], int]:
        return {}


@dataclass(frozen=True)
class StaticResidencyFacts:
    """Fixed commitments and remembered OOMs per machine (configuration, tests, the simulator)."""

    committed: Mapping[str, frozenset[str]] = field(default_factory=dict)
    ooms: Mapping[str, Mapping[tuple[str, str], int]] = field(default_factory=dict)

    def commitments(self, machine: str) -> frozenset[str]:
        return frozenset(self.committed.get(machine, frozenset()))

    def oom_sizes(self, machine: str) -> Mapping[tuple[str, str], int]:
        return dict(self.ooms.get(machine, {}))


class MachineStates:
    """Reads machine liveness (heartbeat key with a TTL), the verified model set (R4), the warm
    models the heartbeat advertises (``warm_models``, least recently used first, when present)
    and the reservations (queued + running jobs, FIFO)."""

    def __init__(self, client: redis.Redis, keyspace: Keys, fleet: Fleet, journal: Journal,
                 residency: ResidencyFacts | None = None) -> None:
        self.redis = client
        self.keys = keyspace
        self.fleet = fleet
        self.journal = journal
        self.reservations = Reservations(client, keyspace)
        self.residency: ResidencyFacts = residency or NoResidencyFacts()

    def heartbeat(self, machine: str) -> dict[str, Any] | None:
        raw = self.redis.get(self.keys.heartbeat(machine))
        return json.loads(raw) if raw else None

    def queued_in_redis(self, machine: str) -> int:
        """LLEN of ``machine.<name>``: jobs waiting in that machine's line (R8)."""
        return int(self.redis.llen(keys.queue(machine)))

    def view(self, machine: str) -> MachineView:
        return self.views([machine])[machine]

    def views(self, names: list[str] | None = None) -> dict[str, MachineView]:
        """Every machine's view (or those named), read in one Redis round trip."""
        names = list(self.fleet.machines) if names is None else names
        with self.redis.pipeline(transaction=False) as pipe:
            for name in names:
                pipe.get(self.keys.heartbeat(name))
                pipe.smembers(self.keys.verified(name))
                pipe.hgetall(self.keys.reservations(name))
                pipe.exists(self.keys.draining(name))
                pipe.exists(self.keys.syncing(name))
            replies = pipe.execute()
        found = {}
        for i, name in enumerate(names):
            raw_beat, verified, reserved, draining, syncing = replies[5 * i: 5 * i + 5]
            beat = json.loads(raw_beat) if raw_beat else None
            queue = self.reservations.items_from(reserved)
            found[name] = MachineView(
                name=name,
                online=beat is not None,
                families=self.fleet.machines[name].families,
                verified_models=frozenset(verified),
                backlog=len(queue),
                queue=queue,
                warm_models=tuple((beat or {}).get("warm_models", ())),
                commitments=self.residency.commitments(name),
                oom_sizes=self.residency.oom_sizes(name),
                draining=bool(draining),
                syncing=bool(syncing),
            )
        return found
