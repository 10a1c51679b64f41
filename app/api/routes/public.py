"""Public API for clients: submit jobs, read them, fetch results (R1, R3, R9, R10)."""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from typing import Annotated, Any, Literal

from anyio import to_thread
from fastapi import APIRouter, File, Header, Query, Request, Response, UploadFile
from fastapi.responses import FileResponse, JSONResponse

from app.api.auth import request_key_id
from app.api.routes.deps import Context, result_file, stored_file
from app.api.schemas import FileStored, JobAccepted, JobCreate, JobPublic, JobRequeue, WebhookPublic
from app.api.strict_json import StrictJsonRoute
from app.context import ServerContext
from app.core.connections import REDIS_DOWN
from app.core.errors import Conflict, HomefleetError, Rejected
from app.core.families import kinds_of
from app.core.kinds import BATCH_PARAM, CHAT_SHOWN_PARAM, KINDS, MAX_SEED, family_kind_spec
from app.core.limits import MAX_IDEMPOTENCY_KEY, FamilyLimits, limits_for
from app.core.states import JobState
from app.db.tables import Job
from app.jobs.dispatch import UNSET, Submission
from app.jobs.expansion import submit_expanded
from app.jobs.result_inputs import adopt_results
from app.jobs.validation import fitting_adapters
from routing.timings import ADAPTER_KIND, TEXT_KIND

router = APIRouter(prefix="/v1", route_class=StrictJsonRoute)
log = logging.getLogger(__name__)
MAX_PAGE = 500  # jobs per page of GET /v1/jobs
JOB_FIELDS = {
    "unknown_model": "model",
    "model_retired": "model",
    "kind_not_supported": "kind",
    "unknown_machine": "target",
}
"""A submission's refusal reason -> the ``POST /v1/jobs`` field at fault, for the refusals raised
where the request's field names are unknown (the registry, the validator, placement)."""


@router.post("/jobs", status_code=202, response_model=None)
async def submit_job(
    body: JobCreate,
    ctx: Context,
    request: Request,
    response: Response,
    dry_run: bool = False,
    idempotency_key: Annotated[
        str | None, Header(min_length=1, max_length=MAX_IDEMPOTENCY_KEY, description="retry-safe key (R20)")
    ] = None,
) -> JobAccepted | JSONResponse:
    """Validate, place and enqueue a job. 202 with its id, machine and position in that
    machine's line; 422 (a filter refused the target: its reason code) or 503 (target
    offline) with ``{"error": {"reason", "message"}}``.

    ``?dry_run=true``: 200 with the full decision (every machine: the filter that excluded it,
    or its expected-finish breakdown in seconds), enqueuing and journaling nothing (R12).

    ``Idempotency-Key``: a retry with the same key and body returns the original job
    (header ``Idempotency-Replayed: true``) instead of creating a second one; the same key
    with another body is refused with 422 (R20).

    An API key at a limit of its quota is refused with 429 ``quota_queued`` or
    ``quota_gpu_seconds`` and ``Retry-After`` (app/jobs/quotas.py).

    ``webhook_url``: the job's record is POSTed there, signed with the secret of the
    API key that submitted it, when the job ends (docs/api.md "Webhooks"); a host outside the
    fleet's webhook allow-list, or a key without a webhook secret, is refused with 422
    ``invalid_webhook_url``."""
    try:
        if CHAT_SHOWN_PARAM in body.params:  # expanded_by: refused with the expansion's other checks
            raise Rejected(
                f"params.{CHAT_SHOWN_PARAM} is set by the server (a chat's last user message, shown as its prompt); "
                "send a chat to POST /v1/chat/completions",
                reason="invalid_params",
                param=f"params.{CHAT_SHOWN_PARAM}",
            )
        key_id = request_key_id(request)
        adopt_results(body.kind, body.params, ctx.inputs, ctx.store, ctx.journal, key_id)  # results as inputs
        if dry_run:
            decision = await to_thread.run_sync(
                ctx.dispatcher.dry_run, body.model, body.kind, body.params, body.target, body.webhook_url, key_id
            )
            refusal = decision.get("error") or {}
            if refusal.get("reason") == "unknown_machine":  # not a filter's decision: refused as the submission is
                raise Rejected(
                    refusal.get("message", f"unknown target {body.target!r}"), reason="unknown_machine", param="target"
                )
            return JSONResponse(decision)
        if body.kind == "txt2img" and body.params.get("expand_prompt") is not None:  # a text job first
            submission = await submit_expanded(
                ctx.dispatcher,
                ctx.waiting,
                body.model,
                dict(body.params),
                body.target,
                idempotency_key,
                ctx.settings.images_wait_s,
                key_id,
                webhook_url=body.webhook_url,
            )
        else:
            submission = await to_thread.run_sync(
                lambda: ctx.dispatcher.submit(
                    body.model,
                    body.kind,
                    body.params,
                    body.target,
                    idempotency_key,
                    api_key_id=key_id,
                    webhook_url=body.webhook_url,
                )
            )
        if submission.replayed:
            response.headers["Idempotency-Replayed"] = "true"
        return accepted(submission, response)
    except HomefleetError as error:  # a refusal from the registry or placement names no field
        if error.param is None and error.reason in JOB_FIELDS:
            error.param = JOB_FIELDS[error.reason]
        raise


