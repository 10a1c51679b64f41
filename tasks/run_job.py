"""The Celery task ``homefleet.run_job``: claim, verify, load, run, upload (DESIGN §9 step 4).

The claim comes first, before anything else: a second delivery of the same job id (broker
redelivery after the visibility timeout, a duplicate publish) is refused by the server's
journal and changes nothing (R19, C01).
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

from app.core.digest import bytes_digest
from app.core.errors import HomefleetError, IntegrityFailure
from app.fleet.config import SERVER
from app.core.kinds import input_fields
from app.core.variants import Variant, parameter_counts, weights_bytes
from routing.estimate import working_bytes
from routing.placement import JobRequest
from tasks import runtime
from tasks.heartbeat import mark_working
from tasks.kinds import runner
from tasks.provenance import embedded_provenance
from tasks.verify import model_problems

log = logging.getLogger("homefleet.worker")


def manifest_key(manifest: dict[str, Any]) -> str:
    """Digest of a manifest's file list and variant (precision, quantization): a resident
    model is reused only under the same key (R5; a bf16 copy is not the fp32 one)."""
    variant = {"precision": manifest.get("precision", "fp32"), "quantization": manifest.get("quantization")}
    return bytes_digest(json.dumps({"files": manifest["files"], **variant}, sort_keys=True).encode())


def job_memory(folder: Path, kind: str, params: dict[str, Any], variant: dict[str, Any],
               working: int | None = None) -> tuple[int, int]:
    """(weights bytes, working bytes) of a job: weights from the safetensors headers at the
    variant's precision (app.core.variants); working memory as the server estimated it with the
    fleet config's coefficients (``working``, from the claim), else by kind and size with the
    embedded defaults (routing.estimate)."""
    weights = weights_bytes(parameter_counts(folder), Variant(variant["precision"], variant["quantization"]))
    if working is not None:
        return weights, working
    request = JobRequest.from_params("", "", kind, "", params)
    return weights, working_bytes(kind, request.size)


def failure_reason(error: BaseException) -> str:
    """Reason code for a failed job: ``oom`` for out-of-memory errors, else ``error``.

    OOM texts from shared/notes/diffusers-offline.md ("OOM classification").
    """
    if type(error).__name__ == "OutOfMemoryError":
        return "oom"
    text = str(error)
    if any(s in text for s in ("MPS backend out of memory", "CUDA error: out of memory", "can't allocate memory")):
        return "oom"
    return "error"


def report_progress(job_id: str, step: int, total: int) -> None:
    """Best effort: a progress report that cannot reach the server is logged, never fatal."""
    try:
        runtime.current().server.progress(job_id, step, total)
    except (HomefleetError, httpx.HTTPError) as error:
        log.warning("job %s: progress %d/%d not reported: %s", job_id, step, total, error)


WAIT_REPORT_S = 30.0
"""While a claimed job waits for the start-up preload (R16), a progress report (step 0) this
often, in seconds: the server's hung bound (``hung_after_s``) is minutes."""


def run_job(job_id: str) -> None:
    """The task: claims the job, waits for the start-up preload of committed models (R16) if
    one is loading, then runs it (:func:`run_claimed`).

    The claim comes first: the message left the queue when it was delivered (early ack), so a
    job waiting unclaimed would be ``queued`` with no message anywhere, and reconciliation
    would end it as ``lost`` (R19) while the preload ran. Claimed, it is ``running`` and waits
    with progress reports.
    """
    rt = runtime.current()
    try:
        claim = rt.server.claim(job_id, claim_id=uuid.uuid4().hex)
    except HomefleetError as refusal:
        log.warning("job %s: delivery refused at claim (%s: %s); nothing run", job_id, refusal.reason, refusal.message)
        return
    lock = rt.cache_lock
    while not lock.acquire(timeout=WAIT_REPORT_S):
        log.info("job %s waits for the start-up preload of committed models", job_id)
        report_progress(job_id, 0, max(1, int(claim["params"].get("steps", 1))))
    try:
        mark_working(rt.redis, rt.keys, rt.settings.machine, job_id)  # a kill from here on is this job's (R21)
        run_claimed(rt, job_id, claim)
    finally:
        lock.release()


