"""Submission: place, journal and enqueue a job atomically under the fleet lock (R14).

Sequence under the lock (shared/notes/celery-redis.md, "Locks"): read the machines, place,
journal the job as ``queued``, check that the lock is still ours (C04), publish to
``machine.<name>`` with ``task_id = job id``. A refused submission is journaled as
``rejected`` with its reason; nothing is published.
"""

from __future__ import annotations

import json
import logging
import secrets
from dataclasses import dataclass
from typing import Any

import redis
from celery import Celery

from app import keys
from app.config import Settings
from app.digest import bytes_digest
from app.celery_app import RUN_JOB_TASK
from app.errors import Conflict, HomefleetError, PlacementLost, Rejected
from app.journal import Job, Journal, JobState
from app.machines import MachineStates
from app.queues import MachineQueues
from app.keys import Keys
from app.registry import Registry
from routing.placement import JobRequest, place


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
    ) -> None:
        self.settings = settings
        self.redis = client
        self.celery = celery
        self.journal = journal
        self.registry = registry
        self.machines = machines
        self.queues = queues
        self.keys = Keys(settings.key_prefix)

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
        """
        fingerprint = request_fingerprint(model_id, kind, params, target)
        params = dict(params)
        params.setdefault("seed", secrets.randbelow(2**31))  # drawn here so the journal records it
        try:
            record = self.registry.get(model_id)
            if kind not in record.kinds:
                raise Rejected(
                    f"model {model_id!r} runs kinds {', '.join(record.kinds)}; got kind {kind!r}",
                    reason="kind_not_supported",
                )
            request = JobRequest(model_id=model_id, family=record.family, kind=kind, target=target)
            lock = self.redis.lock(
                self.keys.fleet_lock(),
                timeout=self.settings.fleet_lock_ttl_s,
                blocking_timeout=self.settings.fleet_lock_wait_s,
            )
            if not lock.acquire():
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
                views = self.machines.views()
                placement = place(request, views)
                job = self.journal.add(
                    Job(state=JobState.queued, model_id=model_id, kind=kind, params=params,
                        target=target, machine=placement.machine, idempotency_key=idempotency_key,
                        request_fingerprint=fingerprint)
                )
                if not lock.owned():
                    self.journal.transition(job.id, [JobState.queued], JobState.interrupted,
                                            reason="placement_lock_lost",
                                            message="the fleet lock expired before publishing; nothing was published")
                    raise PlacementLost("the fleet lock expired before the job was published; submit again")
                self.celery.send_task(RUN_JOB_TASK, args=[job.id], task_id=job.id, queue=keys.queue(placement.machine))
                return Submission(job=job, position=views[placement.machine].backlog)
            finally:
                if lock.owned():
                    lock.release()
        except HomefleetError as error:
            if not isinstance(error, PlacementLost) and error.reason != "idempotency_key_reused":
                self.journal.add(
                    Job(state=JobState.rejected, model_id=model_id, kind=kind, params=params, target=target,
                        reason=error.reason, message=error.message)
                )
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
        log.info("job %s cancelled; queue entry %s", job_id, "removed" if removed else "already gone")
        return job