@router.post("/jobs/{job_id}/requeue", status_code=202, response_model=JobAccepted)
def requeue_job(
    job_id: str,
    ctx: Context,
    request: Request,
    response: Response,
    body: JobRequeue | None = None,
    idempotency_key: Annotated[
        str | None, Header(min_length=1, max_length=MAX_IDEMPOTENCY_KEY, description="retry-safe key (R20)")
    ] = None,
) -> JobAccepted:
    """Submit a new job with the params of job ``job_id``: the same model, kind,
    params and target, and the same seed unless the body says ``{"seed": null}`` (a new one)
    or names one; linked to the old job (``requeued_from``, in the job and in its result's
    provenance). 202 as ``POST /v1/jobs``; every check of a submission applies (R22;
    a remembered OOM of its size is refused, R21/C08: 422 ``remembered_oom``); 404
    ``job_not_found`` for an unknown job. The old job's ``webhook_url`` is not carried over.

    ``Idempotency-Key``: as on ``POST /v1/jobs`` (R20): a retry of the same requeue (same job,
    same body) returns the first one's job with ``Idempotency-Replayed: true``; the key with
    another job or body is 422 ``idempotency_key_reused``."""
    body = body or JobRequeue()
    seed = body.seed if "seed" in body.model_fields_set else UNSET
    submission = ctx.dispatcher.requeue(
        job_id, seed, body.target, api_key_id=request_key_id(request), idempotency_key=idempotency_key
    )
    if submission.replayed:
        response.headers["Idempotency-Replayed"] = "true"
    return accepted(submission, response)


def accepted(submission: Submission, response: Response) -> JobAccepted:
    """The 202 answer to a queued job: its id, state, machine, place in that machine's line
    and predicted start (seconds), with ``Location`` set to its URL."""
    job = submission.job
    url = f"/v1/jobs/{job.id}"
    response.headers["Location"] = url
    assert job.machine is not None
    return JobAccepted(
        id=job.id,
        state=job.state,
        machine=job.machine,
        position=submission.position,
        predicted_start_s=job.predicted_start_s,
        url=url,
    )


@router.get("/jobs", response_model=list[JobPublic])
def list_jobs(
    ctx: Context,
    state: Annotated[list[JobState] | None, Query(description="only jobs in these states (repeatable)")] = None,
    machine: Annotated[str | None, Query(max_length=32, description="only jobs placed on this machine")] = None,
    limit: Annotated[int, Query(ge=1, le=MAX_PAGE, description=f"jobs per page (1-{MAX_PAGE})")] = 100,
    after: Annotated[str | None, Query(max_length=64, description="the last job id of the previous page")] = None,
    order: Annotated[
        Literal["newest", "oldest"],
        Query(description="newest first (recent jobs, the fleet page) or oldest first (a backlog in its order)"),
    ] = "newest",
) -> list[JobPublic]:
    """Jobs, newest first (``order=oldest``: oldest first), at most ``limit`` (1-500,
    ``MAX_PAGE``) per page; the next page is ``?after=<the last id of this page>`` with the same
    filters, and an empty page ends the list. A running job carries its ``progress``
    (``{"step", "total"}``). 404 ``job_not_found`` for an ``after`` that names no job; 422 for
    an unknown state or a limit out of range, and 422 ``unknown_machine`` (param ``machine``)
    for a ``machine`` that is neither in the fleet nor named by a journaled job (a typo must
    not read as "no jobs there"). The fleet page (``/``) reads it."""
    if machine is not None and machine not in ctx.fleet.machines and not ctx.journal.has_machine(machine):
        raise Rejected(
            f"`machine`: no machine {machine!r} in the fleet, and no job was ever placed on it; "
            f"the fleet's machines are {', '.join(sorted(ctx.fleet.machines))}",
            reason="unknown_machine",
            param="machine",
        )
    return [
        JobPublic.from_job(job, progress_of(ctx, job))
        for job in ctx.journal.page(state, machine, limit, after, newest_first=order == "newest")
    ]


