"""A job's states, defined once (R19; DESIGN's "a job's way"): the journal, the API, the client,
reconciliation and status all read these.

States and their legal ways::

    rejected                          (refused at submission; never queued)
    queued  -> running | cancelled | interrupted
    running -> succeeded | failed | interrupted | cancelled
"""

from __future__ import annotations

from enum import StrEnum


class JobState(StrEnum):
    queued = "queued"  # journaled and published to its machine's queue; not started
    running = "running"  # claimed by its machine's worker (happens once per job)
    succeeded = "succeeded"  # result verified and stored by the server (R2)
    failed = "failed"  # ended with an error; ``reason`` says which
    cancelled = "cancelled"  # removed from its queue before it started, or stopped by request while it ran
    interrupted = "interrupted"  # may have started, then its worker or the server died; never re-run
    rejected = "rejected"  # refused at submission, kept with its reason; never queued


ACTIVE: frozenset[JobState] = frozenset({JobState.queued, JobState.running})
"""States of a job that holds a reservation on its machine (its backlog, R14)."""

ENDED: frozenset[JobState] = frozenset(JobState) - ACTIVE
"""States a job never leaves."""

LEGAL: dict[JobState, frozenset[JobState]] = {
    JobState.queued: frozenset({JobState.running, JobState.cancelled, JobState.interrupted}),
    JobState.running: frozenset({JobState.succeeded, JobState.failed, JobState.interrupted, JobState.cancelled}),
    JobState.failed: frozenset({JobState.succeeded}),  # only a result_not_stored failure, recovered
}
"""The only legal transitions (R19). ``rejected``, ``succeeded``, ``cancelled`` and
``interrupted`` have none. A ``failed`` job becomes ``succeeded`` only when its reason is
:data:`RESULT_NOT_STORED` and its worker's spooled result is brought in
(``homefleet results recover``, ``Journal.recover``): the job ran once; its result was kept,
not re-made."""

CANCELLED = "cancelled"
"""The reason of a job cancelled by request (``POST /v1/jobs/{id}/cancel``); a running job's
worker reports it as its failure reason when it stopped between steps, and the server ends
the job ``cancelled``, not ``failed``."""

OOM = "oom"
"""The failure reason of a job that ran out of memory (R21): its worker reports it, the server
remembers the job's size for its model, kind and machine, and refuses that size there again."""

RESULT_NOT_STORED = "result_not_stored"
"""The failure reason of a job whose result the server could not store (a full disk) after the
worker's retries; the worker keeps the file in its spool."""
