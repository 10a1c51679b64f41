"""The durable copy of residency commitments (R16) and remembered OOMs (R21) in the journal's
database; Redis keeps the hot copy that placement and the workers read (``app/fleet/residency.py``).

Every write goes to both: :class:`DurableResidencyFacts` writes Redis as
:class:`~app.fleet.residency.RedisResidencyFacts` does and the database (see each method for the
order and what a failed database write leaves). When Redis loses its copy (restarted without
persistence, flushed), :meth:`DurableResidencyFacts.restore` writes it again from the database;
the server calls it at start and in every reconciliation pass (``app/jobs/reconcile.py``, every
``reconcile_interval_s``), under the fleet lock.

Only a restore sets the marker key ``Keys.residency_durable`` in Redis; its absence is how a
lost copy is noticed (a write made meanwhile is in the database, so the next restore keeps it).
On the first start after an upgrade the database is still empty while Redis holds the facts:
they are adopted into the database instead of being wiped.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import redis
from sqlalchemy import delete
from sqlalchemy.dialects.postgresql import insert as postgresql_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.engine import Engine
from sqlalchemy.exc import SQLAlchemyError
from sqlmodel import Session, col, select

from app.core.keys import Keys
from app.db.tables import RememberedOom, ResidencyCommitment
from app.fleet.config import Fleet
from app.fleet.costs import FleetCosts
from app.fleet.residency import OomRecord, RedisResidencyFacts
from app.store.registry import Registry

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Restored:
    """What :meth:`DurableResidencyFacts.restore` did: ``source`` is ``database`` (Redis was
    written from it), ``redis`` (an empty database adopted Redis's copy) or ``none`` (Redis
    still had its copy); counts of machines with commitments and of OOM records."""

    source: str
    commitments: int = 0
    ooms: int = 0


class ResidencyStore:
    """Commitments and remembered OOMs in the journal's database. Every method is one transaction."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def save_commitments(self, machine: str, model_ids: Iterable[str]) -> None:
        """Replace ``machine``'s commitments with ``model_ids`` (empty: none)."""
        with Session(self.engine) as session:
            session.exec(delete(ResidencyCommitment).where(col(ResidencyCommitment.machine) == machine))
            session.add_all(ResidencyCommitment(machine=machine, model_id=m) for m in sorted(set(model_ids)))
            session.commit()

    def commitments(self) -> dict[str, frozenset[str]]:
        """Every machine's commitments (machines without any are absent)."""
        found: dict[str, set[str]] = {}
        with Session(self.engine) as session:
            for row in session.exec(select(ResidencyCommitment)):
                found.setdefault(row.machine, set()).add(row.model_id)
        return {machine: frozenset(models) for machine, models in found.items()}

    def save_oom(self, record: OomRecord) -> None:
        """Insert the record of (machine, model, kind), or replace a stored one of a larger size
        (the smallest size that ran out of memory is kept, as in Redis). One atomic
        ``INSERT … ON CONFLICT`` on SQLite and PostgreSQL, so concurrent reports cannot collide."""
        row: dict[str, Any] = {
            "machine": record.machine,
            "model_id": record.model_id,
            "kind": record.kind,
            "size": record.size,
            "job_id": record.job_id,
            "at_s": record.at_s,
        }
        dialect = self.engine.dialect.name
        with Session(self.engine) as session:
            if dialect in ("sqlite", "postgresql"):
                insert = sqlite_insert if dialect == "sqlite" else postgresql_insert
                statement = insert(RememberedOom).values(**row)
                session.exec(
                    statement.on_conflict_do_update(
                        index_elements=["machine", "model_id", "kind"],
                        set_={
                            "size": statement.excluded.size,
                            "job_id": statement.excluded.job_id,
                            "at_s": statement.excluded.at_s,
                        },
                        where=col(RememberedOom.size) > statement.excluded.size,
                    )
                )
            else:  # another SQLAlchemy backend: read, then write (not atomic against a concurrent report)
                stored = session.get(RememberedOom, (record.machine, record.model_id, record.kind))
                if stored is None or stored.size > record.size:
                    session.merge(RememberedOom(**row))
            session.commit()

    def delete_ooms(self, machine: str, model_id: str | None = None, kind: str | None = None) -> int:
        """Delete ``machine``'s records (all, or of one model and/or kind); returns how many."""
        statement = delete(RememberedOom).where(col(RememberedOom.machine) == machine)
        if model_id is not None:
            statement = statement.where(col(RememberedOom.model_id) == model_id)
        if kind is not None:
            statement = statement.where(col(RememberedOom.kind) == kind)
        with Session(self.engine) as session:
            deleted = session.exec(statement).rowcount
            session.commit()
        return int(deleted)

    def ooms(self, machine: str | None = None) -> list[OomRecord]:
        """Remembered OOMs of every machine, or of ``machine``."""
        statement = select(RememberedOom)
        if machine is not None:
            statement = statement.where(col(RememberedOom.machine) == machine)
        with Session(self.engine) as session:
            return [OomRecord(r.machine, r.model_id, r.kind, r.size, r.job_id, r.at_s) for r in session.exec(statement)]

    def empty(self) -> bool:
        with Session(self.engine) as session:
            return (
                session.exec(select(ResidencyCommitment).limit(1)).first() is None
                and session.exec(select(RememberedOom).limit(1)).first() is None
            )