def progress_of(ctx: ServerContext, job: Job) -> dict[str, int] | None:
    """A running job's progress (``{"step", "total"}``), read from Redis; None for any other job,
    and while Redis does not answer: the journal's record is answered all the same (reading jobs
    needs only the journal)."""
    if job.state != JobState.running:
        return None
    try:
        progress = ctx.progress.read(job.id)
    except REDIS_DOWN:
        return None
    return progress.public() if progress else None


def waiting_note(ctx: ServerContext, job: Job) -> str | None:
    """What keeps a queued or running job from moving, for a person reading it: its machine
    without a live heartbeat (the job waits in that machine's line for its worker, R8; a
    running one is judged lost once ``heartbeat_ttl_s`` passes, R19); None otherwise."""
    if job.state not in (JobState.queued, JobState.running) or job.machine is None:
        return None
    try:
        if job.machine in ctx.fleet.machines and ctx.machines.view(job.machine).online:
            return None
    except REDIS_DOWN:
        return "Redis does not answer (redis_down): its machine's state and the job's progress are unknown for now"
    if job.state == JobState.running:
        return (
            f"machine {job.machine} has no live heartbeat: the job ends interrupted (worker_lost) unless its "
            f"worker reports again within heartbeat_ttl_s ({ctx.settings.heartbeat_ttl_s:g} s)"
        )
    return (
        f"machine {job.machine} is offline (no live heartbeat): the job waits in its line until its worker "
        f"returns; to run it elsewhere, cancel it and requeue it with another target "
        f"(`homefleet jobs requeue {job.id} --target auto`)"
    )


@router.get("/jobs/{job_id}", response_model=JobPublic)
def get_job(job_id: str, ctx: Context) -> JobPublic:
    job = ctx.journal.get(job_id)
    public = JobPublic.from_job(job, progress_of(ctx, job))
    public.note = waiting_note(ctx, job)
    if deliveries := ctx.outbox.of_job(job_id):  # its webhook's attempts (the last delivery)
        last = deliveries[-1]
        public.webhook = WebhookPublic(
            state=last.state,
            attempts=last.attempts,
            max_attempts=ctx.settings.webhook_attempts,
            next_attempt_at=last.due_s if last.state == "pending" else None,
            detail=last.detail,
        )
    return public


@router.post(
    "/jobs/{job_id}/cancel",
    response_model=JobPublic,
    responses={
        202: {"model": JobPublic, "description": "the job runs: its worker stops it between steps (still running)"}
    },
)
def cancel_job(job_id: str, ctx: Context, response: Response) -> JobPublic:
    """Cancel a job. Queued (C03): 200 with the job, now ``cancelled``. Running: 202 with the job,
    still ``running``: its worker stops between steps and it ends ``cancelled`` (its message
    says how many steps ran); one that has not stopped ``cancel_grace_s`` later is ended
    ``cancelled`` and its pool process killed. 409 when it has ended, with the reason; 404 for
    an unknown id."""
    job = ctx.dispatcher.request_cancel(job_id)
    if job.state == JobState.running:
        response.status_code = 202
    return JobPublic.from_job(job)


@router.get("/jobs/{job_id}/result", response_class=FileResponse)
def get_result(
    job_id: str,
    ctx: Context,
    request: Request,
    index: Annotated[int, Query(ge=0, le=1000, description="image i of a job with n images (0: the first)")] = 0,
) -> Response:
    """The stored result file (R2), with its stored media type, ``nosniff``,
    ``Content-Disposition: attachment`` and its digest as ``ETag`` (``If-None-Match``: 304,
    :func:`app.api.routes.deps.stored_file`).

    Raises:
        Conflict: 409 ``no_result``, naming the job's state, while it has not succeeded.
        NotFound: 404 ``job_not_found`` for an unknown job; ``result_not_found`` past its last
            image; ``result_missing`` when the journal has the result but its file is gone from
            the data folder (deleted, or a folder restored from an older backup): the message
            names the file and the fixes.
    """
    found = result_file(ctx.journal.get(job_id), index)
    return stored_file(found.path, found.media_type, found.filename, found.digest, request)


