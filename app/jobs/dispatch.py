"""Submission: place, journal and enqueue a job atomically under the fleet lock (R14).

:meth:`Dispatcher.submit` runs in numbered steps (the sequence of docs/design.md' "Locks", in
the project's words in docs/design.md):

1. refuse at once while the Redis runs with another journal (nothing journaled);
2. check the request (R22, ``app/jobs/validation.py``) and draw its seed; answer a retry whose
   original is journaled (R20); read the cost data ahead (:meth:`Dispatcher.read_ahead`), so
   the lock is held only for the decision and its writes;
3. under the fleet lock: replay an ``Idempotency-Key`` (R20); read the fleet snapshot (machines
   with their reservations, the demand, the cost data's change marks) in one command; refuse
   past ``max_pending_total`` (R23) or past the submitting API key's quota
   (``app/jobs/quotas.py``); place (``routing.placement``);
4. journal the job as ``queued`` with its prediction (R19: before anything is published);
5. in one atomic step, check that the lock still holds our token, renew it (C04) and reserve
   the machine (with the demand record);
6. publish to ``machine.<name>`` with ``task_id = job id``.

A refused submission is journaled as ``rejected`` with its reason; nothing is published. A
job's reservation is released when it ends in any state (app/jobs/endings.py, the one home of a
job's end; ``Reservations.reconcile`` repairs leftovers).
"""

from __future__ import annotations

import contextlib
import json
import logging
import secrets
import time
from dataclasses import dataclass
from typing import Any

from celery import Celery

from app.core.config import Settings
from app.core.digest import bytes_digest
from app.core.errors import (
    Conflict,
    HomefleetError,
    MachineUnavailable,
    Overloaded,
    PlacementLost,
    QuotaExceeded,
    Rejected,
    ServiceDown,
    from_core,
)
from app.core.keys import queue as keys_queue
from app.core.specs import OUTPUT_SIZE_FIELDS
from app.core.states import ENDED, JobState
from app.db.tables import Job
from app.fleet.costs import DemandStore, FleetCosts
from app.fleet.lock import Fence, FleetLock
from app.fleet.machines import MachineStates
from app.fleet.queues import MachineQueues
from app.jobs.endings import Changes, Endings
from app.jobs.quotas import KeyQuotas
from app.jobs.task_events import TaskEvents
from app.jobs.validation import Validator, check_webhook
from app.journal.jobs import Journal
from app.journal.timings import TimingStore
from app.metrics import Metrics
from routing.demand import Demand, Pressure, pinned_class
from routing.errors import Refused
from routing.estimate import Estimator
from routing.finish import Drains
from routing.placement import AUTO, Decision, JobRequest, MachineView, dry_run, place
from routing.scarcity import Scarcity

log = logging.getLogger(__name__)


class Unset:
    """The type of :data:`UNSET`: an argument not given (a requeue's ``seed``: keep the old one)."""


UNSET = Unset()

KEPT_CHARS = 1024  # a refused job's param is kept whole up to this many characters (of its JSON)


@dataclass(frozen=True)
class Snapshot:
    """What one decision reads under the fleet lock (R14), at one instant."""

    views: dict[str, MachineView]  # every machine, with the per-machine queue limit set (R23)
    demand: Demand  # recent submissions per demand class (Auto's scarcity charge)
    estimator: Estimator  # costs from the fleet config, the registry and the learned timings


@dataclass(frozen=True)
class Hook:
    """A submission's webhook: its checked URL (None: none) and the submitting key's id."""

    url: str | None
    api_key_id: str | None


@dataclass(frozen=True)
class Submission:
    job: Job
    position: int  # jobs ahead of it on its machine when it was enqueued (queued + running)
    replayed: bool = False  # True when an Idempotency-Key returned the original job (R20)


def request_fingerprint(
    model_id: str,
    kind: str,
    params: dict[str, Any],
    target: str,
    webhook_url: str | None = None,
    requeued_from: str | None = None,
) -> str:
    """Digest of a submission's body as the client sent it (before the server draws a seed);
    ``webhook_url`` and ``requeued_from`` (a requeue: the job it repeats) count only when given
    (the digests of bodies without them are unchanged)."""
    body: dict[str, Any] = {"model": model_id, "kind": kind, "params": params, "target": target}
    if webhook_url is not None:
        body["webhook_url"] = webhook_url
    if requeued_from is not None:
        body["requeued_from"] = requeued_from
    return bytes_digest(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())