def run_claimed(rt: runtime.WorkerRuntime, job_id: str, claim: dict[str, Any]) -> None:
    """Verify, load, run, upload a claimed job (DESIGN §9 step 4; ``claim``: the server's
    answer to its claim); every failure is reported to the server."""
    settings = rt.settings
    model_id, kind, params, manifest = claim["model_id"], claim["kind"], claim["params"], claim["manifest"]
    log.info("job %s claimed: %s %s", job_id, kind, model_id)

    # None until measured: a failure reports only the times that were taken (a run cut short
    # has no run time), so the server never learns a timing from a job that did not run (R13).
    load_s: float | None = None
    run_s: float | None = None
    cold = False
    try:
        # R5: the claim carries the server's CURRENT digests. A resident model is reused only
        # if it was verified against exactly these (its recorded key); otherwise every file
        # is hashed here, before anything is loaded, and a mismatch withdraws the model.
        key = manifest_key(manifest)
        if settings.machine != SERVER and not rt.cache.is_warm(model_id, key):
            problems = model_problems(settings.models_dir, manifest)
            if problems:
                rt.withdraw(model_id)
                raise IntegrityFailure(f"model {model_id} on {settings.machine} does not match the manifest "
                                       f"(withdrawn until `homefleet sync {settings.machine} {model_id}`): "
                                       + "; ".join(problems[:5]))
        # Inputs come from the server over HTTP, checked against their digest (never its folders).
        inputs = {field: rt.server.input_file(params[field]) for field in input_fields(kind)}
        variant = {"precision": manifest.get("precision", "fp32"), "quantization": manifest.get("quantization")}
        rt.cache.protected = rt.commitments()  # R16: unchanged while work is queued; re-read per job
        if kind == "video" and (dropped := rt.cache.unload_unprotected(keep=model_id)):  # R17
            log.info("job %s: video needs the memory; unloaded warm models %s", job_id, ", ".join(dropped))
            rt.record_warm()
        folder = settings.models_dir / model_id
        memory = job_memory(folder, kind, params, variant, claim.get("working_bytes"))
        pipeline, load_s, cold = rt.cache.get(model_id, key, folder, variant, *memory)
        if cold:
            rt.record_warm()
        provenance = embedded_provenance(
            model_id=model_id, manifest=manifest, kind=kind, params=params,
            inputs={field: params[field] for field in inputs}, machine=settings.machine, device=_device(),
        )
        started = time.perf_counter()
        output = runner(kind)(pipeline, params, lambda step, total: report_progress(job_id, step, total), provenance,
                              inputs)
        run_s = time.perf_counter() - started
    except Exception as error:  # every failure is reported to the journal with its reason; nothing is lost
        reason = error.reason if isinstance(error, HomefleetError) else failure_reason(error)
        log.exception("job %s failed (%s)", job_id, reason)
        rt.server.fail(job_id, reason, f"{type(error).__name__}: {error}", load_s=load_s, run_s=run_s)
        return

    digest = bytes_digest(output.data)
    try:
        rt.server.upload(job_id, output.data, output.media_type, digest, load_s=load_s or 0.0, run_s=run_s, cold_load=cold,
                         provenance=provenance)
    except (HomefleetError, httpx.HTTPError) as refusal:
        log.error("job %s: the server did not take the result: %s", job_id, refusal)
        return
    log.info("job %s succeeded: %s (%d bytes), load %.2f s, run %.2f s", job_id, digest, len(output.data), load_s or 0.0,
             run_s)


def _device() -> str:
    """This worker's device: ``cuda``, ``mps`` or ``cpu`` (as its heartbeat reports it)."""
    from tasks.worker import detect_device

    return detect_device()