@router.post("/files", status_code=201, response_model=FileStored)
async def upload_file(
    ctx: Context, file: Annotated[UploadFile, File(description="a PNG, JPEG or WebP image")]
) -> FileStored:
    """Store an input image (for edit and upscale jobs); its id is its content digest.
    422 naming the limit when it is over ``max_input_bytes`` or not PNG/JPEG/WebP."""
    stored = ctx.inputs.add(await file.read(ctx.settings.max_input_bytes + 1), field="file")
    return FileStored(id=stored.id, media_type=stored.media_type, size_bytes=stored.size_bytes)


@router.get("/machines")
def list_machines(ctx: Context) -> list[dict[str, Any]]:
    """Every machine: online, draining/syncing (nothing new is placed there), verified models,
    ``queued`` (LLEN of its exact queue list, under the broker key prefix), ``running`` (its
    running jobs in the journal), ``backlog`` (its reservations: queued + running, R14), its
    ``warm_models`` and ``committed_models`` (residency, R15) and ``drain_s``, the expected
    seconds until its queue drains (``homefleet status``'s, app/fleet/status.py). ``host`` and
    ``device``: the devices of one host (``box:0``, ``box:1``) have its name and their index;
    a single-device machine is its own host, with device null."""
    status = {row["name"]: row for row in ctx.status()}
    rows = []
    for name, view in ctx.machines.views().items():
        config = ctx.fleet.machines[name]
        rows.append(
            {
                "name": name,
                "host": config.host_name,
                "device": config.device,
                "backend": config.backend,
                "memory_kind": config.memory_kind,
                "memory_bytes": config.memory_bytes,
                "online": view.online,
                "draining": view.draining,
                "syncing": view.syncing,
                "verified_models": sorted(view.verified_models),
                "queued": ctx.queues.length(name),
                "running": len(ctx.journal.list([JobState.running], machine=name)),
                "backlog": view.backlog,
                "warm_models": list(view.warm_models),
                "committed_models": sorted(view.commitments),
                "drain_s": status[name]["drain_s"],
            }
        )
    return rows


MODEL_OWNER = "homefleet"
"""OpenAI's ``owned_by`` of every registered model."""


@router.get("/models")
def list_models(ctx: Context) -> dict[str, Any]:
    """Every registered model in service, in OpenAI's list shape ``{"object": "list", "data":
    [model...]}`` (what ``openai``'s ``client.models.list()`` reads); each model as
    :func:`get_model`. A retired model (``homefleet models retire``) is not listed."""
    records = ctx.registry.list()
    return {"object": "list", "data": [model_entry(ctx, m, records=records) for m in records]}


@router.get("/models/{model_id}")
def get_model(model_id: str, ctx: Context) -> dict[str, Any]:
    """One registered model (``client.models.retrieve(id)``): OpenAI's fields ``id``,
    ``object: "model"``, ``created`` (registration, Unix seconds), ``owned_by``, then
    Homefleet's: ``family``, ``kinds``, ``pipeline_class``, ``total_bytes``, ``precision``,
    ``quantization``, ``weights_bytes``, ``source`` (what it was registered from: ``format``,
    ``diffusers``, ``transformers``, ``hf-cache``, ``single-file`` or a LoRA's layout; for a
    Hugging Face cache snapshot its ``repo`` and ``revision``, the snapshot's commit; for a
    converted checkpoint or a LoRA file the file's ``digest``; null where it does not apply or
    was not recorded), ``defaults`` (its own default job params, registered
    with ``models add --default``; applied when a job does not set them) and ``params`` (per kind
    it runs: ``params``, the param names a submission may set, and ``inputs``, those naming an
    uploaded file id, from :func:`app.core.kinds.family_kind_spec`, with the kind's ``defaults``
    and number ``ranges``; the fleet page's Submit form reads it), ``adapters`` (for a model that
    is no adapter: the registered LoRA adapters of its family that fit it, those a job may name
    in ``params.adapters`` without a refusal for ``adapter_base_mismatch``, R22; the Submit form
    offers these), and ``retired_at`` (ISO 8601
    UTC, when ``homefleet models retire`` took it out of service; null while in service: a
    retired model is still described here, for the jobs that name it).
    404 ``unknown_model`` in OpenAI's error shape."""
    return model_entry(ctx, ctx.registry.get(model_id), ctx.registry.retired_at(model_id))


