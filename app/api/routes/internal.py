"""Internal API for workers, each authenticated by its machine's token (R1, R2, R19).

A worker never writes the journal or storage itself: it claims, reports progress,
uploads its result and reports failures here.
"""

from __future__ import annotations

import json
import logging
from typing import Annotated, Any

from anyio import to_thread
from fastapi import APIRouter, Depends, File, Form, Header, UploadFile
from fastapi.responses import FileResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from app.api.routes.deps import Context, WorkerMachine, job_of_machine, stored_file
from app.api.schemas import JobPublic, predicted_s
from app.api.strict_json import StrictJsonRoute, faults
from app.core.config import BrokerSettings
from app.core.errors import Conflict, NotFound, Rejected, Unauthorized
from app.core.kinds import ADAPTERS_PARAM
from app.core.protocol import (
    AdapterClaim,
    Claim,
    FailureReport,
    JoinGrant,
    JoinRequest,
    Manifests,
    ProgressReport,
    RevocationReceipt,
    Revocations,
)
from app.core.states import CANCELLED, OOM, JobState
from app.fleet.live import JoinTokens
from app.jobs.endings import Upload

router = APIRouter(prefix="/internal/v1", route_class=StrictJsonRoute)
log = logging.getLogger(__name__)


#: the join route's security scheme (its OpenAPI document): the join token, not a machine token
JOIN_TOKEN_SCHEME = HTTPBearer(
    scheme_name="JoinToken",
    auto_error=False,
    description="a join token of `homefleet machines add`: `Authorization: Bearer <token>`",
)


@router.post("/join", response_model=JoinGrant)
def join(
    body: JoinRequest,
    ctx: Context,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(JOIN_TOKEN_SCHEME)] = None,
) -> JoinGrant:
    """``homefleet worker join`` (docs/operations.md, "Add a machine"): a new host trades the
    single-use, expiring join token of ``homefleet machines add`` (``Authorization: Bearer
    <join token>``) for its machine's name, its own token and the broker settings. Its device
    (``body``) must be what the machine was registered with: the backend, and at least the
    registered memory; otherwise 409 ``device_mismatch`` and the join token stays unspent.
    401 ``join_token_unknown``, ``join_token_used``, ``join_token_expired`` or
    ``join_token_superseded`` (issued before the machine's token changed); 409
    ``machine_not_loaded`` while the running server has not yet reloaded the fleet file, or once the
    machine was removed."""
    token = credentials.credentials if credentials is not None else ""
    if not token.strip():
        raise Unauthorized(
            "a join needs 'Authorization: Bearer <join token>' (homefleet machines add prints it)",
            reason="join_token_unknown",
        )
    tokens = JoinTokens(ctx.redis, ctx.keys, ctx.settings.join_token_ttl_s)
    name = tokens.peek(token.strip())
    machine = ctx.fleet.machines.get(name)
    if machine is None:
        raise Conflict(
            f"machine {name!r} is not in the running server's fleet: removed since this join token was issued "
            f"(`homefleet machines add {name}` prints a new join command), or not loaded yet (the fleet file is "
            f"reloaded every {ctx.settings.fleet_watch_s} s, or on SIGHUP: retry)",
            reason="machine_not_loaded",
        )
    tokens.require_issued_for(token.strip(), machine.token)
    if body.backend != machine.backend or (body.memory_bytes and body.memory_bytes < machine.memory_bytes):
        raise Conflict(
            f"machine {name!r} was registered as {machine.backend} with {machine.memory_bytes} bytes, but "
            f"this host has {body.backend} with {body.memory_bytes} bytes; fix the host (e.g. install "
            f"the torch wheel for its device, docs/operations.md) or `homefleet machines remove {name}` "
            "and add it again as it is",
            reason="device_mismatch",
        )
    tokens.redeem(token.strip())
    broker = {field: getattr(ctx.settings, field) for field in BrokerSettings.model_fields}
    broker["redis_url"] = ctx.settings.worker_redis_url or ctx.settings.redis_url
    log.info("machine %s joined (%s, %d bytes)", name, body.backend, body.memory_bytes)
    return JoinGrant(
        machine=name,
        token=machine.token,
        backend=str(machine.backend),
        memory_bytes=machine.memory_bytes,
        families=sorted(machine.families),
        broker=broker,
    )


