"""The Celery task ``homefleet.run_job``: claim, verify, load, run, upload (DESIGN §9 step 4).

The claim comes first, before anything else: a second delivery of the same job id (broker
redelivery after the visibility timeout, a duplicate publish) is refused by the server's
journal and changes nothing (R19, C01).
"""

from __future__ import annotations

import json
import logging
import platform
import time
from typing import Any

from app.digest import bytes_digest
from app.errors import HomefleetError, IntegrityFailure
from app.fleet import SERVER
from tasks import runtime
from tasks.kinds import runner
from tasks.verify import model_problems

log = logging.getLogger("homefleet.worker")


def manifest_key(manifest: dict[str, Any]) -> str:
    """Digest of a manifest's file list: a resident model is reused only under the same key."""
    return bytes_digest(json.dumps(manifest["files"], sort_keys=True).encode())


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


def run_job(job_id: str) -> None:
    rt = runtime.current()
    settings = rt.settings
    try:
        claim = rt.server.claim(job_id)
    except HomefleetError as refusal:
        log.warning("job %s: delivery refused at claim (%s: %s); nothing run", job_id, refusal.reason, refusal.message)
        return
    model_id, kind, params, manifest = claim["model_id"], claim["kind"], claim["params"], claim["manifest"]
    log.info("job %s claimed: %s %s", job_id, kind, model_id)

    load_s = run_s = 0.0
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
        pipeline, load_s, cold = rt.cache.get(model_id, key, settings.models_dir / model_id)
        if cold:
            rt.record_warm()
        provenance = {
            "job_id": job_id, "model_id": model_id, "kind": kind, "params": params, "machine": settings.machine,
            "host": platform.node(), "files": {f["path"]: f["digest"] for f in manifest["files"]},
        }
        started = time.perf_counter()
        output = runner(kind)(pipeline, params, lambda step, total: rt.server.progress(job_id, step, total), provenance)
        run_s = time.perf_counter() - started
    except Exception as error:  # every failure is reported to the journal with its reason; nothing is lost
        reason = error.reason if isinstance(error, HomefleetError) else failure_reason(error)
        log.exception("job %s failed (%s)", job_id, reason)
        rt.server.fail(job_id, reason, f"{type(error).__name__}: {error}", load_s=load_s, run_s=run_s)
        return

    digest = bytes_digest(output.data)
    try:
        rt.server.upload(job_id, output.data, output.media_type, digest, load_s=load_s, run_s=run_s, cold_load=cold)
    except HomefleetError as refusal:
        log.error("job %s: the server refused the result (%s: %s)", job_id, refusal.reason, refusal.message)
        return
    log.info("job %s succeeded: %s (%d bytes), load %.2f s, run %.2f s", job_id, digest, len(output.data), load_s, run_s)
