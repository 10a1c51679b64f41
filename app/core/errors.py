"""Homefleet's domain errors, mapped to HTTP status and body once, in ``create_app``.

Routes and services raise these, never ``HTTPException``; the pure cores raise their own
(``routing.errors``, ``residency.errors``), which :func:`from_core` turns into these. Every
error carries a machine-readable ``reason`` and a message that names the field, the value and
the limit. The tree::

    HomefleetError
    ├── Rejected (422)            ├── Unauthorized (401)      ├── ConfigError
    ├── IntegrityFailure (422)    ├── Forbidden (403)         ├── ServiceDown (503)
    ├── NotFound (404)            ├── MachineUnavailable (503) ├── Overloaded (429)
    ├── Conflict (409)            ├── PlacementLost (503)     ├── ResidencyProtected (409)
    │   └── JobPending (409, job_ids)
    └── StorageFull (507)

``QuotaExceeded`` (429, an API key over its quota) is an ``Overloaded``.
"""

from __future__ import annotations

from residency.errors import ResidencyRefused
from routing.errors import Full, Refused, Unavailable


class HomefleetError(Exception):
    """Base of every domain error.

    Attributes:
        status_code: HTTP status the API answers with.
        reason: short code kept in the journal and returned to clients.
        message: human-readable text naming what was wrong and how to fix it.
        param: the request field at fault, when one is (OpenAI's ``param``), e.g. ``params.stepz``.
    """

    status_code: int = 500
    default_reason: str = "error"

    def __init__(self, message: str, *, reason: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.reason = reason or self.default_reason
        self.param = param
        self.job_id: str | None = None  # the journaled ``rejected`` job of a refused submission, when there is one


class Rejected(HomefleetError):
    """Raised when a submission is refused before it is queued (R10, R22): unknown model or
    machine, model not verified on the target, family not supported, invalid parameters."""

    status_code = 422
    default_reason = "rejected"


class MachineUnavailable(HomefleetError):
    """Raised when an explicitly targeted machine is offline, drained or receiving a sync (R10):
    never rerouted. Temporary: the submission answers 503 with ``Retry-After``."""

    status_code = 503
    default_reason = "machine_unavailable"
    retry_after_s: int | None = None  # set by the submission from its settings


class NotFound(HomefleetError):
    """Raised when a job, model or result does not exist."""

    status_code = 404
    default_reason = "not_found"


class Conflict(HomefleetError):
    """Raised when the journal's state forbids the request, e.g. a second claim of a job (R19)."""

    status_code = 409
    default_reason = "conflict"


class JobPending(Conflict):
    """Raised when a request must be answered before its jobs have ended (the client's announced
    timeout, ``images_wait_s``), or before the first request of a resent call has submitted
    them: 409 ``job_pending`` naming the jobs known so far (``job_ids``; empty only while that
    first request is still submitting), which keep running. Answered with
    ``x-should-retry: false``, so no SDK resends it (R20; app/api/openai_errors.py)."""

    default_reason = "job_pending"

    def __init__(self, message: str, job_ids: list[str], *, reason: str | None = None) -> None:
        super().__init__(message, reason=reason)
        self.job_ids = list(job_ids)


class ServerStopping(HomefleetError):
    """Raised to a request still waiting for its jobs when the server is told to stop (SIGTERM):
    503 ``server_stopping`` with ``Retry-After``, naming the jobs, which run on. Unlike
    :class:`JobPending` it may be resent: the SDKs resend a 503 after ``Retry-After`` and the
    resent call gets its first call's jobs from the next server (C10), instead of a connection
    cut at the end of the shutdown's grace, after which their two quick retries found no server."""

    status_code = 503
    default_reason = "server_stopping"

    def __init__(self, job_id: str, *, retry_after_s: int) -> None:
        super().__init__(
            f"the server is stopping; job {job_id} runs on: send this request again (the SDKs do, after "
            f"Retry-After) to get its result from the next server, without a new job"
        )
        self.waited_job_id = job_id
        self.retry_after_s = retry_after_s


class IntegrityFailure(HomefleetError):
    """Raised when content does not match its digest, media type or size limit (R2, R5)."""

    status_code = 422
    default_reason = "integrity"


class Unauthorized(HomefleetError):
    """Raised when a request carries no valid token."""

    status_code = 401
    default_reason = "unauthorized"


class Forbidden(HomefleetError):
    """Raised when a worker's token acts on another machine's job."""

    status_code = 403
    default_reason = "forbidden"


class PlacementLost(HomefleetError):
    """Raised when the fleet lock expired before a placement was committed (C04): nothing
    was published; the client may submit again."""

    status_code = 503
    default_reason = "placement_lock_lost"


class ConfigError(HomefleetError):
    """Raised at start when a configuration file cannot be used (reason ``invalid_config``):
    missing, not TOML, or not a valid fleet. The message names the file and the fault."""

    status_code = 500
    default_reason = "invalid_config"


class ServiceDown(HomefleetError):
    """Raised when Redis (reason ``redis_down``) or the journal's database (``journal_down``)
    does not answer: 503 with Retry-After, the reasons ``GET /health`` gives."""

    status_code = 503
    default_reason = "redis_down"
    #: the reasons a 503 of this kind carries: a passing outage, worth the same request again
    REASONS = frozenset({"redis_down", "journal_down"})

    def __init__(self, message: str, *, reason: str | None = None, retry_after_s: int = 5) -> None:
        super().__init__(message, reason=reason)
        self.retry_after_s = retry_after_s


class StorageFull(HomefleetError):
    """Raised when a file cannot be written because the disk (or the process's file-size limit,
    ``RLIMIT_FSIZE``, or a quota) is full: 507, naming what could not be stored. A
    result refused this way leaves its job running: the worker keeps it and retries."""

    status_code = 507
    default_reason = "storage_full"


class Overloaded(HomefleetError):
    """Raised when a submission would exceed ``max_queued_per_machine`` or
    ``max_pending_total`` (R23), or an API key's quota (:class:`QuotaExceeded`): refused at
    once, answered 429 with ``Retry-After``."""

    status_code = 429
    default_reason = "overloaded"

    def __init__(self, message: str, *, reason: str | None = None, retry_after_s: int = 5) -> None:
        super().__init__(message, reason=reason)
        self.retry_after_s = retry_after_s


class QuotaExceeded(Overloaded):
    """Raised when a submission would take an API key past its quota
    (``app/jobs/quotas.py``): ``max_queued_jobs`` (reason ``quota_queued``) or
    ``max_gpu_seconds_per_hour`` (``quota_gpu_seconds``). 429 with the ``Retry-After`` the
    check computed (kept as it is by the submission)."""

    default_reason = "quota"


class ResidencyProtected(HomefleetError):
    """Raised when a load could only fit by evicting a protected model (R15, R16): the job
    fails with reason ``residency_protected``; nothing is evicted."""

    status_code = 409
    default_reason = "residency_protected"


def from_core(error: Refused | ResidencyRefused) -> HomefleetError:
    """The domain error of a pure core's refusal: placement's (``routing.errors``: 422, or 503
    for a target that is temporarily unavailable, 429 for a full one) or residency's (409)."""
    if isinstance(error, ResidencyRefused):
        return ResidencyProtected(error.message, reason=error.reason)
    if isinstance(error, Unavailable):
        return MachineUnavailable(error.message, reason=error.reason)
    if isinstance(error, Full):
        return Overloaded(error.message, reason=error.reason)
    return Rejected(error.message, reason=error.reason)