@router.get("/manifest", response_model=Manifests)
def manifest(ctx: Context, machine: WorkerMachine) -> Manifests:
    """Every registered model's manifest as REGISTERED (files, sizes, digests), for the worker's
    check (R4): no server file is read here. A worker's copy is verified against the registered
    digests whatever happened to the server's own copy (R5): a model whose server files changed
    or are gone stays advertised where a good copy is, while its submissions, claims and syncs
    are refused on the server (``model_changed``) and the server's own worker, which shares
    the server's folder, withdraws it. ``families``: those the asking machine's fleet entry
    supports, the models its worker counts as the ones it runs."""
    return Manifests(
        models={model.id: ctx.registry.registered_manifest(model.id) for model in ctx.registry.list()},
        families=sorted(machine.families),
    )


@router.get("/files/{file_id}", response_class=FileResponse)
def input_file(file_id: str, ctx: Context, machine: WorkerMachine) -> Response:
    """An uploaded input's bytes; the worker checks them against ``file_id`` (their digest)."""
    stored = ctx.inputs.get(file_id)
    return stored_file(stored.path, stored.media_type, stored.path.name, stored.digest)


@router.post("/jobs/{job_id}/claim", response_model=Claim)
def claim(
    job_id: str,
    ctx: Context,
    machine: WorkerMachine,
    x_homefleet_boot_id: Annotated[str | None, Header(max_length=64)] = None,
    x_homefleet_claim_id: Annotated[str | None, Header(max_length=64)] = None,
) -> Claim:
    """Atomic ``queued -> running`` (R19). 409 for any second delivery of the same job, and for
    a job whose model files on the server changed or are missing (it is then ``interrupted``,
    reason ``model_changed``, R5) or cannot be read (``model_unavailable``); nothing runs.
    ``X-Homefleet-Boot-Id`` names the claiming worker process (for reconciliation);
    ``X-Homefleet-Claim-Id`` names the delivery, so that delivery may safely repeat its claim."""
    queued = job_of_machine(ctx, job_id, machine)
    # The manifest first: a claim whose answer then failed would leave the job running with
    # nobody running it. A model whose files the server cannot read ends the job here.
    try:
        manifest = ctx.registry.manifest(queued.model_id)
        adapters = [
            AdapterClaim(manifest=ctx.registry.manifest(entry["id"]), scale=entry["scale"])
            for entry in queued.params.get(ADAPTERS_PARAM) or ()
        ]  # checked at submission
    except (Conflict, NotFound) as error:  # model_changed / model_unavailable, or no longer registered
        reason = error.reason if error.reason == "model_changed" else "model_unavailable"
        message = f"the server cannot hand model {queued.model_id!r} (or its adapters) out: {error}"
        ctx.endings.interrupt(
            job_id, [JobState.queued], reason, message, announce=True
        )  # the worker's task ends without a word (Ignore)
        log.error("job %s not run: %s", job_id, message)
        raise Conflict(f"job {job_id} was not run: {message}", reason=reason) from error
    job = ctx.endings.claim(job_id, machine.name, x_homefleet_boot_id, x_homefleet_claim_id)
    log.info("job %s claimed by %s (boot %s)", job_id, machine.name, x_homefleet_boot_id)
    return Claim(
        job_id=job.id,
        model_id=job.model_id,
        kind=job.kind,
        params=job.params,
        manifest=manifest,
        working_bytes=job.working_bytes,
        adapters=adapters,
    )


@router.post("/revocations", response_model=RevocationReceipt)
def revocations(body: Revocations, ctx: Context, machine: WorkerMachine) -> RevocationReceipt:
    """C11: job ids whose tasks this machine's worker saw revoked (Flower, ``celery control
    revoke [--terminate]``). A queued job of this machine ends ``cancelled`` (reason
    ``revoked``), a running one whose pool process Celery killed ``interrupted`` (reason
    ``terminated``), each with its reservation released; the rest is left as it is
    (:meth:`app.jobs.dispatch.Dispatcher.revoked`)."""
    ended = ctx.dispatcher.revoked(machine.name, body.job_ids, body.terminated, body.announced)
    return RevocationReceipt(ended={job_id: str(state) for job_id, state in ended.items()})


@router.post("/jobs/{job_id}/progress", status_code=204)
def progress(job_id: str, body: ProgressReport, ctx: Context, machine: WorkerMachine) -> None:
    """A running job's step (204). 409 ``not_running`` for a job that is not running (queued, or
    ended: its progress is over and is not recorded); 403 for another machine's job."""
    job = job_of_machine(ctx, job_id, machine)
    if job.state != JobState.running:
        raise Conflict(f"job {job_id} is {job.state}; progress is taken only while it runs", reason="not_running")
    ctx.progress.report(job_id, body.step, body.total, body.text, body.tokens, body.logprobs)


