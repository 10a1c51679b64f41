"""The job journal (R19): every job is written here before it is enqueued, and every state
change is a conditional update, so only legal transitions happen (``app.core.states.LEGAL``)
and a job is claimed once. The tables are ``app/db/tables.py``'s ``Job`` and ``JobEvent``.

Every way a job ends goes through :meth:`Journal.add` (``rejected``) or
:meth:`Journal.transition` (every other state of ``ENDED``), so these two write a job's webhook
delivery (``WebhookDelivery``) in the transaction that ends it: a job that ended has
its delivery, whichever process ended it, and a crash cannot leave one without the other.
"""

from __future__ import annotations

import builtins
import time
from collections.abc import Callable, Iterable
from datetime import datetime
from typing import Any

from sqlalchemy import BindParameter, String, bindparam, cast, insert, or_, update
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, func, select

from app.core.errors import Conflict, NotFound
from app.core.states import ACTIVE, ENDED, LEGAL, RESULT_NOT_STORED, JobState
from app.db.tables import Job, JobEvent, WebhookDelivery, utcnow

_JOB_COLUMNS = tuple(Job.__table__.columns)  # type: ignore[attr-defined]
_INSERT_JOB = insert(Job.__table__)  # type: ignore[attr-defined]
_INSERT_EVENT = insert(JobEvent.__table__)  # type: ignore[attr-defined]
_INSERT_DELIVERY = insert(WebhookDelivery.__table__)  # type: ignore[attr-defined]
STATES_BATCH = 500  # ids per SELECT of Journal.states_of (well under SQLite's bound parameters)

# Journal.key_load's statements, built once: a quota check runs them under the fleet lock (R14),
# where building them again cost more than running them.
_KEY: BindParameter[str] = bindparam("key")
_SINCE = bindparam("since", type_=Job.__table__.c.finished_at.type)  # type: ignore[attr-defined]
_ENDED = (col(Job.api_key_id) == _KEY, col(Job.finished_at) > _SINCE)
_TIMED = col(Job.load_s).is_not(None) | col(Job.run_s).is_not(None)
_UNTIMED = (*_ENDED, ~_TIMED, col(Job.started_at).is_not(None))
_KEY_ACTIVE = select(func.count()).select_from(Job).where(col(Job.api_key_id) == _KEY, col(Job.state).in_(list(ACTIVE)))
_KEY_LOAD = select(
    _KEY_ACTIVE.scalar_subquery(),
    select(func.coalesce(func.sum(func.coalesce(Job.load_s, 0.0) + func.coalesce(Job.run_s, 0.0)), 0.0))
    .where(*_ENDED, _TIMED)
    .scalar_subquery(),
    select(func.count()).select_from(Job).where(*_UNTIMED).scalar_subquery(),
)
_KEY_UNTIMED = select(Job.finished_at, Job.started_at).where(*_UNTIMED)