def model_entry(
    ctx: Context, m: Any, retired_at: datetime | None = None, records: list[Any] | None = None
) -> dict[str, Any]:
    """A model record as ``GET /v1/models`` lists it (:func:`get_model`); ``retired_at``: when
    it was retired, read afresh (a cached record's may be stale), None while in service;
    ``records``: the registry's models in service, when the caller has read them already."""
    kinds = kinds_of(m.family, m.kinds)
    created = _utc(m.created_at)
    adapters = None
    if ADAPTER_KIND not in kinds:
        family = [a for a in (records or ctx.registry.list()) if a.family == m.family and ADAPTER_KIND in a.kinds]
        adapters = fitting_adapters(
            m.id, ctx.registry.folder(m.id), [(a.id, ctx.registry.folder(a.id)) for a in family]
        )
    entry: dict[str, Any] = {
        "id": m.id,
        "object": "model",
        "created": int(created.timestamp()),
        "owned_by": MODEL_OWNER,
        "family": m.family,
        "kinds": list(kinds),
        "pipeline_class": m.pipeline_class,
        "total_bytes": m.total_bytes,
        "precision": m.precision,
        "quantization": m.quantization,
        "weights_bytes": _weights_bytes(ctx, m.id),
        "source": {
            "format": m.source_format,
            "repo": m.source_repo,
            "revision": m.source_revision,
            "digest": m.source_digest,
        },
        "defaults": dict(m.defaults or {}),
        "adapters": adapters,
        "retired_at": _utc(retired_at).isoformat() if retired_at else None,
        "params": {
            kind: _kind_params(m.family, kind, limits_for(ctx.settings.limits, m.family))
            for kind in kinds
            if kind in KINDS
        },
    }
    text = entry["params"].get(TEXT_KIND)
    if text is not None and "max_new_tokens" in text["params"]:
        try:  # the model's own budget, not the family's: at least one prompt token beside the new ones
            budget = ctx.dispatcher.validator.token_limits(m.id).max_total_tokens
        except (OSError, ValueError, HomefleetError):
            budget = None  # its config unreadable here: the family's range stands; a submission says why
        if budget is not None:
            text["ranges"]["max_new_tokens"] = {"min": 1, "max": max(budget - 1, 1), "integer": True}
    return entry


def _utc(at: datetime) -> datetime:
    """``at`` as an aware UTC time (SQLite gives the journal's UTC times back naive)."""
    return at if at.tzinfo else at.replace(tzinfo=UTC)


def _weights_bytes(ctx: Context, model_id: str) -> int | None:
    """The model's weights once loaded (bytes), or None when its headers cannot be read
    (``model_unreadable``, logged): one damaged model does not break the listing."""
    try:
        return ctx.registry.weights_bytes(model_id)
    except Conflict as error:
        log.error("GET /v1/models: %s", error.message)
        return None


def _kind_params(family: str, kind: str, limits: FamilyLimits) -> dict[str, Any]:
    """One kind's form (the fleet page builds its Submit form from it): ``params``, ``inputs``,
    the kind's ``defaults`` on this family (before the model's own), and ``ranges``:
    ``{name: {"min", "max", "integer", "step"?}}`` of its checked numbers (the kind's ranges, and the
    family's limits: sizes a multiple of ``multiple_of`` up to ``max_pixels``, ``steps``, ``n``, ``frames``)."""
    spec = family_kind_spec(family, kind)
    ranges: dict[str, dict[str, Any]] = {
        number.name: {"min": number.low, "max": number.high, "integer": number.integer} for number in spec.numbers
    }
    side = {
        "min": limits.min_side,
        "max": limits.max_pixels // limits.min_side,
        "integer": True,
        "step": limits.multiple_of,
    }
    family_ranges = (
        ("width", side),
        ("height", side),
        ("steps", {"min": 1, "max": limits.max_steps}),
        (BATCH_PARAM, {"min": 1, "max": limits.max_batch}),
        ("frames", {"min": 1, "max": limits.max_frames}),
        ("seed", {"min": 0, "max": MAX_SEED}),
    )
    for name, bounds in family_ranges:
        if name in spec.params:
            ranges[name] = {"integer": True, **bounds}
    return {
        "params": [*spec.params, *spec.server_params],
        "inputs": list(spec.inputs),
        "defaults": dict(spec.defaults),
        "ranges": ranges,
    }
