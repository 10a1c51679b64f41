"""Submission: place, journal and enqueue a job atomically under the fleet lock (R14).

Sequence under the lock (shared/notes/celery-redis.md, "Locks"): read the machines, place,
journal the job as ``queued``, check that the lock is still ours (C04), publish to
``machine.<name>`` with ``task_id = job id``. A refused submission is journaled as
``rejected`` with its reason; nothing is published.
"""

from __future__ import annotations

import logging
import secrets
from dataclasses import dataclass
from typing import Any

import redis
from celery import Celery

from app import keys
from app.config import Settings
from app.celery_app import RUN_JOB_TASK
from app.errors import HomefleetError, PlacementLost, Rejected
from app.inputs import InputStore
from app.journal import Job, Journal, JobState
from app.kind_params import check_kind_params
from app.machines import MachineStates
from app.keys import Keys
from app.registry import Registry
from routing.placement import JobRequest, place


@dataclass(frozen=True)
class Submission:
    job: Job
    position: int  # jobs ahead of it on its machine when it was enqueued (queued + running)

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
        inputs: InputStore | None = None,
    ) -> None:
        self.settings = settings
        self.redis = client
        self.celery = celery
        self.journal = journal
        self.registry = registry
        self.machines = machines
        self.inputs = inputs or InputStore(settings.inputs_dir, settings.max_input_bytes)
        self.keys = Keys(settings.key_prefix)

    def submit(self, model_id: str, kind: str, params: dict[str, Any], target: str) -> Submission:
        """Place and enqueue one job; return it as journaled (state ``queued``) with its position.

        Raises:
            Rejected / MachineUnavailable / NotFound: refused; journaled as ``rejected``.
            PlacementLost: the fleet lock expired mid-decision; nothing was published.
        """
        params = dict(params)
        params.setdefault("seed", secrets.randbelow(2**31))  # drawn here so the journal records it
        try:
            record = self.registry.get(model_id)
            if kind not in record.kinds:
                raise Rejected(
                    f"model {model_id!r} runs kinds {', '.join(record.kinds)}; got kind {kind!r}",
                    reason="kind_not_supported",
                )
            check_kind_params(kind, params, self.inputs)  # inputs uploaded, formats, frames (R22)
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
                views = self.machines.views()
                placement = place(request, views)
                job = self.journal.add(
                    Job(state=JobState.queued, model_id=model_id, kind=kind, params=params,
                        target=target, machine=placement.machine)
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
            if not isinstance(error, PlacementLost):
                self.journal.add(
                    Job(state=JobState.rejected, model_id=model_id, kind=kind, params=params, target=target,
                        reason=error.reason, message=error.message)
                )
            log.info("submission refused: %s (%s)", error.message, error.reason)
            raise
