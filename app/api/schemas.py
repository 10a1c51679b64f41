"""Request and response bodies of the public HTTP API (the API returns these, never table rows);
the internal API's bodies are ``app/core/protocol.py``, shared with the workers."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from app.core.limits import MAX_MODEL_ID
from app.core.request_body import RequestBody
from app.core.states import JobState
from app.db.tables import Job
from routing.placement import SERVER


class JobCreate(RequestBody):
    """``POST /v1/jobs``. ``target``: a machine name (pinned, never rerouted), or ``"auto"``."""

    model_config = ConfigDict(extra="forbid")  # a misspelt field is refused (422 naming it), not ignored

    model: str = Field(min_length=1, max_length=MAX_MODEL_ID, description="registered model id")
    kind: str = Field(min_length=1, max_length=32, description="txt2img | edit | upscale | video")
    params: dict[str, Any] = Field(
        default_factory=dict, description="kind parameters, e.g. prompt, width, height, steps, seed"
    )
    target: str = Field(SERVER, min_length=1, max_length=32, description="machine name or 'auto'; default 'server'")
    webhook_url: str | None = Field(
        None,
        min_length=1,
        max_length=2048,
        description='http(s) URL the job\'s record is POSTed to, signed, when it ends (docs/api.md "Webhooks"); '
        "its host must be in the fleet's webhook allow-list",
    )


class JobRequeue(RequestBody):
    """``POST /v1/jobs/{id}/requeue``; every field optional, the body too. ``seed``
    absent: the old job's seed; ``null``: a new one drawn; a number: that seed. ``target``
    absent: the old job's target."""

    model_config = ConfigDict(extra="forbid")

    seed: int | None = Field(None, ge=0, le=2**63 - 1, description="absent: the same seed; null: a new one")
    target: str | None = Field(None, min_length=1, max_length=32, description="machine name or 'auto'")


class WebhookPublic(BaseModel):
    """An ended job's webhook delivery as ``GET /v1/jobs/{id}`` shows it (app/jobs/webhooks.py)."""

    state: str  # pending (retried with backoff) | delivered | failed (gave up after max_attempts)
    attempts: int  # POSTs made so far
    max_attempts: int  # webhook_attempts
    next_attempt_at: float | None = None  # unix seconds of the next attempt, while pending
    detail: str = ""  # the last attempt's outcome, e.g. "attempt 2: HTTP 500; next in 10 s"


class ResultPublic(BaseModel):
    digest: str
    media_type: str
    size_bytes: int
    url: str
    seed: int | None = None  # the seed of this image (image i of n: the job's seed + i)


def job_results(job: Job) -> list[ResultPublic] | None:
    """Every result of a succeeded job in order (n images), each with its URL
    (``/v1/jobs/{id}/result?index=i``) and seed; None before it has succeeded. A job stored
    before jobs had ``results`` lists its one result."""
    if job.state != JobState.succeeded or not job.result_digest:
        return None
    rows = job.results or [
        {
            "digest": job.result_digest,
            "media_type": job.result_media_type,
            "bytes": job.result_bytes,
            "seed": _seed(job.params),
        }
    ]
    return [
        ResultPublic(
            digest=row["digest"],
            media_type=row.get("media_type") or "",
            size_bytes=row.get("bytes") or 0,
            url=f"/v1/jobs/{job.id}/result" + (f"?index={i}" if i else ""),
            seed=row.get("seed"),
        )
        for i, row in enumerate(rows)
    ]


def predicted_s(job: Job) -> float | None:
    """Placement's expected load + run seconds (R12), when it made a prediction."""
    if job.predicted_load_s is None and job.predicted_run_s is None:
        return None
    return (job.predicted_load_s or 0.0) + (job.predicted_run_s or 0.0)


class MemoryEstimatePublic(BaseModel):
    """The job's memory estimate at submission, in bytes (R10, R11): ``weights_bytes`` exact
    from the safetensors headers, ``working_bytes`` by kind and size from the fleet config."""

    weights_bytes: int
    working_bytes: int
    total_bytes: int


def memory_estimate(job: Job) -> MemoryEstimatePublic | None:
    """The job's memory estimate, when placement made one (jobs journaled before it have none)."""
    if job.memory_estimate_bytes is None:
        return None
    return MemoryEstimatePublic(
        weights_bytes=job.weights_bytes or 0,
        working_bytes=job.working_bytes or 0,
        total_bytes=job.memory_estimate_bytes,
    )


class JobPublic(BaseModel):
    id: str
    state: JobState
    model: str
    kind: str
    params: dict[str, Any]
    target: str
    machine: str | None
    reason: str | None
    message: str | None
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    load_s: float | None
    run_s: float | None
    cold_load: bool | None
    predicted_start_s: float | None = None  # placement's prediction at submission (R12, R13)
    predicted_load_s: float | None = None
    predicted_run_s: float | None = None
    progress: dict[str, int] | None = None  # {"step": n, "total": N} while running
    result: ResultPublic | None = None
    results: list[ResultPublic] | None = None  # every result in order (n images); result is the first
    requeued_from: str | None = None  # the job this one repeats (POST /v1/jobs/{id}/requeue)
    seed: int | None = None  # the seed it ran with: given by the client or drawn at submission
    predicted_s: float | None = None  # placement's expected load+run seconds, when it made one
    provenance: dict[str, Any] | None = None  # the result's provenance (also embedded in the file)
    memory_estimate: MemoryEstimatePublic | None = None  # bytes placement priced it at (R10, R11)
    webhook_url: str | None = None  # where its record is POSTed when it ends
    webhook: WebhookPublic | None = None  # GET /v1/jobs/{id} only: its delivery's attempts so far
    note: str | None = None  # GET /v1/jobs/{id} only: why a queued or running job does not move (its machine offline)

    @classmethod
    def from_job(cls, job: Job, progress: dict[str, int] | None = None) -> JobPublic:
        results = job_results(job)
        result = results[0] if results else None
        return cls(
            id=job.id,
            state=job.state,
            model=job.model_id,
            kind=job.kind,
            params=job.params,
            target=job.target,
            machine=job.machine,
            reason=job.reason,
            message=job.message,
            created_at=job.created_at,
            started_at=job.started_at,
            finished_at=job.finished_at,
            load_s=job.load_s,
            run_s=job.run_s,
            cold_load=job.cold_load,
            predicted_start_s=job.predicted_start_s,
            predicted_load_s=job.predicted_load_s,
            predicted_run_s=job.predicted_run_s,
            progress=progress,
            result=result,
            results=results,
            requeued_from=job.requeued_from,
            seed=_seed(job.params),
            predicted_s=predicted_s(job),
            provenance=job.provenance,
            memory_estimate=memory_estimate(job),
            webhook_url=job.webhook_url,
        )


class JobAccepted(BaseModel):
    """202 answer to a submission."""

    id: str
    state: JobState
    machine: str
    position: int = Field(description="jobs ahead of this one on its machine (queued + running)")
    predicted_start_s: float | None = Field(
        None, description="expected start: seconds from now until its machine reaches it (the work ahead, R12)"
    )
    url: str


class FileStored(BaseModel):
    """201 answer to ``POST /v1/files``: the id to name in a job's params (``"image": id``)."""

    id: str = Field(description="the content digest, 'blake3:<hex>'")
    media_type: str
    size_bytes: int


def _seed(params: dict[str, Any]) -> int | None:
    """The job's seed; None when it has none, or when a refused job was journaled with
    whatever the client sent there (``rejected`` keeps the params as given)."""
    seed = params.get("seed")
    return seed if isinstance(seed, int) and not isinstance(seed, bool) else None
