"""Submission: place, journal and enqueue a job atomically under the fleet lock (R14).

Sequence under the lock (shared/notes/celery-redis.md, "Locks"): read the machines (with their
reservations), the demand and the cost data's change marks in one command, place, journal the
job as ``queued`` with its prediction, then in one atomic step check that the lock still holds
our token, renew its TTL (C04) and reserve the machine, and publish to ``machine.<name>`` with
``task_id = job id``. A refused submission is journaled as ``rejected`` with its reason;
nothing is published. A job's reservation is released when it ends in any state
(:meth:`Dispatcher.finished`; ``Reservations.reconcile`` repairs leftovers).
"""

from __future__ import annotations

import json
import logging
import secrets
from dataclasses import dataclass
from typing import Any

import time

import redis
from celery import Celery
from redis.exceptions import LockNotOwnedError

from app.core import keys
from app.core.config import Settings
from app.core.digest import bytes_digest
from app.core.celery_app import RUN_JOB_TASK
from app.fleet.costs import ChangeMark, DemandStore, FleetCosts
from app.core.errors import Conflict, HomefleetError, MachineUnavailable, Overloaded, PlacementLost, Rejected, ServiceDown
from app.core.limits import PromptTokenizers, check_output_pixels, check_submission, integer_params, limits_for
from app.metrics import Metrics
from app.store.inputs import InputStore
from app.journal.jobs import Job, Journal, JobState
from app.core.kinds import check_kind_params, model_max_frames, output_size
from app.fleet.machines import MachineStates
from app.fleet.queues import MachineQueues
from app.core.keys import Keys
from app.store.registry import Registry
from app.fleet.reservations import Fence
from app.journal.timings import TimingStore
from routing.demand import Demand, Pressure, pinned_class
from routing.estimate import Estimator
from routing.finish import Drains
from routing.placement import AUTO, JobRequest, MachineView, dry_run, place
from routing.scarcity import Scarcity


@dataclass(frozen=True)
class Snapshot:
    """What one decision reads under the fleet lock (R14), at one instant."""

    views: dict[str, MachineView]  # every machine, with the per-machine queue limit set (R23)
    demand: Demand  # recent submissions per demand class (Auto's scarcity charge)
    estimator: Estimator  # costs from the fleet config, the registry and the learned timings


@dataclass(frozen=True)
class Submission:
    job: Job
    position: int  # jobs ahead of it on its machine when it was enqueued (queued + running)
    replayed: bool = False  # True when an Idempotency-Key returned the original job (R20)


def request_fingerprint(model_id: str, kind: str, params: dict[str, Any], target: str) -> str:
    """Digest of a submission's body as the client sent it (before the server draws a seed)."""
    body = {"model": model_id, "kind": kind, "params": params, "target": target}
    return bytes_digest(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())

log = logging.getLogger(__name__)

KEPT_CHARS = 1024  # a refused job's param is kept whole up to this many characters (of its JSON)


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


