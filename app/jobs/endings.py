"""One home for a job's way out of the journal's live states (R14, R19): every claim and every
end of a job goes through :class:`Endings`, whoever makes it (the internal API, a cancel, a
revoke from Flower, reconciliation, a submission that lost its lock).

An end is, in this order:

1. the journal's conditional transition (``app/journal/jobs.py``; it writes the job's webhook
   delivery in the same transaction, app/jobs/webhooks.py delivers it);
2. its reservation released (R14; reconciliation's own ends leave that to the pass's
   ``Reservations.reconcile``, which counts what it releases);
3. its measured times learned (R13) when its run finished (a succeeded job, or one failed
   after its run);
4. its metrics counted (app/metrics.py);
5. its Celery task event sent for Flower, when no worker's task reports that end
   (``announce``, app/jobs/task_events.py);
6. the change published on ``Keys.job_changes`` (:class:`Changes`): the waiters of
   app/jobs/waiting.py wake on it instead of polling the journal.

A result upload (:meth:`Endings.result`) verifies and stores the files first (R2), then
succeeds the job; a result refused fails it. ``tests/unit/jobs/test_endings_home.py`` keeps
this module the only caller of the journal's end transitions outside the journal itself.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import redis

from app.core.errors import Conflict, IntegrityFailure, Rejected
from app.core.keys import Keys
from app.core.kinds import BATCH_PARAM
from app.core.states import RESULT_NOT_STORED, JobState
from app.db.tables import Job
from app.fleet.reservations import Reservations
from app.jobs.progress import ProgressStore
from app.jobs.task_events import TaskEvents
from app.journal.jobs import Journal
from app.journal.timings import TimingStore
from app.metrics import Metrics
from app.store.files import ResultStore, StoredFile
from routing.estimate import Estimator

log = logging.getLogger(__name__)


class Changes:
    """Publishes a job's change on ``Keys.job_changes`` (JSON ``{"job", "state"}``), best effort:
    a waiter that misses one re-reads the journal at its next safety check
    (app/jobs/waiting.py)."""

    def __init__(self, client: redis.Redis | None, keys: Keys | None) -> None:
        self.redis = client
        self.keys = keys

    def published(self, job: Job) -> Job:
        """Publish ``job``'s state; returns ``job``. Never raises for a Redis error (logged)."""
        if self.redis is not None and self.keys is not None:
            try:
                self.redis.publish(self.keys.job_changes(), json.dumps({"job": job.id, "state": str(job.state)}))
            except redis.RedisError as error:
                log.warning("job %s: its change to %s was not published: %s", job.id, job.state, error)
        return job


@dataclass(frozen=True)
class Upload:
    """A worker's result upload as the internal API received it: the first file's bytes and
    digest, the others' (images 2..n) with ``more_digests`` as sent (a JSON list), the
    worker's timings (seconds) and its provenance record: a callable parsing it into a JSON
    object, called once the job is known to take a result (it raises ``Rejected``
    ``invalid_provenance``)."""

    data: bytes
    digest: str
    more: list[bytes]
    more_digests: str
    load_s: float
    run_s: float
    cold_load: bool
    provenance: Callable[[], dict[str, Any]]


