"""The server's residency facts in Redis: each machine's residency commitments (R16) and its
remembered OOMs (R21). Implements :class:`app.fleet.machines.ResidencyFacts` for placement.

Keys (app/core/keys.py): ``residency(machine)`` is a set of model ids; ``oom(machine)`` a hash
``<model>\\t<kind>`` -> JSON ``{"size": int, "job_id": str, "at": unix seconds}`` keeping the
smallest size (pixels x frames x batch) that ran out of memory.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import redis

from app.core.errors import Conflict, NotFound, Rejected
from app.core.keys import Keys
from app.core.kinds import job_request
from app.fleet.config import Fleet
from app.fleet.costs import FleetCosts
from app.fleet.lock import FleetLock
from app.fleet.machines import MachineStates, ResidencyOf
from app.fleet.multiread import MultiRead
from app.store.registry import Registry
from routing.estimate import readable_bytes
from routing.timings import ADAPTER_KIND


@dataclass(frozen=True)
class OomRecord:
    """One remembered OOM: jobs of ``kind`` with ``model_id`` of ``size`` or larger are refused on ``machine``."""

    machine: str
    model_id: str
    kind: str
    size: int
    job_id: str
    at_s: float

    def public(self) -> dict[str, Any]:
        return {
            "machine": self.machine,
            "model_id": self.model_id,
            "kind": self.kind,
            "size": self.size,
            "job_id": self.job_id,
            "at_s": self.at_s,
        }


class RedisResidencyFacts:
    """Commitments and remembered OOMs of every machine, read from and written to Redis."""

    def __init__(self, client: redis.Redis, keyspace: Keys) -> None:
        self.redis = client
        self.keys = keyspace
        self.read_many = MultiRead(client)

    # ResidencyFacts -------------------------------------------------------------------
    def commitments(self, machine: str) -> frozenset[str]:
        return frozenset(cast("set[str]", self.redis.smembers(self.keys.residency(machine))))

    def oom_sizes(self, machine: str) -> Mapping[tuple[str, str], int]:
        return {(r.model_id, r.kind): r.size for r in self.ooms(machine)}

    def many(self, machines: Sequence[str]) -> dict[str, ResidencyOf]:
        """Commitments and remembered OOM sizes of each of ``machines`` in one Redis command."""
        return self.parse(machines, self.read_many(self.reads(machines)))

    def reads(self, machines: Sequence[str]) -> list[tuple[str, str]]:
        """Two reads per machine: its commitments (SMEMBERS) and its remembered OOMs (HGETALL)."""
        reads = []
        for machine in machines:
            reads += [("SMEMBERS", self.keys.residency(machine)), ("HGETALL", self.keys.oom(machine))]
        return reads

    def parse(self, machines: Sequence[str], replies: Sequence[Any]) -> dict[str, ResidencyOf]:
        """:meth:`many` from the replies to :meth:`reads` (as :class:`~app.fleet.multiread.MultiRead` shapes them)."""
        found = {}
        for i, machine in enumerate(machines):
            committed, ooms = replies[2 * i], replies[2 * i + 1]
            sizes = {(r.model_id, r.kind): r.size for r in (self._record(machine, f, v) for f, v in ooms.items())}
            found[machine] = ResidencyOf(frozenset(committed), sizes)
        return found

    # Commitments (R16) ----------------------------------------------------------------
    def set_commitments(
        self,
        machine: str,
        model_ids: Iterable[str],
        fleet: Fleet,
        registry: Registry,
        backlog: int,
        costs: FleetCosts | None = None,
    ) -> frozenset[str]:
        """Replace ``machine``'s commitments with ``model_ids`` (empty: none).

        ``backlog`` is the number of jobs queued or running there (its reservations); the caller
        holds the fleet lock, so no job is placed between the check and the write.

        Raises:
            NotFound: unknown machine (``unknown_machine``) or model (``unknown_model``), or a
                retired model (``model_retired``).
            Rejected: the machine does not support a model's family (``family_not_supported``):
                it could never hold it, and the commitment would only keep videos off it (R17);
                or the model runs only video (``video_model_not_committable``): R17 would keep
                every job of it off that machine; or it is a LoRA adapter (``adapter_not_committable``); or, with
                ``costs``, the models cannot all stay
                resident beside the largest job they must still run (``commitment_too_large``,
                :func:`check_commitment_memory`).
            Conflict: the machine has work queued or running (``machine_busy``, R16).
        """
        if machine not in fleet.machines:
            raise NotFound(
                f"machine {machine!r} is not in the fleet ({', '.join(sorted(fleet.machines))})",
                reason="unknown_machine",
            )
        wanted = frozenset(model_ids)
        families = fleet.machines[machine].families
        for model_id in sorted(wanted):
            record = registry.get(model_id)  # raises NotFound(unknown_model)
            registry.check_in_service(model_id)  # a retired model runs no job: nothing to keep warm
            family = record.family
            if set(record.kinds) <= {"video"}:
                raise Rejected(
                    f"model {model_id!r} runs only video, and a video job is never placed on a machine "
                    "holding residency commitments (R17): committing it would keep all its jobs off "
                    f"{machine!r}",
                    reason="video_model_not_committable",
                )
            if ADAPTER_KIND in record.kinds:
                raise Rejected(
                    f"{model_id!r} is a LoRA adapter: it is loaded for each job that names it and "
                    "unloaded after, never kept resident; commit its base model",
                    reason="adapter_not_committable",
                )
            if family not in families:
                raise Rejected(
                    f"machine {machine!r} does not support family {family!r} of model {model_id!r}; "
                    f"it supports: {', '.join(sorted(families)) or 'none'}",
                    reason="family_not_supported",
                )
        if costs is not None and wanted:
            check_commitment_memory(machine, wanted, registry, costs)
        queued = int(self.redis.llen(self.keys.queue_list(machine)))
        if backlog or queued:
            raise Conflict(
                f"machine {machine!r} has {max(backlog, queued)} jobs queued or running; its residency "
                f"commitments can change only when it is idle (R16): `homefleet drain {machine}` first",
                reason="machine_busy",
            )
        with self.redis.pipeline() as pipe:
            pipe.delete(self.keys.residency(machine))
            if wanted:
                pipe.sadd(self.keys.residency(machine), *sorted(wanted))
            pipe.execute()
        return wanted

    # Remembered OOM (R21) -------------------------------------------------------------
    def record_oom(self, machine: str, model_id: str, kind: str, size: int, job_id: str) -> OomRecord:
        """Remember that ``kind`` with ``model_id`` of ``size`` ran out of memory on ``machine``
        (the smallest such size is kept)."""
        field = f"{model_id}\t{kind}"
        raw = cast("str | None", self.redis.hget(self.keys.oom(machine), field))  # decoded (create_redis)
        if raw and json.loads(raw)["size"] <= size:
            return self._record(machine, field, raw)
        value = json.dumps({"size": size, "job_id": job_id, "at": time.time()})
        self.redis.hset(self.keys.oom(machine), field, value)
        return self._record(machine, field, value)

    def ooms(self, machine: str) -> list[OomRecord]:
        raw = cast("dict[str, str]", self.redis.hgetall(self.keys.oom(machine)))  # decoded (create_redis)
        return sorted((self._record(machine, f, v) for f, v in raw.items()), key=lambda r: (r.model_id, r.kind))

    def clear_ooms(self, machine: str, model_id: str | None = None, kind: str | None = None) -> int:
        """Forget remembered OOMs of ``machine`` (all, or of one model and/or kind); returns how many."""
        gone = [
            f"{r.model_id}\t{r.kind}"
            for r in self.ooms(machine)
            if (model_id is None or r.model_id == model_id) and (kind is None or r.kind == kind)
        ]
        if gone:
            self.redis.hdel(self.keys.oom(machine), *gone)
        return len(gone)

    @staticmethod
    def _record(machine: str, field: str, raw: str) -> OomRecord:
        model_id, kind = field.split("\t", 1)
        value = json.loads(raw)
        return OomRecord(machine, model_id, kind, int(value["size"]), str(value["job_id"]), float(value["at"]))


def check_commitment_memory(machine: str, wanted: Iterable[str], registry: Registry, costs: FleetCosts) -> None:
    """Refuse committing ``wanted`` to ``machine`` when their weights (each priced as its
    variant loads, :meth:`Registry.weights_bytes`) plus the working memory of the largest job
    they must still run (each model's kind at its family's default size, ``job_request``; the
    fleet config's working-memory coefficients) exceed the machine's usable memory
    (``memory_bytes``): such a commitment could never be resident. A machine with no
    memory figure (0) is not checked.

    Raises:
        Rejected: reason ``commitment_too_large``, naming every figure and the one that decided.
    """
    estimator = costs.estimator()
    usable = estimator.usable_bytes(machine)
    if not usable:
        return
    weights: dict[str, int] = {}
    working: dict[str, tuple[str, int]] = {}
    for model_id in sorted(wanted):
        record = registry.get(model_id)
        kind = next((k for k in record.kinds if k != "video"), record.kinds[0])
        size = job_request(model_id, record.family, kind, machine, {}).size
        estimate = estimator.memory(model_id, kind, size)
        weights[model_id] = estimate.weights_bytes
        working[model_id] = (kind, estimate.working_bytes)
    largest = max(working, key=lambda model_id: working[model_id][1])
    need = sum(weights.values()) + working[largest][1]
    if need > usable:
        listed = ", ".join(f"{model_id} {readable_bytes(size)}" for model_id, size in weights.items())
        raise Rejected(
            f"machine {machine!r} cannot keep {', '.join(weights)} resident: their weights ({listed}) plus the working "
            f"memory of the largest job they must still run ({largest} {working[largest][0]} at its default size: "
            f"{readable_bytes(working[largest][1])}) need {readable_bytes(need)}, and {machine!r} has "
            f"{readable_bytes(usable)} usable (memory_bytes); commit fewer models or smaller variants",
            reason="commitment_too_large",
        )


def commit_residency(
    lock: FleetLock,
    machines: MachineStates,
    facts: RedisResidencyFacts,
    registry: Registry,
    machine: str,
    model_ids: Iterable[str],
    costs: FleetCosts | None = None,
) -> frozenset[str]:
    """Replace ``machine``'s commitments under the fleet lock (R14), so that no job is placed
    there between the idle check and the write (R16); the write happens only while the lock
    is still ours (C04).

    Raises:
        NotFound, Rejected, Conflict: as :meth:`RedisResidencyFacts.set_commitments` (with
            ``costs``, the memory check included).
        PlacementLost: the fleet lock was not free within ``fleet_lock_wait_s``, or expired
            before the write (nothing written).
    """
    with lock.held("try again") as fence:
        backlog = machines.view(machine).backlog if machine in machines.fleet.machines else 0
        fence.require("the residency commitments were written")
        return facts.set_commitments(machine, model_ids, machines.fleet, registry, backlog, costs)
