"""What the server sees of its machines: heartbeats, verified models, warm models, and the
reservations (queued + running jobs) in Redis."""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import redis

from app.core.keys import Keys
from app.fleet.config import Fleet
from app.fleet.multiread import MultiRead, Read
from app.fleet.reservations import Reservations
from app.fleet.running import step_report
from app.journal.jobs import Journal
from routing.finish import StepReport
from routing.placement import MachineView


class ResidencyFacts(Protocol):
    """Residency commitments (R16) and remembered OOMs (R21) per machine; the residency work
    provides the real one. Sizes are pixels x frames x batch (routing.timings.job_size)."""

    def commitments(self, machine: str) -> frozenset[str]: ...

    def oom_sizes(self, machine: str) -> Mapping[tuple[str, str], int]: ...

    def many(self, machines: Sequence[str]) -> dict[str, ResidencyOf]:
        """Both facts for each of ``machines`` at once (one round trip where they are remote)."""
        ...

    def reads(self, machines: Sequence[str]) -> list[tuple[str, str]]:
        """The Redis reads behind :meth:`many` (:data:`app.fleet.multiread.READS`; none when the facts
        are not in Redis), so a caller can send them with its own in one command."""
        ...

    def parse(self, machines: Sequence[str], replies: Sequence[Any]) -> dict[str, ResidencyOf]:
        """:meth:`many` from the replies to :meth:`reads`, in order."""
        ...


@dataclass(frozen=True)
class ResidencyOf:
    """One machine's residency facts: its commitments and its remembered OOM sizes."""

    commitments: frozenset[str] = frozenset()
    oom_sizes: Mapping[tuple[str, str], int] = field(default_factory=dict)


class NoResidencyFacts:
    """No commitments and no remembered OOM anywhere (until the residency work fills them)."""

    def commitments(self, machine: str) -> frozenset[str]:
        return frozenset()

    def oom_sizes(self, machine: str) -> Mapping[tuple[str, str], int]:
        return {}

    def many(self, machines: Sequence[str]) -> dict[str, ResidencyOf]:
        return {name: ResidencyOf() for name in machines}

    def reads(self, machines: Sequence[str]) -> list[tuple[str, str]]:
        return []

    def parse(self, machines: Sequence[str], replies: Sequence[Any]) -> dict[str, ResidencyOf]:
        return self.many(machines)


@dataclass(frozen=True)
class StaticResidencyFacts:
    """Fixed commitments and remembered OOMs per machine (configuration, tests, the simulator)."""

    committed: Mapping[str, frozenset[str]] = field(default_factory=dict)
    ooms: Mapping[str, Mapping[tuple[str, str], int]] = field(default_factory=dict)

    def commitments(self, machine: str) -> frozenset[str]:
        return frozenset(self.committed.get(machine, frozenset()))

    def oom_sizes(self, machine: str) -> Mapping[tuple[str, str], int]:
        return dict(self.ooms.get(machine, {}))

    def many(self, machines: Sequence[str]) -> dict[str, ResidencyOf]:
        return {name: ResidencyOf(self.commitments(name), self.oom_sizes(name)) for name in machines}

    def reads(self, machines: Sequence[str]) -> list[tuple[str, str]]:
        return []

    def parse(self, machines: Sequence[str], replies: Sequence[Any]) -> dict[str, ResidencyOf]:
        return self.many(machines)


STEPS_EVERY_S = 1.0
"""Running jobs' step reports are read into a snapshot at most this often (seconds); in between,
a snapshot uses the last reports, that much older. At hundreds of
machines all busy the reads add a third to a snapshot (bench/snapshot_progress.py), and a step
rate moves slowly: a burst of submissions pays for them once a second, not once each."""