class DurableResidencyFacts(RedisResidencyFacts):
    """:class:`RedisResidencyFacts` (same reads, same Redis keys) whose writes also go to the
    database, and whose Redis copy is restored from it when lost."""

    def __init__(self, client: redis.Redis, keyspace: Keys, store: ResidencyStore, fleet: Fleet) -> None:
        super().__init__(client, keyspace)
        self.store = store
        self.fleet = fleet

    def set_commitments(
        self,
        machine: str,
        model_ids: Iterable[str],
        fleet: Fleet,
        registry: Registry,
        backlog: int,
        costs: FleetCosts | None = None,
    ) -> frozenset[str]:
        """As :meth:`RedisResidencyFacts.set_commitments`, then written to the database.

        Raises:
            NotFound, Rejected, Conflict: as the Redis write (nothing written anywhere).
            sqlalchemy.exc.SQLAlchemyError: the database write failed; Redis is put back as
                the database says, so both still agree.
        """
        wanted = super().set_commitments(machine, model_ids, fleet, registry, backlog, costs)
        try:
            self.store.save_commitments(machine, wanted)
        except SQLAlchemyError:
            self._write_commitments(machine, self.store.commitments().get(machine, frozenset()))
            raise
        return wanted

    def release_model(self, model_id: str) -> list[str]:
        """Take ``model_id`` out of every machine's commitments, in the database and in Redis,
        busy machines too (``homefleet models retire``, R1): a retired model runs no job, so
        releasing it changes no placement made, and a commitment to it would only keep videos
        off that machine (R17) and pin memory no job uses. Returns the machines it was released
        on, sorted.

        Raises:
            sqlalchemy.exc.SQLAlchemyError: a database write failed (the machines before it are
                released in both; that one and the later ones in neither).
        """
        released = []
        for machine, models in sorted(self.store.commitments().items()):
            if model_id in models:
                kept = models - {model_id}
                self.store.save_commitments(machine, kept)
                self._write_commitments(machine, kept)
                released.append(machine)
        return released

    def record_oom(self, machine: str, model_id: str, kind: str, size: int, job_id: str) -> OomRecord:
        """As :meth:`RedisResidencyFacts.record_oom` (the smallest size is kept), then written to
        the database. Raises ``sqlalchemy.exc.SQLAlchemyError`` when the database write fails
        (Redis keeps the record: refusing a size that crashed is the safe side)."""
        record = super().record_oom(machine, model_id, kind, size, job_id)
        self.store.save_oom(record)
        return record

    def clear_ooms(self, machine: str, model_id: str | None = None, kind: str | None = None) -> int:
        """Forget remembered OOMs in the database, then in Redis; returns how many were forgotten
        (the larger count of the two copies: one may have been lost). Raises
        ``sqlalchemy.exc.SQLAlchemyError`` when the database delete fails (nothing is forgotten then)."""
        durable = self.store.delete_ooms(machine, model_id, kind)
        return max(durable, super().clear_ooms(machine, model_id, kind))

    def restore(self) -> Restored:
        """Write the Redis copy from the database when Redis lost it (no marker key); adopt
        Redis's copy into an empty database (the first start after an upgrade). Call it under
        the fleet lock, so no commitment changes meanwhile."""
        if self.redis.exists(self.keys.residency_durable()):
            return Restored("none")
        if self.store.empty():
            adopted = self._adopt()
            self.redis.set(self.keys.residency_durable(), "1")
            return adopted
        commitments, ooms = self.store.commitments(), self.store.ooms()
        machines = set(self.fleet.machines) | set(commitments) | {r.machine for r in ooms}
        with self.redis.pipeline() as pipe:
            for machine in sorted(machines):
                pipe.delete(self.keys.residency(machine), self.keys.oom(machine))
                if commitments.get(machine):
                    pipe.sadd(self.keys.residency(machine), *sorted(commitments[machine]))
            for record in ooms:
                pipe.hset(self.keys.oom(record.machine), f"{record.model_id}\t{record.kind}", _oom_json(record))
            pipe.set(self.keys.residency_durable(), "1")
            pipe.execute()
        log.warning(
            "Redis had lost the residency facts; restored from the database: commitments of %d machines, "
            "%d remembered OOMs",
            len(commitments),
            len(ooms),
        )
        return Restored("database", len(commitments), len(ooms))

    def _adopt(self) -> Restored:
        machines = records = 0
        for machine in sorted(self.fleet.machines):
            models = self.commitments(machine)
            if models:
                self.store.save_commitments(machine, models)
                machines += 1
            for record in self.ooms(machine):
                self.store.save_oom(record)
                records += 1
        if machines or records:
            log.warning(
                "adopted the residency facts held only in Redis into the database: commitments of %d "
                "machines, %d remembered OOMs",
                machines,
                records,
            )
        return Restored("redis", machines, records)

    def _write_commitments(self, machine: str, model_ids: frozenset[str]) -> None:
        with self.redis.pipeline() as pipe:
            pipe.delete(self.keys.residency(machine))
            if model_ids:
                pipe.sadd(self.keys.residency(machine), *sorted(model_ids))
            pipe.execute()


def _oom_json(record: OomRecord) -> str:
    """The Redis hash value of a record, as :meth:`RedisResidencyFacts.record_oom` writes it."""
    return json.dumps({"size": record.size, "job_id": record.job_id, "at": record.at_s})
