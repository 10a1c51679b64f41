"""The webhook deliveries of ended jobs, in the journal: the table is
``app/db/tables.py``'s ``WebhookDelivery``. A delivery is written with the transition that ends
its job (``app/journal/jobs.py``); the server's delivery loop (``app/jobs/webhooks.py``) leases
the due ones, POSTs them and records each attempt here, with its job event, in one transaction.

A lease is a conditional UPDATE, so two servers on one journal never attempt the same delivery
at once; a server killed mid-attempt leaves a lease that expires, and the delivery is attempted
again (deliveries are at least once: a receiver dedupes by the delivery id). Times are unix
seconds.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final, Literal

from sqlalchemy import insert, or_, update
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, func, select

from app.db.tables import JobEvent, WebhookDelivery, utcnow

PENDING: Final = "pending"
DELIVERED: Final = "delivered"
FAILED: Final = "failed"  # gave up after webhook_attempts
EVENT = "webhook"  # the job event of each attempt

_INSERT_EVENT = insert(JobEvent.__table__)  # type: ignore[attr-defined]


class WebhookOutbox:
    """Reads and writes ``WebhookDelivery`` rows; every method is one transaction."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def of_job(self, job_id: str) -> list[WebhookDelivery]:
        """The job's deliveries, oldest first (a recovered ``failed -> succeeded`` job has two)."""
        with Session(self.engine) as session:
            query = (
                select(WebhookDelivery).where(col(WebhookDelivery.job_id) == job_id).order_by(col(WebhookDelivery.id))
            )
            return list(session.exec(query).all())

    def due(self, now_s: float, limit: int, skip: Iterable[int] = ()) -> list[WebhookDelivery]:
        """At most ``limit`` pending deliveries due by ``now_s`` and not leased (or whose lease
        expired), oldest due first, leaving out the ids in ``skip``."""
        skipped = list(skip)
        query = (
            select(WebhookDelivery)
            .where(
                col(WebhookDelivery.state) == PENDING,
                col(WebhookDelivery.due_s) <= now_s,
                or_(col(WebhookDelivery.lease_s).is_(None), col(WebhookDelivery.lease_s) < now_s),
            )
            .order_by(col(WebhookDelivery.due_s))
            .limit(limit)
        )
        if skipped:
            query = query.where(col(WebhookDelivery.id).not_in(skipped))
        with Session(self.engine) as session:
            return list(session.exec(query).all())

    def next_due_s(self, now_s: float) -> float | None:
        """When the earliest pending delivery may be attempted: its due time, or for one leased
        at ``now_s`` its lease's end; None when none is pending. Two aggregates, however many
        are pending (a receiver down for hours leaves many)."""
        pending = col(WebhookDelivery.state) == PENDING
        free = or_(col(WebhookDelivery.lease_s).is_(None), col(WebhookDelivery.lease_s) < now_s)
        with Session(self.engine) as session:
            due = session.exec(select(func.min(WebhookDelivery.due_s)).where(pending, free)).one()
            leased = session.exec(
                select(func.min(WebhookDelivery.lease_s)).where(pending, col(WebhookDelivery.lease_s) >= now_s)
            ).one()
        found = [float(value) for value in (due, leased) if value is not None]
        return min(found) if found else None

    def lease(self, delivery_id: int, now_s: float, until_s: float) -> bool:
        """Take the delivery for one attempt until ``until_s``: True when it was pending, due
        and free (or its lease had expired), else False and nothing changes."""
        with self.engine.begin() as connection:
            result = connection.execute(
                update(WebhookDelivery.__table__)  # type: ignore[attr-defined]
                .where(
                    col(WebhookDelivery.id) == delivery_id,
                    col(WebhookDelivery.state) == PENDING,
                    or_(col(WebhookDelivery.lease_s).is_(None), col(WebhookDelivery.lease_s) < now_s),
                )
                .values(lease_s=until_s)
            )
            return bool(result.rowcount)

    def record(
        self,
        delivery: WebhookDelivery,
        attempt: int,
        outcome: Literal["pending", "delivered", "failed"],
        detail: str,
        due_s: float,
    ) -> None:
        """Record attempt number ``attempt`` of ``delivery``: its outcome (``pending``: another
        attempt at ``due_s``), the lease released, and the job event ``webhook`` with ``detail``,
        in one transaction. The job itself is never changed."""
        values: dict[str, object] = {
            "attempts": attempt,
            "state": outcome,
            "detail": detail,
            "due_s": due_s,
            "lease_s": None,
        }
        if outcome != PENDING:
            values["finished_at"] = utcnow()
        with self.engine.begin() as connection:
            connection.execute(
                update(WebhookDelivery.__table__)  # type: ignore[attr-defined]
                .where(col(WebhookDelivery.id) == delivery.id)
                .values(**values)
            )
            connection.execute(
                _INSERT_EVENT, {"job_id": delivery.job_id, "at": utcnow(), "event": EVENT, "detail": detail}
            )

    def count(self, state: str = PENDING) -> int:
        """Deliveries in ``state``."""
        with Session(self.engine) as session:
            return int(
                session.exec(
                    select(func.count()).select_from(WebhookDelivery).where(col(WebhookDelivery.state) == state)
                ).one()
            )