class Journal:
    """The only code that changes a job's state. Every method is one transaction."""

    def __init__(self, engine: Engine, on_delivery: Callable[[], None] | None = None) -> None:
        self.engine = engine
        # Told after a transaction wrote a webhook delivery (the server's delivery loop wakes up).
        self.on_delivery = on_delivery

    @staticmethod
    def _delivery(job_id: str, state: JobState, webhook_url: str | None) -> dict[str, Any] | None:
        """The ``WebhookDelivery`` row to write with a transition to ``state``, when the job
        has a webhook and ``state`` ends it; else None."""
        if webhook_url is None or state not in ENDED:
            return None
        return {
            "job_id": job_id,
            "url": webhook_url,
            "job_state": str(state),
            "state": "pending",
            "attempts": 0,
            "due_s": time.time(),
            "lease_s": None,
            "created_at": utcnow(),
            "finished_at": None,
            "detail": "",
        }

    def _delivered(self, delivery: dict[str, Any] | None) -> None:
        if delivery is not None and self.on_delivery is not None:
            self.on_delivery()

    def add(self, job: Job) -> Job:
        """Insert a new job (state ``queued`` or ``rejected``) with its first event, in one
        transaction; returns ``job`` as written (not re-read: the row is what we wrote).

        Two Core INSERTs of every column, with the defaults the model already drew (id,
        ``created_at``): the rows the ORM would write, without its unit of work, which cost
        more than the inserts themselves on the submission path under the fleet lock (R14).

        Raises:
            sqlalchemy.exc.IntegrityError: ``job.id`` or ``job.idempotency_key`` is taken;
                nothing is written.
        """
        event = {
            "job_id": job.id,
            "at": utcnow(),
            "event": str(job.state),
            "detail": job.reason or "",
        }  # id: the database's
        delivery = self._delivery(job.id, JobState(job.state), job.webhook_url)  # a rejected job's webhook
        with self.engine.begin() as connection:
            connection.execute(_INSERT_JOB, {c.key: getattr(job, c.key) for c in _JOB_COLUMNS})
            connection.execute(_INSERT_EVENT, event)
            if delivery is not None:
                connection.execute(_INSERT_DELIVERY, delivery)
        self._delivered(delivery)
        return job

    def get(self, job_id: str) -> Job:
        """The job, or raise :class:`NotFound`."""
        with Session(self.engine) as session:
            job = session.get(Job, job_id)
            if job is None:
                raise NotFound(f"no job with id {job_id!r}", reason="job_not_found")
            return job

    def full_id(self, given: str) -> str:
        """The id of the one job whose id is ``given`` or starts with it (the short ids
        ``homefleet demo`` and the page print: the first 8 hex digits).

        Raises:
            NotFound: no such job (``job_not_found``), or several start with it
                (``job_id_ambiguous``, naming a few).
        """
        with Session(self.engine) as session:
            if session.get(Job, given) is not None:
                return given
            if not given or not all(c in "0123456789abcdef" for c in given):  # no LIKE wildcard reaches SQL
                raise NotFound(f"no job with id {given!r}", reason="job_not_found")
            found = list(session.exec(select(Job.id).where(col(Job.id).startswith(given)).limit(4)))
        if not found:
            raise NotFound(f"no job with id {given!r}", reason="job_not_found")
        if len(found) > 1:
            raise NotFound(
                f"{len(found) if len(found) < 4 else 'several'} jobs have an id starting with {given!r} "
                f"({', '.join(found[:3])}); give more of it",
                reason="job_id_ambiguous",
            )
        return str(found[0])

    def state_of(self, job_id: str) -> JobState | None:
        """The job's state, or None when there is no such job."""
        with Session(self.engine) as session:
            job = session.get(Job, job_id)
            return None if job is None else JobState(job.state)

    def list(self, states: Iterable[JobState] | None = None, machine: str | None = None) -> list[Job]:
        """Jobs, oldest first, optionally filtered by state and machine."""
        query = select(Job).order_by(col(Job.created_at))
        if states is not None:
            query = query.where(col(Job.state).in_(list(states)))
        if machine is not None:
            query = query.where(col(Job.machine) == machine)
        with Session(self.engine) as session:
            return list(session.exec(query).all())

    def placements(self, states: Iterable[JobState]) -> builtins.list[tuple[str, str | None]]:
        """``(job id, machine)`` of the jobs in ``states``, oldest first: two columns, not whole
        jobs. A reconciliation pass over a backlog of 10,000 queued jobs spent 0.53 s of its
        0.92 s building them as objects (their JSON columns decoded), the API's other requests
        waiting meanwhile (bench/backlog.py)."""
        query = select(Job.id, Job.machine).where(col(Job.state).in_(list(states))).order_by(col(Job.created_at))
        with Session(self.engine) as session:
            return [(job_id, machine) for job_id, machine in session.exec(query)]

    def states_of(self, job_ids: Iterable[str]) -> dict[str, JobState]:
        """``{job id: state}`` of the jobs among ``job_ids`` that the journal knows (unknown ids
        are left out): one SELECT per :data:`STATES_BATCH` ids, not one per job (a deep backlog
        holds thousands of reservations)."""
        wanted = list(dict.fromkeys(job_ids))
        found: dict[str, JobState] = {}
        with Session(self.engine) as session:
            for first in range(0, len(wanted), STATES_BATCH):
                batch = wanted[first : first + STATES_BATCH]
                rows = session.exec(select(Job.id, Job.state).where(col(Job.id).in_(batch)))
                found.update({job_id: JobState(state) for job_id, state in rows})
        return found

    def page(
        self,
        states: Iterable[JobState] | None = None,
        machine: str | None = None,
        limit: int = 100,
        after: str | None = None,
        newest_first: bool = False,
    ) -> builtins.list[Job]:
        """At most ``limit`` jobs, oldest first (``created_at``, then id; ``newest_first``: the
        other way), optionally filtered by state and machine, starting after the job ``after``
        (keyset paging: each page is one indexed range query, however deep the backlog).

        Raises:
            NotFound: ``after`` names no job (reason ``job_not_found``).
        """
        if newest_first:
            query = select(Job).order_by(col(Job.created_at).desc(), col(Job.id).desc()).limit(limit)
        else:
            query = select(Job).order_by(col(Job.created_at), col(Job.id)).limit(limit)
        if states is not None:
            query = query.where(col(Job.state).in_(list(states)))
        if machine is not None:
            query = query.where(col(Job.machine) == machine)
        with Session(self.engine) as session:
            if after is not None:
                cursor = session.get(Job, after)
                if cursor is None:
                    raise NotFound(f"no job with id {after!r} (the page cursor 'after')", reason="job_not_found")
                if newest_first:
                    query = query.where(
                        (col(Job.created_at) < cursor.created_at)
                        | ((col(Job.created_at) == cursor.created_at) & (col(Job.id) < cursor.id))
                    )
                else:
                    query = query.where(
                        (col(Job.created_at) > cursor.created_at)
                        | ((col(Job.created_at) == cursor.created_at) & (col(Job.id) > cursor.id))
                    )
            return list(session.exec(query).all())

    def events(self, job_id: str) -> builtins.list[JobEvent]:
        """A job's history, oldest first."""
        with Session(self.engine) as session:
            query = select(JobEvent).where(col(JobEvent.job_id) == job_id).order_by(col(JobEvent.id))
            return list(session.exec(query).all())

    def has_machine(self, machine: str) -> bool:
        """Whether any job was placed on ``machine`` (one indexed lookup): a machine since
        removed from the fleet file still has its jobs listed."""
        with Session(self.engine) as session:
            return session.exec(select(Job.id).where(col(Job.machine) == machine).limit(1)).first() is not None

    def count_in(self, state: JobState, machine: str) -> int:
        """How many jobs of ``machine`` are in ``state`` (one COUNT)."""
        with Session(self.engine) as session:
            query = select(func.count()).select_from(Job).where(col(Job.machine) == machine, col(Job.state) == state)
            return int(session.exec(query).one())

    def count_active(self, machine: str) -> int:
        """Jobs of ``machine`` that are queued or running (its backlog)."""
        with Session(self.engine) as session:
            query = (
                select(func.count())
                .select_from(Job)
                .where(
                    col(Job.machine) == machine,
                    col(Job.state).in_(list(ACTIVE)),
                )
            )
            return int(session.exec(query).one())

    def count_active_of_key(self, api_key_id: str) -> int:
        """Jobs submitted with API key ``api_key_id`` that are queued or running (one COUNT,
        two seeks of the index ``ix_job_api_key_id_state``)."""
        with Session(self.engine) as session:
            query = (
                select(func.count())
                .select_from(Job)
                .where(
                    col(Job.api_key_id) == api_key_id,
                    col(Job.state).in_(list(ACTIVE)),
                )
            )
            return int(session.exec(query).one())

    def key_load(
        self, api_key_id: str, since: datetime | None
    ) -> tuple[int, float, builtins.list[tuple[datetime, datetime]]]:
        """What a key's quota check reads (app/jobs/quotas.py): its jobs queued or running; the
        load + run seconds its workers reported for its jobs that ended after ``since``, summed by
        the database; and ``(finished_at, started_at)`` of those of them that started but reported
        no timings (interrupted: usually none). One SELECT of three index-range subqueries, built
        once (:data:`_KEY_LOAD`; no row read back), and a second one only for such untimed jobs.
        ``since`` None: the last two are not read (0.0, [])."""
        with self.engine.connect() as connection:
            if since is None:
                return int(connection.execute(_KEY_ACTIVE, {"key": api_key_id}).scalar_one()), 0.0, []
            values = {"key": api_key_id, "since": since}
            count, timed_s, untimed = connection.execute(_KEY_LOAD, values).one()
            rows = connection.execute(_KEY_UNTIMED, values).all() if untimed else []
        return int(count), float(timed_s), [(finished, started) for finished, started in rows]

    def active_by_key(self) -> dict[str, dict[JobState, int]]:
        """``{api key id: {state: jobs}}`` of the queued and running jobs that a key submitted
        (one GROUP BY; jobs without a key id are left out)."""
        query = (
            select(Job.api_key_id, Job.state, func.count())
            .where(
                col(Job.api_key_id).is_not(None),
                col(Job.state).in_(list(ACTIVE)),
            )
            .group_by(Job.api_key_id, Job.state)
        )
        found: dict[str, dict[JobState, int]] = {}
        with Session(self.engine) as session:
            for key, state, count in session.exec(query):
                found.setdefault(str(key), {})[JobState(state)] = int(count)
        return found

    def ended_since(
        self, since: datetime, api_key_id: str | None = None
    ) -> builtins.list[tuple[str, datetime, datetime | None, float | None, float | None]]:
        """``(api key id, finished_at, started_at, load_s, run_s)`` of every job with a key id that
        ended after ``since``, oldest end first; only ``api_key_id``'s when given (a range of the
        index ``ix_job_api_key_id_finished_at``). Times as stored (UTC; naive from SQLite)."""
        query = (
            select(  # type: ignore[call-overload]  # sqlmodel's select is typed for at most 4 columns
                col(Job.api_key_id),
                col(Job.finished_at),
                col(Job.started_at),
                col(Job.load_s),
                col(Job.run_s),
            )
            .where(
                col(Job.finished_at) > since,
            )
            .order_by(col(Job.finished_at))
        )
        if api_key_id is not None:
            query = query.where(col(Job.api_key_id) == api_key_id)
        else:
            query = query.where(col(Job.api_key_id).is_not(None))
        with Session(self.engine) as session:
            return [
                (str(key), finished, started, load_s, run_s)
                for key, finished, started, load_s, run_s in session.exec(query)
            ]

    def log(self, job_id: str, event: str, detail: str = "") -> None:
        """Append an event without changing state (e.g. a refused second delivery)."""
        with Session(self.engine) as session:
            session.add(JobEvent(job_id=job_id, event=event, detail=detail))
            session.commit()

    def transition(
        self,
        job_id: str,
        from_states: Iterable[JobState],
        to_state: JobState,
        *,
        machine: str | None = None,
        event_detail: str = "",
        **values: Any,
    ) -> Job:
        """Move a job to ``to_state`` only if it is in one of ``from_states`` (and, when given,
        placed on ``machine``): one conditional UPDATE, so two callers can never both win.

        Raises:
            NotFound: no such job.
            Conflict: the job is in another state (reason ``not_<states>``); the refusal is
                journaled as an event and changes nothing else.
        """
        allowed = [JobState(s) for s in from_states]
        illegal = [s for s in allowed if to_state not in LEGAL.get(s, frozenset())]
        if illegal:
            raise ValueError(f"illegal transition {', '.join(illegal)} -> {to_state} (see app.core.states.LEGAL)")
        now = utcnow()
        if to_state == JobState.running:
            values.setdefault("started_at", now)
        if to_state in ENDED:
            values.setdefault("finished_at", now)
        conditions = [col(Job.id) == job_id, col(Job.state).in_(allowed)]
        if machine is not None:
            conditions.append(col(Job.machine) == machine)
        # The update returns the row and the event is a Core INSERT in the same transaction: no
        # ORM unit of work and no re-read (the claim path). An end writes the job's
        # webhook delivery in the same transaction.
        delivery = None
        with self.engine.begin() as connection:
            row = connection.execute(
                update(Job.__table__)  # type: ignore[attr-defined]
                .where(*conditions)
                .values(state=to_state, **values)
                .returning(*_JOB_COLUMNS)
            ).first()
            if row is not None:
                connection.execute(
                    _INSERT_EVENT, {"job_id": job_id, "at": now, "event": str(to_state), "detail": event_detail}
                )
                delivery = self._delivery(job_id, to_state, row._mapping["webhook_url"])
                if delivery is not None:
                    connection.execute(_INSERT_DELIVERY, delivery)
        if row is not None:
            self._delivered(delivery)
            return Job(**row._mapping)
        with Session(self.engine) as session:
            # The refusal: journaled as an event, nothing else changes.
            current = session.get(Job, job_id)
            if current is None:
                raise NotFound(f"no job with id {job_id!r}", reason="job_not_found")
            expected = " or ".join(allowed)
            refusal = (
                f"job {job_id} is {current.state}"
                + (f" on {current.machine}" if machine is not None and current.machine != machine else "")
                + f", not {expected}; cannot become {to_state}"
            )
            session.add(JobEvent(job_id=job_id, event=f"{to_state}_refused", detail=refusal))
            session.commit()
            raise Conflict(refusal, reason=f"not_{'_or_'.join(allowed)}")

    def claim(self, job_id: str, machine: str, worker_boot_id: str | None = None, claim_id: str | None = None) -> Job:
        """Atomic ``queued -> running`` for the machine the job was placed on (R19).

        A second delivery of the same job (broker redelivery, duplicate publish) finds it
        no longer ``queued`` and is refused with :class:`Conflict`; nothing changes.
        ``worker_boot_id`` identifies the claiming worker process, so reconciliation can tell
        a restarted worker from the one that runs the job. ``claim_id`` identifies one
        delivery: the same delivery repeating its claim (its first answer was lost on the
        network) gets the job again; any other delivery is refused.
        """
        try:
            return self.transition(
                job_id,
                [JobState.queued],
                JobState.running,
                machine=machine,
                event_detail=f"{machine} boot {worker_boot_id} claim {claim_id}",
                worker_boot_id=worker_boot_id,
                claim_id=claim_id,
            )
        except Conflict:
            current = self.get(job_id)
            if (
                claim_id
                and current.state == JobState.running
                and current.claim_id == claim_id
                and current.machine == machine
            ):
                return current
            raise

    def interrupt(
        self, job_id: str, from_states: Iterable[JobState], reason: str, message: str, *, forget_key: bool = False
    ) -> Job:
        """``queued|running -> interrupted``: it may have started and will never re-run by itself (R19).
        ``forget_key``: in the same update, drop the job's ``Idempotency-Key`` (a job that was
        never published: the client's retry with that key is a new submission, R20)."""
        values: dict[str, Any] = {"idempotency_key": None} if forget_key else {}
        return self.transition(
            job_id,
            from_states,
            JobState.interrupted,
            event_detail=f"{reason}: {message}",
            reason=reason,
            message=message,
            **values,
        )

    def cancel(
        self, job_id: str, reason: str = "cancelled", message: str = "cancelled by request before it started"
    ) -> Job:
        """``queued -> cancelled`` with a reason code (``cancelled`` by the API, ``revoked`` from
        Flower or the celery CLI, ``purged``: its queue was purged). Raises :class:`Conflict` (e.g. running: too late
        to cancel)."""
        return self.transition(
            job_id,
            [JobState.queued],
            JobState.cancelled,
            event_detail=f"{reason}: {message}",
            reason=reason,
            message=message,
        )

    def cancel_running(self, job_id: str, machine: str, message: str) -> Job:
        """``running -> cancelled`` (reason ``cancelled``): stopped by request while it ran.
        Raises :class:`Conflict` when it is not running."""
        return self.transition(
            job_id,
            [JobState.running],
            JobState.cancelled,
            machine=machine,
            event_detail=f"cancelled: {message}",
            reason="cancelled",
            message=message,
        )

    def result_media_type(self, digest: str, api_key_id: str | None) -> str | None:
        """The media type of the result ``digest`` (any image of its job) of a succeeded job
        submitted by the key ``api_key_id`` (None: without a key), or None when there is none."""
        owner = Job.api_key_id.is_(None) if api_key_id is None else Job.api_key_id == api_key_id  # type: ignore[union-attr]
        with Session(self.engine) as session:
            jobs = session.exec(
                select(Job).where(
                    Job.state == JobState.succeeded,
                    owner,
                    or_(Job.result_digest == digest, cast(Job.results, String).contains(digest)),  # type: ignore[arg-type]
                )
            ).all()
        for job in jobs:
            rows = job.results or [{"digest": job.result_digest, "media_type": job.result_media_type}]
            for row in rows:
                if row.get("digest") == digest:
                    return str(row.get("media_type") or "")
        return None

    def by_idempotency_key(self, key: str) -> Job | None:
        """The job submitted earlier with this ``Idempotency-Key``, or None (R20)."""
        with Session(self.engine) as session:
            return session.exec(select(Job).where(col(Job.idempotency_key) == key)).first()

    def forget_idempotency_keys(self, older_than: datetime) -> int:
        """Drop idempotency keys of jobs created before ``older_than``; return how many."""
        with Session(self.engine) as session:
            result = session.exec(
                update(Job)
                .where(col(Job.idempotency_key).is_not(None), col(Job.created_at) < older_than)
                .values(idempotency_key=None)
            )
            session.commit()
            return int(result.rowcount)

    def succeed(self, job_id: str, machine: str, **values: Any) -> Job:
        """``running -> succeeded`` with the stored result's digest, path, media type and bytes."""
        return self.transition(job_id, [JobState.running], JobState.succeeded, machine=machine, **values)

    def recover(self, job_id: str, machine: str, **values: Any) -> Job:
        """``failed -> succeeded`` for a job that failed ``result_not_stored`` only, once its
        spooled result has been stored: one conditional UPDATE.

        Raises:
            Conflict: the job is not failed, or failed for another reason (nothing changes).
        """
        job = self.get(job_id)
        if job.state != JobState.failed or job.reason != RESULT_NOT_STORED:
            raise Conflict(
                f"job {job_id} is {job.state} ({job.reason}); only a {RESULT_NOT_STORED} failure takes "
                "a recovered result",
                reason="not_recoverable",
            )
        return self.transition(
            job_id,
            [JobState.failed],
            JobState.succeeded,
            machine=machine,
            event_detail="recovered result",
            reason=None,
            message=None,
            **values,
        )

    def fail(self, job_id: str, machine: str, reason: str, message: str, **values: Any) -> Job:
        """``running -> failed`` with a reason code and message."""
        return self.transition(
            job_id,
            [JobState.running],
            JobState.failed,
            machine=machine,
            event_detail=f"{reason}: {message}",
            reason=reason,
            message=message,
            **values,
        )
