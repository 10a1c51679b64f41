"""Drained machines (docs/operations.md, "Drain"): nothing new is placed on a drained machine
(pinned jobs get 503 ``machine_draining``, Auto skips it, R10, R11).

Placement reads the flag from Redis (``Keys.draining``, app/fleet/machines.py); the journal's
database keeps the durable copy (table ``machinedrain``), so a drain outlives a Redis that lost
its data (restarted without persistence, flushed, a failover that lost the write): every
reconciliation pass writes the flags of the drained machines back (:meth:`Drains.restore`,
app/jobs/reconcile.py), as it writes back residency commitments (app/fleet/residency_store.py).
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import redis
from sqlalchemy import delete
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from app.core.keys import Keys
from app.db.tables import MachineDrain


class Drains:
    """Drain flags, in Redis and in the journal's database. Each method is one transaction."""

    def __init__(self, client: redis.Redis, keyspace: Keys, engine: Engine) -> None:
        self.redis, self.keys, self.engine = client, keyspace, engine

    def drain(self, machines: Iterable[str]) -> None:
        """Drain ``machines``: the database first (a Redis write that fails then leaves the flag
        for the next reconciliation pass to write), then the flags in Redis."""
        names = list(machines)
        with Session(self.engine) as session:
            for name in names:
                if session.get(MachineDrain, name) is None:
                    session.add(MachineDrain(machine=name, since_s=time.time()))
            session.commit()
        for name in names:
            self.redis.set(self.keys.draining(name), "1")

    def undo(self, machines: Iterable[str]) -> None:
        """Place jobs on ``machines`` again: the database first (so no pass writes the flags
        back), then the flags in Redis."""
        names = list(machines)
        with Session(self.engine) as session:
            session.exec(delete(MachineDrain).where(col(MachineDrain.machine).in_(names)))
            session.commit()
        if names:
            self.redis.delete(*(self.keys.draining(name) for name in names))

    def restore(self) -> list[str]:
        """Write the flag of every machine the database holds drained whose flag Redis lacks;
        return those machines (none while Redis kept its data).

        Raises:
            redis.ConnectionError, redis.TimeoutError: Redis does not answer.
        """
        with Session(self.engine) as session:
            drained = [row.machine for row in session.exec(select(MachineDrain))]
        restored = []
        for name in drained:
            if self.redis.set(self.keys.draining(name), "1", nx=True):
                restored.append(name)
        return restored