def abridged(params: dict[str, Any]) -> dict[str, Any]:
    """``params`` as a refused job keeps them in the journal: a value whose JSON is longer than
    :data:`KEPT_CHARS` is replaced by its first 200 characters and its length, so that refusing
    a huge request (the reason is usually its size) does not store it (a 20 MB prompt was kept
    whole). Accepted jobs keep their params whole: R22's limits bound them."""
    kept: dict[str, Any] = {}
    for name, value in params.items():
        text = value if isinstance(value, str) else json.dumps(value)
        kept[name] = value if len(text) <= KEPT_CHARS else f"{text[:200]}… ({len(text)} characters; abridged)"
    return kept


def scoped_idempotency_key(key: str | None, api_key_id: str | None) -> str | None:
    """The journaled form of a client's ``Idempotency-Key``: the submitting API key's id
    (``Settings.api_key_id``) and the key, so that two API keys sending the same string (two
    clients counting ``1, 2, 3``) get their own jobs, never each other's (R20; keys are per
    client, as Stripe's and the IETF Idempotency-Key draft's). Without an API key (an open
    API, the server's own jobs) the key as sent."""
    if key is None or api_key_id is None:
        return key
    return f"{api_key_id}/{key}"


class Dispatcher:
    """Submits, dry-runs, cancels and ends jobs; see the module docstring for a submission's steps."""

    def __init__(
        self,
        settings: Settings,
        celery: Celery,
        journal: Journal,
        machines: MachineStates,
        queues: MachineQueues,
        validator: Validator,
        costs: FleetCosts,
        timings: TimingStore,
        demand: DemandStore,
        lock: FleetLock,
        metrics: Metrics | None = None,
        events: TaskEvents | None = None,
        endings: Endings | None = None,
    ) -> None:
        self.settings = settings
        self.celery = celery
        self.journal = journal
        self.machines = machines
        self.queues = queues
        self.validator = validator
        self.costs = costs
        self.timings = timings
        self.demand = demand
        self.lock = lock
        self.metrics = metrics
        self.events = events  # Flower hears of the ends no worker's task reports (app/jobs/task_events.py)
        # Every end of a job (app/jobs/endings.py); the server's context builds one and passes it.
        self.endings = endings or Endings(
            journal,
            machines.reservations,
            timings,
            costs.estimator,
            metrics,
            events,
            Changes(machines.redis, machines.keys),
        )
        self.quotas = KeyQuotas(settings, journal)  # per-key quotas, checked under the lock
        # Kept between decisions, as the same results computed again would be (routing.scarcity,
        # routing.finish.Drains): decisions read them under the fleet lock, one at a time.
        self.scarcity = Scarcity()
        self.drains = Drains()
        self.speed = {name: machine.speed for name, machine in machines.fleet.machines.items()}
        # Set by the server's reconciliation loop while the Redis runs with another journal
        # (app/fleet/pairing.py): nothing is placed, /health says why.
        self.refusing: HomefleetError | None = None

    def request(self, model_id: str, kind: str, params: dict[str, Any], target: str) -> JobRequest:
        """The placement request of a submission after every check (R22): see
        :meth:`app.jobs.validation.Validator.request`, which this is."""
        return self.validator.request(model_id, kind, params, target)

    def snapshot(self, model_id: str) -> Snapshot:
        """What a decision about ``model_id`` reads, in one Redis command (app/fleet/multiread.py):
        every machine's view with the per-machine queue limit set (R23), the fleet's demand,
        and the change marks that tell whether the cached Estimator still holds."""
        views, (raw_demand, registry_mark, timings_mark) = self.machines.snapshot(
            also=[self.demand.read(), *self.costs.mark_reads()], max_queued=self.settings.max_queued_per_machine
        )
        return Snapshot(
            views=views,
            demand=self.demand.parse(raw_demand),
            estimator=self.costs.estimator_at((registry_mark, timings_mark), model_id),
        )

    def read_ahead(self, model_id: str) -> None:
        """Read, before the fleet lock, the cost data a decision about ``model_id`` needs (the
        registry's profiles, the learned timings: SQL reads, ``FleetCosts.estimator_at``), so
        the decision under the lock finds them cached; a change between the two reads is read
        again under the lock (the snapshot's change marks decide). A failed read is left to
        the decision, which raises it (e.g. ``model_unreadable``)."""
        with contextlib.suppress(HomefleetError):
            self.costs.estimator_at(self.costs.marks(), model_id)

    def check_pending(self, views: dict[str, MachineView]) -> None:
        """Refuse when the fleet already holds ``max_pending_total`` jobs (R23).

        Raises:
            Overloaded: reason ``fleet_full`` (429 with Retry-After).
        """
        pending = sum(view.backlog for view in views.values())
        if pending >= self.settings.max_pending_total:
            raise Overloaded(
                f"the fleet has {pending} jobs queued or running, the limit is max_pending_total = "
                f"{self.settings.max_pending_total}; retry later",
                reason="fleet_full",
                retry_after_s=self.settings.retry_after_s,
            )

    def pressure(
        self, views: dict[str, MachineView], estimator: Estimator, now_s: float, demand: Demand | None = None
    ) -> dict[str, Pressure]:
        """Auto's scarcity data: recent demand (``demand``, else read from Redis) spread over the
        machines able to run it now."""
        catalogue = {m: (p.family, p.kind) for m, p in estimator.models.items()}
        rates = (demand or self.demand.load()).rates(now_s)
        return self.scarcity.pressure(views, estimator, catalogue, rates, self.speed)

    def check_webhook(self, webhook_url: str | None, api_key_id: str | None) -> None:
        """A submission's ``webhook_url``, when it names one: see
        :func:`app.jobs.validation.check_webhook` (the fleet file's allow-list, the key's secret).

        Raises:
            Rejected: reason ``invalid_webhook_url``.
        """
        if webhook_url is not None:
            check_webhook(
                webhook_url, self.machines.fleet.webhooks.allow_hosts, api_key_id, self.settings.webhook_secrets
            )

    def dry_run(
        self,
        model_id: str,
        kind: str,
        params: dict[str, Any],
        target: str,
        webhook_url: str | None = None,
        api_key_id: str | None = None,
    ) -> dict[str, Any]:
        """The decision a submission would get, enqueuing nothing: every machine with the filter
        that excluded it or its expected-finish breakdown (seconds). A job the submission would
        refuse has ``machine`` None and an ``error`` ``{reason, message}``: placement's refusal,
        ``job_too_long``, ``fleet_full`` or the key's quota (``quota_queued``,
        ``quota_gpu_seconds``; R23). Raises as :meth:`request` and :meth:`check_webhook`."""
        self.check_webhook(webhook_url, api_key_id)
        request = self.request(model_id, kind, dict(params), target)
        seen = self.snapshot(model_id)
        auto = request.target == AUTO
        weights = self.pressure(seen.views, seen.estimator, time.time(), seen.demand) if auto else None
        decision = dry_run(request, seen.views, seen.estimator, weights)
        rows: dict[str, dict[str, Any]] = decision["machines"]  # type: ignore[assignment]
        runs = {
            name: float(row["run_s"])
            for name, row in rows.items()
            if row.get("eligible") and (request.target == AUTO or name == request.target)
        }
        decision["predicted_run_s"] = min(runs.values()) if runs else None  # on the fastest eligible machine
        decision["max_job_s"] = self.settings.max_job_s
        if "error" not in decision and (too_long := self.too_long(runs)) is not None:
            decision["error"] = {"reason": "job_too_long", "message": too_long}  # a submission is refused so
            decision["machine"] = None
        if "error" not in decision:  # the fleet's bound and the key's quota refuse it too (R23), read unlocked
            try:
                self.check_pending(seen.views)
                self.quotas.check(api_key_id)
            except Overloaded as refusal:
                decision["error"] = {"reason": refusal.reason, "message": refusal.message}
                decision["machine"] = None
        return decision

    def submit(
        self,
        model_id: str,
        kind: str,
        params: dict[str, Any],
        target: str,
        idempotency_key: str | None = None,
        requeued_from: str | None = None,
        api_key_id: str | None = None,
        webhook_url: str | None = None,
    ) -> Submission:
        """Place and enqueue one job; return it as journaled (state ``queued``) with its position.
        ``requeued_from``: the job this one repeats (:meth:`requeue`), journaled with it (and
        with its refusal). ``api_key_id``: the submitting API key's id
        (``Settings.api_key_id``), journaled with the job (and its refusal) and checked against
        that key's quota under the fleet lock; None: no key (open API, the server's
        own jobs). ``webhook_url``: where its record is POSTed when it ends (checked
        first, :meth:`check_webhook`, and signed with that key's secret).

        With ``idempotency_key`` (R20): the same key with the same body returns the original
        job (``replayed=True``) and enqueues nothing; the same key with another body raises
        Rejected (``idempotency_key_reused``, 422). A key is the submitting API key's own
        (:func:`scoped_idempotency_key`): another API key's same string is another key. Keys
        are checked under the fleet lock, so a retry racing its original still gets the original.

        Raises:
            Rejected / MachineUnavailable / NotFound / Overloaded: refused; journaled as ``rejected``.
                ``QuotaExceeded`` (an Overloaded): the key is at a limit of its quota
                (``quota_queued``, ``quota_gpu_seconds``), with its own ``retry_after_s``.
            PlacementLost: the fleet lock was not free, or expired mid-decision; nothing was published.
            ServiceDown: the Redis runs with another journal (``journal_mismatch``, seen by the
                server's reconciliation loop); nothing journaled.
        """
        # 1. Not this fleet's journal: refuse before journaling anything.
        if self.refusing is not None:
            raise ServiceDown(
                self.refusing.message, reason=self.refusing.reason, retry_after_s=self.settings.retry_after_s
            )
        fingerprint = request_fingerprint(model_id, kind, params, target, webhook_url, requeued_from)
        shown_key, idempotency_key = idempotency_key, scoped_idempotency_key(idempotency_key, api_key_id)
        params = dict(params)
        params.setdefault("seed", secrets.randbelow(2**31))  # drawn here so the journal records it
        hook = Hook(None, api_key_id)  # the webhook, once checked: a refused job keeps it (its end is delivered)
        try:
            # 2. Validate before the GPU (R22), the webhook first.
            self.check_webhook(webhook_url, api_key_id)
            hook = Hook(webhook_url, api_key_id)
            request = self.request(model_id, kind, params, target)
            # A retry whose original is journaled is answered without the lock (a journaled job
            # stays); a key not yet seen is looked up again under it, where a racing original
            # is found.
            if idempotency_key is not None and (original := self._replay(idempotency_key, fingerprint, shown_key)):
                return Submission(job=original, position=0, replayed=True)
            self.read_ahead(model_id)
            # Under the lock only what must be atomic (R14, R19, C04): the decision's reads (the
            # replay, the snapshot, the quota) and its writes in order: journal (before the
            # message, R19), reservation (fenced), message (after the reservation, so a
            # machine's list keeps the reservations' order and a reconciliation pass or a
            # cancel, under the lock, never sees a reservation without its message).
            with self.lock.held("submit again") as fence:
                # 3. Replay, snapshot, backpressure, place.
                if idempotency_key is not None and (original := self._replay(idempotency_key, fingerprint, shown_key)):
                    return Submission(job=original, position=0, replayed=True)
                now_s = time.time()
                seen = self.snapshot(model_id)
                self.check_pending(seen.views)
                self.quotas.check(api_key_id, now_s)  # under the lock: two submissions cannot both pass
                decision = self._place(request, seen, now_s)
                # 4. Journal before anything is published (R19).
                job = self._journal(
                    request, params, target, idempotency_key, fingerprint, decision, seen.estimator, requeued_from, hook
                )
                # 5. Reserve, fenced (C04); 6. publish.
                self._reserve(job, request, decision.machine, fence, seen, now_s)
                self._publish(job, decision.machine)
                return Submission(job=job, position=seen.views[decision.machine].backlog)
        except HomefleetError as error:
            self._refused(error, model_id, kind, params, target, requeued_from, hook)
            raise

    def requeue(
        self,
        job_id: str,
        seed: int | Unset | None = UNSET,
        target: str | None = None,
        api_key_id: str | None = None,
        idempotency_key: str | None = None,
    ) -> Submission:
        """Submit a new job with the params of job ``job_id`` (any state), linked to it
        (``requeued_from``, also in the new result's provenance): the same seed unless ``seed``
        is given (None: a new one drawn), the same target unless ``target`` is given. It goes
        through every check a submission passes (R22, placement; a remembered OOM of its size
        is still refused, R21/C08); the params the server sets (``output_width``…) are set again.
        ``api_key_id``: the key that asks (its quota applies; the new job is its job). The old
        job's webhook is not carried over. ``idempotency_key``: as for :meth:`submit` (R20): a
        retried requeue of the same job with the same body gets the first one's job; the key
        with another job or body is refused (``idempotency_key_reused``).

        Raises:
            NotFound: no job ``job_id`` (reason ``job_not_found``).
            Rejected / MachineUnavailable / Overloaded: as :meth:`submit` (journaled ``rejected``).
        """
        old = self.journal.get(job_id)
        params = {name: value for name, value in old.params.items() if name not in OUTPUT_SIZE_FIELDS}
        if not isinstance(seed, Unset):
            params.pop("seed", None)
            if seed is not None:
                params["seed"] = seed
        return self.submit(
            old.model_id,
            old.kind,
            params,
            target or old.target,
            idempotency_key,
            requeued_from=old.id,
            api_key_id=api_key_id,
        )

    def _replay(self, idempotency_key: str, fingerprint: str, shown_key: str | None = None) -> Job | None:
        """The original job of a retried submission (R20), or None for a new key.
        ``idempotency_key``: as journaled (:func:`scoped_idempotency_key`); ``shown_key``: as
        the client sent it, for the message.

        Raises:
            Rejected: the key was used for another body (``idempotency_key_reused``).
        """
        original = self.journal.by_idempotency_key(idempotency_key)
        if original is not None and original.request_fingerprint != fingerprint:
            raise Rejected(
                f"Idempotency-Key {shown_key or idempotency_key!r} was used for another request body; "
                "use a new key for a new request",
                reason="idempotency_key_reused",
            )
        return original

    def _place(self, request: JobRequest, seen: Snapshot, now_s: float) -> Decision:
        """Placement's decision (R10-R12) on the snapshot. Raises the domain error of its refusal."""
        weights = self.pressure(seen.views, seen.estimator, now_s, seen.demand) if request.target == AUTO else None
        try:
            decision = place(request, seen.views, seen.estimator, weights, self.drains)
        except Refused as refusal:
            error = from_core(refusal)
            if request.target != AUTO:  # the machine the request named is what its filter refused
                error.param = "target"
            raise error from refusal
        if (too_long := self.too_long({name: part.run_s for name, part in decision.candidates.items()})) is not None:
            raise Rejected(too_long, reason="job_too_long")
        return decision

    def too_long(self, runs: dict[str, float]) -> str | None:
        """Why a job is refused for its length: its predicted run seconds on the fastest of the
        eligible machines (``runs``: machine -> placement's run seconds) over ``max_job_s``;
        None when it fits (or nothing is eligible)."""
        if not runs:
            return None
        fastest = min(runs, key=lambda name: (runs[name], name))
        run_s = runs[fastest]
        if run_s <= self.settings.max_job_s:
            return None
        where = "the only eligible machine" if len(runs) == 1 else f"the fastest of {len(runs)} eligible machines"
        return (
            f"the job's predicted run time is {run_s:.1f} s on {fastest} ({where}); the limit (max_job_s) is "
            f"{self.settings.max_job_s:g} s: ask for fewer steps, pixels or frames"
        )

    def _journal(
        self,
        request: JobRequest,
        params: dict[str, Any],
        target: str,
        idempotency_key: str | None,
        fingerprint: str,
        decision: Decision,
        estimator: Estimator,
        requeued_from: str | None = None,
        hook: Hook | None = None,
    ) -> Job:
        """Write the job as ``queued`` with placement's prediction and memory estimate (R10-R13)
        and its webhook."""
        hook = hook or Hook(None, None)
        part = decision.breakdown
        memory = estimator.memory(request.model_id, request.kind, request.size)
        return self.journal.add(
            Job(
                state=JobState.queued,
                model_id=request.model_id,
                kind=request.kind,
                params=params,
                target=target,
                machine=decision.machine,
                idempotency_key=idempotency_key,
                request_fingerprint=fingerprint,
                predicted_start_s=part.work_ahead_s,
                predicted_load_s=part.cold_load_s,
                predicted_run_s=part.run_s,
                weights_bytes=memory.weights_bytes,
                working_bytes=memory.working_bytes,
                memory_estimate_bytes=memory.total_bytes,
                requeued_from=requeued_from,
                webhook_url=hook.url,
                api_key_id=hook.api_key_id,
            )
        )

    def _reserve(self, job: Job, request: JobRequest, machine: str, fence: Fence, seen: Snapshot, now_s: float) -> None:
        """Reserve ``machine`` for the job and record the demand, in one step fenced by the lock.

        Raises:
            PlacementLost: the lock expired before the reservation; the job is ``interrupted``
                (reason ``placement_lock_lost``, its ``Idempotency-Key`` dropped so that the
                client's retry is a new job, R20) and nothing is published.
        """
        demand_class = request.model_id if request.target == AUTO else pinned_class(request.model_id, machine)
        work_s = seen.estimator.work_s(request.model_id, request.kind, request.steps, request.size)
        demand = self.demand.level_after(demand_class, work_s, now_s, seen.demand)
        if not self.machines.reservations.add(
            machine,
            job.id,
            request.model_id,
            request.kind,
            request.steps,
            request.size,
            fence,
            also=[demand],
            batch=request.batch,
        ):
            self.endings.interrupt(
                job.id,
                [JobState.queued],
                "placement_lock_lost",
                "the fleet lock expired before publishing; nothing was published",
                forget_key=True,  # "submit again": a retry with its Idempotency-Key is a new job (R20)
            )
            raise PlacementLost("the fleet lock expired before the job was published; submit again")

    def _publish(self, job: Job, machine: str) -> None:
        """Publish the job's message to its machine's queue (R8). A failed publish releases the
        reservation and interrupts the job (``publish_failed``; its ``Idempotency-Key`` dropped, so
        that the client's retry with it is a new job, R20), then raises."""
        try:
            self.queues.publish(machine, job.id, job.model_id, job.kind)
        except Exception:
            self.endings.interrupt(
                job.id,
                [JobState.queued],
                "publish_failed",
                "publishing to the broker failed; nothing was queued",
                forget_key=True,  # a retry with its Idempotency-Key is a new job, not this one (R20)
            )
            raise

    def _refused(
        self,
        error: HomefleetError,
        model_id: str,
        kind: str,
        params: dict[str, Any],
        target: str,
        requeued_from: str | None = None,
        hook: Hook | None = None,
    ) -> None:
        """A refused submission: temporary refusals get ``Retry-After`` (a quota's refusal keeps
        its own); every refusal but a lost lock and a reused key is counted and journaled
        ``rejected`` with its reason and the submitting key's id (R19), with its webhook when
        that passed its check (the ``rejected`` end is delivered)."""
        hook = hook or Hook(None, None)
        if isinstance(error, Overloaded | MachineUnavailable) and not isinstance(error, QuotaExceeded):
            error.retry_after_s = self.settings.retry_after_s  # temporary: 429/503 say when to retry
        if not isinstance(error, PlacementLost) and error.reason != "idempotency_key_reused":
            if self.metrics is not None:
                self.metrics.refused(error.reason)
            refused = self.journal.add(
                Job(
                    state=JobState.rejected,
                    model_id=model_id,
                    kind=kind,
                    params=abridged(params),
                    target=target,
                    reason=error.reason,
                    message=error.message,
                    requeued_from=requeued_from,
                    webhook_url=hook.url,
                    api_key_id=hook.api_key_id,
                )
            )
            error.job_id = refused.id
        log.info("submission refused: %s (%s)", error.message, error.reason)

    def purge(self, machine: str) -> list[Job]:
        """Cancel every queued job of ``machine`` (reason ``purged``), oldest first, each as
        :meth:`cancel` does: the journal first, then its entry is removed from the list. Jobs
        that started meanwhile are left alone. Returns the purged jobs."""
        purged = []
        message = f"its queue {keys_queue(machine)} was purged (`homefleet purge {machine}`); the job was not run"
        for job in self.journal.list([JobState.queued], machine=machine):
            try:
                purged.append(self.cancel(job.id, reason="purged", message=message))
            except Conflict:
                continue  # claimed meanwhile
        return purged

    def request_cancel(self, job_id: str) -> Job:
        """``POST /v1/jobs/{id}/cancel``: a queued job is cancelled at once (:meth:`cancel`); a
        running one is asked to stop (``Keys.cancel``), a queued one claimed while it is cancelled
        too: its worker stops between steps and the job ends ``cancelled`` with the steps it ran;
        one still running ``cancel_grace_s`` later is ended ``cancelled`` by reconciliation and
        its pool process killed. Returns the job as
        it is now (``cancelled``, or ``running`` while the stop is under way).

        Raises:
            NotFound: no such job.
            Conflict: the job had ended (``not_cancellable_<state>``).
        """
        job = self.journal.get(job_id)
        if job.state == JobState.queued:
            try:
                return self.cancel(job_id)
            except Conflict:
                job = self.journal.get(job_id)
                if job.state != JobState.running:
                    raise
                # claimed between the read and the cancel's update: ask the running job to stop
        if job.state == JobState.running:
            self.machines.redis.set(self.machines.keys.cancel(job_id), repr(time.time()), nx=True, ex=24 * 3600)
            log.info("job %s: cancel requested while running on %s", job_id, job.machine)
            return self.journal.get(job_id)
        return self.cancel(job_id)

    def cancel(
        self,
        job_id: str,
        reason: str = "cancelled",
        message: str = "cancelled by request before it started",
        announce: bool = True,
    ) -> Job:
        """Cancel a queued job: the journal says ``cancelled`` (a conditional update, so a
        racing claim cannot also win), then its entry is removed from its machine's list
        atomically. Should a copy still be delivered, the claim refuses it (C03). Never relies
        on a broadcast a worker could miss. ``announce``: send its ``task-revoked`` event for
        Flower (False when Celery's worker already did).

        Raises:
            NotFound: no such job.
            Conflict: the job is not queued (running: too late; or already ended).
        """
        try:
            job = self.endings.cancel(job_id, reason, message, announce=announce)
        except Conflict as error:
            current = self.journal.get(job_id)
            raise Conflict(
                f"job {job_id} is {current.state}"
                + (f" on {current.machine}" if current.machine else "")
                + (
                    "; it has ended, there is nothing to cancel"
                    if current.state in ENDED
                    else "; only a queued job can be cancelled"
                ),
                reason=f"not_cancellable_{current.state}",
            ) from error
        removed = self.queues.remove(job.machine or "", job_id)
        log.info("job %s %s; queue entry %s", job_id, reason, "removed" if removed else "already gone")
        return job

    def revoked(self, machine: str, job_ids: list[str], terminated: bool, announced: bool) -> dict[str, JobState]:
        """C11: ``machine``'s worker learned that these jobs' tasks were revoked (Flower, ``celery
        control revoke``); end those of them placed on ``machine``, as the journal allows:

        - a ``queued`` job -> ``cancelled`` (reason ``revoked``), its message removed (:meth:`cancel`);
        - a ``running`` job whose pool process Celery killed (``terminated``) -> ``interrupted``
          (reason ``terminated``); revoked without terminate, it runs on (Celery stops only
          tasks not started yet) and is left as it is;

        each with its reservation released. Unknown ids, other machines' jobs (every worker
        hears a revoke) and jobs that moved on are skipped. ``announced``: Celery's worker sent
        the task's ``task-revoked`` event. Returns the jobs ended, id -> new state.
        """
        ended: dict[str, JobState] = {}
        for job_id in job_ids:
            state = self.journal.state_of(job_id)
            if state is None or state not in (JobState.queued, JobState.running):
                continue
            job = self.journal.get(job_id)
            if job.machine != machine:
                continue
            try:
                if state == JobState.queued:
                    job = self.cancel(
                        job_id,
                        "revoked",
                        "its task was revoked (Flower or celery control revoke) before it started; it was not run",
                        announce=not announced,
                    )
                elif terminated:
                    job = self.endings.interrupt(
                        job_id,
                        [JobState.running],
                        "terminated",  # Celery's worker sent its
                        "its task was terminated (Flower's Terminate, or `celery -A "  # event
                        "app.celery control terminate SIGNAL JOB_ID`); Celery killed the "
                        "pool process running it",
                    )
                else:
                    continue
            except Conflict:
                continue  # it moved on meanwhile (claimed, finished): nothing to end
            ended[job_id] = JobState(job.state)
            log.warning("job %s %s: its task was revoked%s", job_id, job.state, " with terminate" if terminated else "")
        return ended