class Dispatcher:
    def __init__(
        self,
        settings: Settings,
        client: redis.Redis,
        celery: Celery,
        journal: Journal,
        registry: Registry,
        machines: MachineStates,
        queues: MachineQueues,
        inputs: InputStore | None = None,
    ) -> None:
        self.settings = settings
        self.redis = client
        self.celery = celery
        self.journal = journal
        self.registry = registry
        self.machines = machines
        self.queues = queues
        self.inputs = inputs or InputStore(settings.inputs_dir, settings.max_input_bytes)
        self.keys = Keys(settings.key_prefix)
        timings_mark = ChangeMark(client, self.keys.timings_changed())
        self.timings = TimingStore(journal.engine, on_change=timings_mark.touch)
        self.costs = FleetCosts(machines.fleet, registry, self.timings,
                                ChangeMark(client, self.keys.registry_changed()), timings_mark)
        self.demand = DemandStore(client, self.keys)
        self.tokenizers = PromptTokenizers(registry.folder)  # each model's own, cached (R22)
        # Kept between decisions, as the same results computed again would be (routing.scarcity,
        # routing.finish.Drains): decisions read them under the fleet lock, one at a time.
        self.scarcity = Scarcity()
        self.drains = Drains()
        self.speed = {name: machine.speed for name, machine in machines.fleet.machines.items()}
        self.metrics: Metrics | None = None  # set by build_context (R24)
        # Set by the server's reconciliation loop while the Redis runs with another journal
        # (app/fleet/pairing.py): nothing is placed, /health says why.
        self.refusing: HomefleetError | None = None

    def request(self, model_id: str, kind: str, params: dict[str, Any], target: str) -> JobRequest:
        """The placement request of a submission, after every check of its params. Adds
        ``output_width``/``output_height`` (pixels) to ``params`` for kinds whose output size
        follows their input image (edit, upscale), so the journal shows what was priced.

        Raises:
            NotFound: the model is not registered (reason ``unknown_model``).
            Rejected: the model does not run ``kind`` (reason ``kind_not_supported``), the
                params exceed the family's limits (reason ``invalid_<field>``, R22), or an
                input, format or frame count is refused (:func:`check_kind_params`).
        """
        record = self.registry.get(model_id)
        if kind not in record.kinds:
            raise Rejected(
                f"model {model_id!r} runs kinds {', '.join(record.kinds)}; got kind {kind!r}",
                reason="kind_not_supported",
            )
        limits = limits_for(self.settings.limits, record.family)
        if kind == "video" and (most := model_max_frames(self.registry.folder(model_id))) is not None:
            limits = limits.model_copy(update={"max_frames": min(limits.max_frames, most)})  # the model's own limit
        check_submission(params, limits, self.tokenizers.counter(model_id), kind)
        params.update(integer_params(params))  # 64.0 frames are 64 frames from here on
        check_kind_params(kind, params, self.inputs, limits)  # inputs (uploaded, within the upload limits), numbers (R22)
        params.update(output_size(kind, params, self.inputs))
        if "output_width" in params:
            check_output_pixels(params["output_width"], params["output_height"], limits)
        return JobRequest.from_params(model_id, record.family, kind, target, params)

    def snapshot(self, model_id: str) -> Snapshot:
        """What a decision about ``model_id`` reads, in one Redis command (app/fleet/multiread.py):
        every machine's view with the per-machine queue limit set (R23), the fleet's demand,
        and the change marks that tell whether the cached Estimator still holds."""
        views, (raw_demand, registry_mark, timings_mark) = self.machines.snapshot(
            also=[self.demand.read(), *self.costs.mark_reads()], max_queued=self.settings.max_queued_per_machine)
        return Snapshot(views=views, demand=self.demand.parse(raw_demand),
                        estimator=self.costs.estimator_at((registry_mark, timings_mark), model_id))

    def check_pending(self, views: dict[str, MachineView]) -> None:
        """Refuse when the fleet already holds ``max_pending_total`` jobs (R23).

        Raises:
            Overloaded: reason ``fleet_full`` (429 with Retry-After).
        """
        pending = sum(view.backlog for view in views.values())
        if pending >= self.settings.max_pending_total:
            raise Overloaded(
                f"the fleet has {pending} jobs queued or running, the limit is max_pending_total = "
                f"{self.settings.max_pending_total}; retry later", reason="fleet_full",
                retry_after_s=self.settings.retry_after_s,
            )

    def pressure(self, views: dict[str, MachineView], estimator: Estimator, now_s: float,
                 demand: Demand | None = None) -> dict[str, Pressure]:
        """Auto's scarcity data: recent demand (``demand``, else read from Redis) spread over the
        machines able to run it now."""
        catalogue = {m: (p.family, p.kind) for m, p in estimator.models.items()}
        rates = (demand or self.demand.load()).rates(now_s)
        return self.scarcity.pressure(views, estimator, catalogue, rates, self.speed)

    def dry_run(self, model_id: str, kind: str, params: dict[str, Any], target: str) -> dict[str, Any]:
        """The decision a submission would get, enqueuing nothing: every machine with the filter
        that excluded it or its expected-finish breakdown (seconds). Raises as :meth:`request`."""
        request = self.request(model_id, kind, dict(params), target)
        seen = self.snapshot(model_id)
        weights = self.pressure(seen.views, seen.estimator, time.time(), seen.demand) if request.target == AUTO else None
        return dry_run(request, seen.views, seen.estimator, weights)

    def finished(self, job: Job) -> None:
        """A job ended (any state): release its reservation; fold its measured times into the
        learned timings (R13) when its run finished: a succeeded job, or one failed after its
        run (its result refused at upload). A run cut short reports no run time (None; 0 from
        older workers) and teaches nothing."""
        self.machines.reservations.release(job.machine, job.id)
        if self.metrics is not None:
            self.metrics.finished(job)
        if job.state in (JobState.succeeded, JobState.failed) and job.run_s:  # the run finished and was timed
            self.timings.observe(job, self.costs.estimator())

    def submit(self, model_id: str, kind: str, params: dict[str, Any], target: str,
               idempotency_key: str | None = None) -> Submission:
        """Place and enqueue one job; return it as journaled (state ``queued``) with its position.

        With ``idempotency_key`` (R20): the same key with the same body returns the original
        job (``replayed=True``) and enqueues nothing; the same key with another body raises
        Rejected (``idempotency_key_reused``, 422). Keys are checked under the fleet lock, so a
        retry racing its original still gets the original.

        Raises:
            Rejected / MachineUnavailable / NotFound: refused; journaled as ``rejected``.
            PlacementLost: the fleet lock expired mid-decision; nothing was published.
            ServiceDown: the Redis runs with another journal (``journal_mismatch``, seen by the
                server's reconciliation loop); nothing journaled.
        """
        if self.refusing is not None:  # not journaled: this journal is not the fleet's
            raise ServiceDown(self.refusing.message, reason=self.refusing.reason, retry_after_s=self.settings.retry_after_s)
        fingerprint = request_fingerprint(model_id, kind, params, target)
        params = dict(params)
        params.setdefault("seed", secrets.randbelow(2**31))  # drawn here so the journal records it
        try:
            request = self.request(model_id, kind, params, target)
            token = secrets.token_hex(16)  # ours: the fence checks it before anything is reserved (C04)
            lock = self.redis.lock(
                self.keys.fleet_lock(),
                timeout=self.settings.fleet_lock_ttl_s,
                blocking_timeout=self.settings.fleet_lock_wait_s,
            )
            if not lock.acquire(token=token):
                raise PlacementLost(
                    f"the fleet lock was not free within {self.settings.fleet_lock_wait_s} s; submit again"
                )
            try:
                if idempotency_key is not None:
                    original = self.journal.by_idempotency_key(idempotency_key)
                    if original is not None:
                        if original.request_fingerprint != fingerprint:
                            raise Rejected(
                                f"Idempotency-Key {idempotency_key!r} was used for another request body; "
                                "use a new key for a new request", reason="idempotency_key_reused",
                            )
                        return Submission(job=original, position=0, replayed=True)
                now_s = time.time()
                seen = self.snapshot(model_id)
                views, estimator = seen.views, seen.estimator
                self.check_pending(views)
                weights = self.pressure(views, estimator, now_s, seen.demand) if request.target == AUTO else None
                placement = place(request, views, estimator, weights, self.drains)
                part = placement.breakdown
                memory = estimator.memory(model_id, kind, request.size)  # shown in the job record (R10, R11)
                job = self.journal.add(
                    Job(state=JobState.queued, model_id=model_id, kind=kind, params=params,
                        target=target, machine=placement.machine, idempotency_key=idempotency_key,
                        request_fingerprint=fingerprint, predicted_start_s=part.work_ahead_s,
                        predicted_load_s=part.cold_load_s, predicted_run_s=part.run_s,
                        weights_bytes=memory.weights_bytes, working_bytes=memory.working_bytes,
                        memory_estimate_bytes=memory.total_bytes)
                )
                demand_class = model_id if request.target == AUTO else pinned_class(model_id, placement.machine)
                demand = self.demand.level_after(demand_class, estimator.work_s(model_id, kind, request.steps, request.size),
                                                 now_s, seen.demand)
                # One atomic step: the lock still ours? then a full TTL, the reservation and the demand (C04).
                fence = Fence(self.keys.fleet_lock(), token, int(self.settings.fleet_lock_ttl_s * 1000))
                if not self.machines.reservations.add(placement.machine, job.id, model_id, kind, request.steps,
                                                      request.size, fence, also=[demand]):
                    self.journal.transition(job.id, [JobState.queued], JobState.interrupted,
                                            reason="placement_lock_lost",
                                            message="the fleet lock expired before publishing; nothing was published")
                    raise PlacementLost("the fleet lock expired before the job was published; submit again")
                try:
                    self.celery.send_task(RUN_JOB_TASK, args=[job.id], task_id=job.id, queue=keys.queue(placement.machine))
                except Exception:
                    self.machines.reservations.release(placement.machine, job.id)
                    self.journal.transition(job.id, [JobState.queued], JobState.interrupted, reason="publish_failed",
                                            message="publishing to the broker failed; nothing was queued")
                    raise
                return Submission(job=job, position=views[placement.machine].backlog)
            finally:
                try:
                    lock.release()  # atomic: releases only a token that is still ours
                except LockNotOwnedError:
                    log.warning("the fleet lock expired before its release (TTL %s s)", self.settings.fleet_lock_ttl_s)
        except HomefleetError as error:
            if isinstance(error, Overloaded | MachineUnavailable):  # temporary: 429/503 say when to retry
                error.retry_after_s = self.settings.retry_after_s
            if not isinstance(error, PlacementLost) and error.reason != "idempotency_key_reused":
                if self.metrics is not None:
                    self.metrics.refused(error.reason)
                refused = self.journal.add(
                    Job(state=JobState.rejected, model_id=model_id, kind=kind, params=abridged(params), target=target,
                        reason=error.reason, message=error.message)
                )
                error.job_id = refused.id
            log.info("submission refused: %s (%s)", error.message, error.reason)
            raise

    def cancel(self, job_id: str) -> Job:
        """Cancel a queued job: the journal says ``cancelled`` (a conditional update, so a
        racing claim cannot also win), then its entry is removed from its machine's list
        atomically. Should a copy still be delivered, the claim refuses it (C03). Never relies
        on a broadcast a worker could miss.

        Raises:
            NotFound: no such job.
            Conflict: the job is not queued (running: too late; or already ended).
        """
        try:
            job = self.journal.cancel(job_id)
        except Conflict as error:
            current = self.journal.get(job_id)
            raise Conflict(
                f"job {job_id} is {current.state}" + (f" on {current.machine}" if current.machine else "")
                + "; only a queued job can be cancelled", reason=f"not_cancellable_{current.state}",
            ) from error
        removed = self.queues.remove(job.machine or "", job_id)
        self.finished(job)
        log.info("job %s cancelled; queue entry %s", job_id, "removed" if removed else "already gone")
        return job