class MachineStates:
    """Reads machine liveness (heartbeat key with a TTL), the verified model set (R4), the warm
    models the heartbeat advertises (``warm_models``, least recently used first, when present)
    and the reservations (queued + running jobs, FIFO)."""

    def __init__(
        self,
        client: redis.Redis,
        keyspace: Keys,
        fleet: Fleet,
        journal: Journal,
        residency: ResidencyFacts | None = None,
    ) -> None:
        self.redis = client
        self.keys = keyspace
        self.fleet = fleet
        self.journal = journal
        self.reservations = Reservations(client, keyspace)
        self.residency: ResidencyFacts = residency or NoResidencyFacts()
        self.read_many = MultiRead(client)
        # when running jobs' step reports were last read, and their figures (app/fleet/running.py)
        self._steps: tuple[float, dict[str, StepReport | None]] = (0.0, {})

    def heartbeat(self, machine: str) -> dict[str, Any] | None:
        raw = self.redis.get(self.keys.heartbeat(machine))
        return json.loads(raw) if raw else None

    def queued_in_redis(self, machine: str) -> int:
        """LLEN of ``machine.<name>``'s list (under the broker key prefix): jobs waiting in that
        machine's line, not the one running (R8)."""
        return int(self.redis.llen(self.keys.queue_list(machine)))

    def view(self, machine: str) -> MachineView:
        return self.views([machine])[machine]

    def views(self, names: list[str] | None = None) -> dict[str, MachineView]:
        """Every machine's view (or those named), read in one Redis command (machine state and
        residency facts; app/fleet/multiread.py)."""
        return self.snapshot(names)[0]

    def snapshot(
        self, names: list[str] | None = None, also: Sequence[tuple[str, str]] = (), max_queued: int | None = None
    ) -> tuple[dict[str, MachineView], list[Any]]:
        """:meth:`views`, and the replies to ``also`` (more reads of :data:`app.fleet.multiread.READS`,
        e.g. the fleet's demand) read in the same command, at the same instant. ``max_queued``
        goes into every view (R23: the backlog at which a machine takes no more jobs).

        Raises:
            ValueError: a read in ``also`` is not one of :data:`app.fleet.multiread.READS`.
        """
        names = list(self.fleet.machines) if names is None else names
        reads: list[Read] = list(also)
        seen = {}
        for name in names:
            reserved_read, seen[name] = self.reservations.snapshot_read(name)
            reads += [
                ("GET", self.keys.heartbeat(name)),
                ("SMEMBERS", self.keys.verified(name)),
                reserved_read,
                ("EXISTS", self.keys.draining(name)),
                ("EXISTS", self.keys.syncing(name)),
            ]
        machine_reads = len(reads)
        reads += self.residency.reads(names)
        residency_reads = len(reads)
        now_s = time.time()
        read_at, known = self._steps
        fresh = now_s - read_at >= STEPS_EVERY_S
        running = [job_id for name in names for job_id in self.reservations.running(name)] if fresh else []
        reads += [("PROGRESS", self.keys.progress(job_id)) for job_id in running]  # the jobs running as last read
        replies = self.read_many(reads)
        residency = self.residency.parse(names, replies[machine_reads:residency_reads])
        if fresh:
            known = {
                job_id: step_report(reply, now_s)
                for job_id, reply in zip(running, replies[residency_reads:], strict=True)
            }
            self._steps = (now_s, known)  # replaced whole: a dry run in another thread reads one or the other
            progress = known
        else:  # read less than STEPS_EVERY_S ago: the same reports, that much older
            since_s = now_s - read_at
            progress = {job_id: None if report is None else report.aged(since_s) for job_id, report in known.items()}
        found = {}
        for i, name in enumerate(names):
            first = len(also) + 5 * i
            raw_beat, verified, reserved, draining, syncing = replies[first : first + 5]
            beat = json.loads(raw_beat) if raw_beat else None
            queue = self.reservations.items_from(
                name, self.reservations.snapshot_hash(name, reserved, seen[name]), now_s, progress
            )
            found[name] = MachineView(
                name=name,
                online=beat is not None,
                families=self.fleet.machines[name].families,
                verified_models=frozenset(verified),
                backlog=len(queue),
                queue=queue,
                warm_models=tuple((beat or {}).get("warm_models", ())),
                commitments=residency[name].commitments,
                oom_sizes=residency[name].oom_sizes,
                draining=bool(draining),
                syncing=bool(syncing),
                max_queued=max_queued,
            )
        return found, replies[: len(also)]