@router.post("/jobs/{job_id}/result", response_model=JobPublic)
async def upload_result(
    job_id: str,
    ctx: Context,
    machine: WorkerMachine,
    file: Annotated[UploadFile, File(description="the result's bytes")],
    digest: Annotated[str, Form(description="'blake3:<hex>' of the bytes")],
    load_s: Annotated[float, Form(ge=0, allow_inf_nan=False)],
    run_s: Annotated[float, Form(ge=0, allow_inf_nan=False)],
    cold_load: Annotated[bool, Form()],
    provenance: Annotated[str, Form(description="JSON object: the result's provenance")] = "{}",
    more: Annotated[list[UploadFile] | None, File(description="images 2..n of a job with n > 1, in order")] = None,
    more_digests: Annotated[str, Form(description="JSON list: 'blake3:<hex>' of each `more` file")] = "[]",
) -> JobPublic:
    """Verify and store a result (R2); only then the job is ``succeeded``. A job no longer
    running (interrupted or ended meanwhile) gets 409 and nothing is stored. A mismatch of
    digest, media type or size stores nothing and fails the job with reason ``integrity``.
    The worker's provenance is journaled with the server's own figures added (job id,
    predicted and actual seconds).

    Full disk: 507 ``storage_full`` naming what could not be stored; the job stays
    running and the worker retries. The upload is idempotent by digest: the same result for a
    job it already made ``succeeded`` answers that job again. A job that failed
    ``result_not_stored`` takes its result later (``homefleet results recover``): it becomes
    ``succeeded``; it never ran twice.

    A job with ``n`` > 1 images sends images 2..n as ``more`` with their digests in
    ``more_digests``, in the same request: exactly n - 1 of them (else 422 ``invalid_results``,
    nothing stored), each verified like the first; the job's ``results`` lists all n in order,
    image i with seed ``seed + i``."""
    job = job_of_machine(ctx, job_id, machine)

    def record() -> dict[str, Any]:  # parsed once the job is known to take a result
        try:
            parsed = json.loads(provenance)
        except ValueError as error:
            raise Rejected(f"provenance must be a JSON object: {error}", reason="invalid_provenance") from error
        if (fault := next(faults(parsed), None)) is not None:  # NaN, 1e999, a lone surrogate: not storable
            raise Rejected(f"provenance.{'.'.join(map(str, fault[0]))}: {fault[1]}", reason="invalid_provenance")
        if not isinstance(parsed, dict):
            raise Rejected(
                f"provenance must be a JSON object, got {type(parsed).__name__}", reason="invalid_provenance"
            )
        return parsed

    limit = ctx.settings.max_result_bytes + 1  # no more than one byte past the limit into memory
    upload = Upload(
        await file.read(limit),
        digest,
        [await extra.read(limit) for extra in more or []],
        more_digests,
        load_s,
        run_s,
        cold_load,
        record,
    )
    # decoding may take a while (ffmpeg): in a thread
    return JobPublic.from_job(await to_thread.run_sync(ctx.endings.result, job, machine.name, upload, predicted_s(job)))


@router.post("/jobs/{job_id}/failure", response_model=JobPublic)
def report_failure(job_id: str, body: FailureReport, ctx: Context, machine: WorkerMachine) -> JobPublic:
    """End a running job ``failed`` with the worker's reason (``cancelled`` when its cancel was
    asked). An ``oom`` first remembers the job's size on this machine (R21), priced as placement
    priced it (``Validator.placed_request``: pixels x frames x batch; a text job's prompt tokens,
    never 0). 409 for a job that is not running; 403 for another machine's job."""
    running = job_of_machine(ctx, job_id, machine)
    if body.reason == OOM and running.state == JobState.running:
        # R21: remember the size that ran out of memory before the job ends, so that a server
        # killed between the two writes cannot forget it (C08: the refusal must outlive a crash)
        validator = ctx.dispatcher.validator
        size = validator.placed_request(running.model_id, running.kind, machine.name, running.params).size
        ctx.residency.record_oom(machine.name, running.model_id, running.kind, size, running.id)
    if body.reason == CANCELLED and ctx.redis.exists(ctx.keys.cancel(job_id)):
        # stopped between steps by request (POST /v1/jobs/{id}/cancel): cancelled, not failed
        return JobPublic.from_job(ctx.endings.cancel_running(job_id, machine.name, body.message))
    job = ctx.endings.fail(job_id, machine.name, body.reason, body.message, load_s=body.load_s, run_s=body.run_s)
    return JobPublic.from_job(job)