class Endings:
    """Claims and ends jobs (module docstring). ``estimator``: the current cost model, which the
    learned timings are folded against (``FleetCosts.estimator``)."""

    def __init__(
        self,
        journal: Journal,
        reservations: Reservations,
        timings: TimingStore,
        estimator: Callable[[], Estimator],
        metrics: Metrics | None = None,
        events: TaskEvents | None = None,
        changes: Changes | None = None,
        progress: ProgressStore | None = None,
        store: ResultStore | None = None,
    ) -> None:
        self.journal = journal
        self.reservations = reservations
        self.timings = timings
        self.estimator = estimator
        self.metrics = metrics
        self.events = events  # Flower hears of the ends no worker's task reports
        self.changes = changes or Changes(None, None)
        self.progress = progress
        self.store = store

    def finished(self, job: Job, announce: bool = False, release: bool = True) -> Job:
        """Steps 2-6 of an end (module docstring) for ``job``, which has just ended (any
        state); returns it. A run cut short reports no run time (None; 0 from older workers)
        and teaches nothing. ``announce``: the server ended it and no worker's task reports
        that end, so its task event is sent for Flower. ``release`` False: reconciliation's
        pass releases the reservation itself."""
        if release:
            self.reservations.release(job.machine, job.id)
        if announce and self.events is not None:
            self.events.ended(job)
        if self.metrics is not None:
            self.metrics.finished(job)
        if job.state in (JobState.succeeded, JobState.failed) and job.run_s:  # the run finished and was timed
            self.timings.observe(job, self.estimator())
        return self.changes.published(job)

    def claim(self, job_id: str, machine: str, worker_boot_id: str | None = None, claim_id: str | None = None) -> Job:
        """Atomic ``queued -> running`` (R19, :meth:`Journal.claim`): its reservation starts and
        the job is alive from here on (the watchdog's sign of life).

        Raises:
            Conflict: a second delivery of the job (nothing changes).
        """
        job = self.journal.claim(job_id, machine, worker_boot_id, claim_id)
        self.reservations.start(machine, job_id)
        if self.progress is not None:
            self.progress.report(job_id)
        return self.changes.published(job)

    def interrupt(
        self,
        job_id: str,
        from_states: Iterable[JobState],
        reason: str,
        message: str,
        *,
        announce: bool = False,
        release: bool = True,
        forget_key: bool = False,
    ) -> Job:
        """``queued|running -> interrupted`` with a reason code (R19), then the end's steps.
        ``forget_key``: drop the job's ``Idempotency-Key`` with the transition (a job never
        published, whose retry must be a new submission, R20).

        Raises:
            Conflict: the job is in another state (nothing changes).
        """
        interrupted = self.journal.interrupt(job_id, from_states, reason, message, forget_key=forget_key)
        return self.finished(interrupted, announce, release)

    def cancel(
        self,
        job_id: str,
        reason: str = "cancelled",
        message: str = "cancelled by request before it started",
        *,
        announce: bool = True,
        release: bool = True,
        event_detail: str | None = None,
    ) -> Job:
        """``queued -> cancelled`` with a reason code (``cancelled``, ``revoked``, ``purged``),
        then the end's steps. ``event_detail``: the journal event's detail (default
        ``<reason>: <message>``).

        Raises:
            Conflict: the job is not queued (nothing changes).
        """
        if event_detail is None:
            job = self.journal.cancel(job_id, reason, message)
        else:
            job = self.journal.transition(
                job_id, [JobState.queued], JobState.cancelled, reason=reason, event_detail=event_detail, message=message
            )
        return self.finished(job, announce, release)

    def cancel_running(
        self, job_id: str, machine: str, message: str, *, announce: bool = True, release: bool = True
    ) -> Job:
        """``running -> cancelled`` (reason ``cancelled``): stopped by request while it ran
        (``POST /v1/jobs/{id}/cancel``), then the end's steps. ``announce`` defaults to True:
        the worker's task reports no outcome of its own, so Flower hears ``task-revoked`` from here.

        Raises:
            Conflict: the job is not running (nothing changes).
        """
        return self.finished(self.journal.cancel_running(job_id, machine, message), announce, release)

    def fail(self, job_id: str, machine: str, reason: str, message: str, **values: Any) -> Job:
        """``running -> failed`` with a reason code (the worker's report, or its result refused),
        then the end's steps.

        Raises:
            Conflict: the job is not running on ``machine``.
        """
        return self.finished(self.journal.fail(job_id, machine, reason, message, **values))

    def succeed(self, job_id: str, machine: str, **values: Any) -> Job:
        """``running -> succeeded`` with the stored result's fields, then the end's steps."""
        return self.finished(self.journal.succeed(job_id, machine, **values))

    def recover(self, job_id: str, machine: str, **values: Any) -> Job:
        """``failed (result_not_stored) -> succeeded`` once its spooled result is stored; its
        reservation was released and its timings learned when it failed, so only the change
        is published.

        Raises:
            Conflict: the job is not failed ``result_not_stored``.
        """
        return self.changes.published(self.journal.recover(job_id, machine, **values))

    def result(self, job: Job, machine: str, upload: Upload, predicted_s: float | None) -> Job:
        """Verify and store ``upload`` for ``job`` (placed on ``machine``, as read just before),
        then end it (R2): ``succeeded`` with the stored files, or ``succeeded`` again for a
        ``result_not_stored`` failure (recovered). The same result for a job already
        succeeded with it returns that job (a retry whose answer was lost). The provenance is
        journaled with the server's own figures added (job id, predicted and actual seconds).

        Raises:
            Conflict: the job is neither running nor a ``result_not_stored`` failure
                (``not_running``; nothing stored).
            Rejected: ``invalid_provenance`` (nothing changes); ``invalid_results`` (not n - 1
                more files and digests): the job fails.
            IntegrityFailure: a file does not match its digest, media type or size: nothing is
                stored and the job fails (reason ``integrity``).
            StorageFull: the store is full; the job stays running (the worker retries).
        """
        assert self.store is not None, "Endings.result needs the result store"
        job_id = job.id
        if job.state == JobState.succeeded and job.result_digest == upload.digest:  # a retry whose answer was lost
            return job
        recovering = job.state == JobState.failed and job.reason == RESULT_NOT_STORED
        if job.state != JobState.running and not recovering:  # ended meanwhile (interrupted, cancelled): store nothing
            raise Conflict(f"job {job_id} is {job.state}, not running; its result is not stored", reason="not_running")
        record = upload.provenance()
        record.update(
            {
                "job_id": job_id,
                "load_s": upload.load_s,
                "run_s": upload.run_s,
                "cold_load": upload.cold_load,
                "actual_s": upload.load_s + upload.run_s,
                "predicted_s": predicted_s,
            }
        )
        timings = {"load_s": upload.load_s, "run_s": upload.run_s, "cold_load": upload.cold_load}
        try:
            digests = more_results(job.params, upload.more_digests, len(upload.more))
            stored = self.store.store(upload.data, upload.digest, job.kind == "text")
            all_stored: list[StoredFile] = [stored]
            for extra_data, extra_digest in zip(upload.more, digests, strict=True):
                all_stored.append(self.store.store(extra_data, extra_digest, False))
        except (Rejected, IntegrityFailure) as error:  # the job cannot succeed with these
            if not recovering:
                self.fail(job_id, machine, error.reason, error.message, **timings)
            raise
        seed = job.params.get("seed")
        results = [
            {
                "digest": s.digest,
                "path": str(s.path),
                "media_type": s.media_type,
                "bytes": s.size_bytes,
                "seed": seed + i if isinstance(seed, int) else None,
            }
            for i, s in enumerate(all_stored)
        ]
        if job.requeued_from is not None:
            record["requeued_from"] = job.requeued_from
        result = {
            "result_digest": stored.digest,
            "result_path": str(stored.path),
            "result_media_type": stored.media_type,
            "result_bytes": stored.size_bytes,
            "provenance": record,
            "results": results,
        }
        if recovering:
            log.info("job %s: recovered result %s from %s", job_id, stored.digest, machine)
            return self.recover(job_id, machine, **result)
        return self.succeed(job_id, machine, **result, **timings)


def more_results(params: dict[str, object], more_digests: str, received: int) -> list[str]:
    """The digests of images 2..n of a result upload, checked against the job's ``n``.

    Raises:
        Rejected: reason ``invalid_results``: not a JSON list of strings, or not n - 1 of them
            (or of files).
    """
    try:
        digests = json.loads(more_digests)
    except ValueError as error:
        raise Rejected(f"more_digests must be a JSON list: {error}", reason="invalid_results") from error
    if not isinstance(digests, list) or not all(isinstance(d, str) for d in digests):
        raise Rejected("more_digests must be a JSON list of 'blake3:<hex>' strings", reason="invalid_results")
    count = params.get(BATCH_PARAM, 1)
    wanted = count - 1 if isinstance(count, int) and count > 1 else 0
    if len(digests) != wanted or received != wanted:
        raise Rejected(
            f"the job asks n={wanted + 1} images: the upload must carry {wanted} more (files and digests), "
            f"got {received} files and {len(digests)} digests",
            reason="invalid_results",
        )
    return digests
