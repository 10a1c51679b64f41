"""The Celery task ``homefleet.run_job``: claim, verify, load, run, upload (a job's way, step 4).

The claim comes first, before anything else: a second delivery of the same job id (broker
redelivery after the visibility timeout, a duplicate publish) is refused by the server's
journal and changes nothing (R19, C01).
"""

from __future__ import annotations

import errno
import gc
import logging
import os
import signal
import time
import traceback
import uuid
from pathlib import Path
from typing import Any, NoReturn

import httpx
import redis
from celery.exceptions import Ignore

from app.core.digest import bytes_digest
from app.core.errors import Conflict, HomefleetError, Unauthorized
from app.core.kinds import job_request, spec
from app.core.protocol import Claim
from app.core.states import CANCELLED, OOM, RESULT_NOT_STORED
from residency.errors import ResidencyRefused
from routing.estimate import working_bytes
from tasks import runtime
from tasks.adapters import adapters_applied, provenance_entries
from tasks.heartbeat import refused_at_start
from tasks.kinds import runner
from tasks.loading import make_resident
from tasks.provenance import embedded_provenance
from tasks.spool import ResultSpool, Spooled, retriable, upload_with_retries
from tasks.watchdog import mark_working

log = logging.getLogger("homefleet.worker")

OOM_TEXTS = ("MPS backend out of memory", "CUDA error: out of memory", "can't allocate memory")
"""How out-of-memory errors read when torch raises them as a plain RuntimeError (MPS; some
CUDA allocations; the CPU allocator), checked on torch 2.13."""
OOM_WHOLE_TEXTS = ("could not create a primitive",)
"""Out-of-memory errors known by their whole text: oneDNN's, when a CPU convolution cannot allocate
its buffers (seen under an address-space limit, ``prlimit --as``). Its unsupported-configuration
error reads "could not create a primitive descriptor ...", which is no OOM."""


class JobNotSucceeded(Exception):
    """Raised by the task once its own report ended the job ``failed`` (or the server refused
    its result), so that Celery reports the task FAILURE (a ``task-failed`` event: Flower agrees
    with the journal). Never retried: the message was acked at start, the task has no
    retries (R8, R19). Listed in the task's ``throws``: logged as expected, without a traceback."""

    def __init__(self, job_id: str, reason: str, message: str) -> None:
        super().__init__(job_id, reason, message)  # every argument: it crosses to Celery's main process
        self.job_id, self.reason, self.message = job_id, reason, message

    def __str__(self) -> str:
        return f"job {self.job_id} failed ({self.reason}): {self.message}"


class JobCancelled(Exception):
    """Raised from a step's progress report when the job's cancel was asked (``Keys.cancel``,
    ``POST /v1/jobs/{id}/cancel``): the pipeline stops between steps and the job is reported
    with reason ``cancelled``; the server ends it ``cancelled``."""

    def __init__(self, job_id: str, step: int, total: int) -> None:
        super().__init__(job_id, step, total)
        self.job_id, self.step, self.total = job_id, step, total

    def __str__(self) -> str:
        return f"cancelled by request while running, after {self.step} of {self.total} steps"


class TokenRefused(Exception):
    """Raised when the server refuses this worker's token (401) while it runs a job, at a
    progress report (``what``): its machine's token was rotated (``homefleet machines
    rotate-token``) or the machine removed. Nothing the run makes could be reported, so it stops
    (:func:`token_refused_while_running`)."""

    def __init__(self, job_id: str, refusal: Unauthorized, what: str) -> None:
        super().__init__(job_id, refusal.message, what)
        self.job_id, self.refusal, self.what = job_id, refusal, what

    def __str__(self) -> str:
        return f"the server refused this worker's token at its {self.what}: {self.refusal.message}"


def failure_reason(error: BaseException) -> str:
    """Reason code for a failed job: its own reason for Homefleet's and residency's refusals,
    ``oom`` for out-of-memory errors (``torch.OutOfMemoryError``, one of :data:`OOM_TEXTS` or
    :data:`OOM_WHOLE_TEXTS`),
    else ``error``."""
    if isinstance(error, HomefleetError | ResidencyRefused):
        return error.reason
    if isinstance(error, JobCancelled):
        return CANCELLED
    if type(error).__name__ == "OutOfMemoryError":
        return OOM
    text = str(error)
    return OOM if any(known in text for known in OOM_TEXTS) or text in OOM_WHOLE_TEXTS else "error"


PROGRESS_EVERY_S = 0.1
"""The least time between two progress reports of a running job to the server, in seconds (at
most ten a second). A small text model's token or a tiny pipeline's step takes milliseconds,
and each report is an HTTP request that the server journals to Redis and wakes its followers
for: reported at every step, a 400-token text job made 400 requests, whose bodies (the text
and tokens so far) grew with every token. A follower (SSE, the fleet page) reads the newest
report; a text stream still sends each token (app/api/routes/tgi.py). The first step and the
last (``step == total``) are always reported; the cancel flag is read at every step."""


def report_progress(
    job_id: str,
    step: int,
    total: int,
    text: str | None = None,
    tokens: list[int] | None = None,
    logprobs: list[float] | None = None,
) -> None:
    """Report a step to the server, then stop the run if its cancel was asked
    (:func:`stop_if_cancelled`). Best effort: a report that cannot reach the server is logged,
    never fatal. ``text``, ``tokens``, ``logprobs``: a text job's text, token ids and their log
    probabilities so far.

    Raises:
        JobCancelled: the job's cancel was asked: the run stops here, between steps.
        TokenRefused: the server refused this worker's token (401): the run stops here too.
    """
    rt = runtime.current()
    try:
        rt.server.progress(job_id, step, total, text, tokens, logprobs)
    except Unauthorized as refusal:  # the token was rotated: nothing this run makes can be reported
        raise TokenRefused(job_id, refusal, "progress report") from refusal
    except (HomefleetError, httpx.HTTPError) as error:
        log.warning("job %s: progress %d/%d not reported: %s", job_id, step, total, error)
    stop_if_cancelled(job_id, step, total)


def stop_if_cancelled(job_id: str, step: int, total: int) -> None:
    """Read the job's cancel flag (``Keys.cancel``); a flag that cannot be read is logged.

    Raises:
        JobCancelled: the job's cancel was asked: the run stops here, between steps.
    """
    rt = runtime.current()
    try:
        cancelled = rt.redis.exists(rt.keys.cancel(job_id))
    except redis.RedisError as error:
        log.warning("job %s: its cancel flag not read: %s", job_id, error)
        return
    if cancelled:
        log.warning("job %s: cancelled by request; stopping after step %d of %d", job_id, step, total)
        raise JobCancelled(job_id, step, total)


class ProgressReports:
    """A running job's progress function (``tasks.kinds.ProgressFn``): each step is reported
    (:func:`report_progress`) when it is the first, the last (``step >= total``) or
    ``every_s`` seconds (:data:`PROGRESS_EVERY_S`) or more after the last report; every step
    reads the cancel flag.

    Raises (when called):
        JobCancelled: the job's cancel was asked.
    """

    def __init__(self, job_id: str, every_s: float = PROGRESS_EVERY_S) -> None:
        self.job_id, self.every_s = job_id, every_s
        self.reported_at: float | None = None  # time.monotonic() of the last report
        self.reported = 0  # reports sent

    def __call__(
        self,
        step: int,
        total: int,
        text: str | None = None,
        tokens: list[int] | None = None,
        logprobs: list[float] | None = None,
    ) -> None:
        now = time.monotonic()
        if self.reported_at is None or step >= total or now - self.reported_at >= self.every_s:
            self.reported_at, self.reported = now, self.reported + 1
            report_progress(self.job_id, step, total, text, tokens, logprobs)
        else:
            stop_if_cancelled(self.job_id, step, total)


WAIT_REPORT_S = 30.0
"""While a claimed job waits for the start-up preload (R16), a progress report (step 0) this
often, in seconds: the server's hung bound (``hung_after_s``) is minutes."""


def run_job(job_id: str) -> None:
    """The task: claims the job, waits for the start-up preload of committed models (R16) if
    one is loading, then runs it (:func:`run_claimed`).

    The task's outcome is the job's (Flower's states agree with the journal): it
    returns when the job succeeded, raises :class:`JobNotSucceeded` when its report failed the
    job, and raises Celery's ``Ignore`` (no outcome event) when the job's end is not this
    delivery's: a refused claim, a job the server ended meanwhile (its event is the server's,
    app/jobs/task_events.py).

    The claim comes first: the message left the queue when it was delivered (early ack), so a
    job waiting unclaimed would be ``queued`` with no message anywhere, and reconciliation
    would end it as ``lost`` (R19) while the preload ran. Claimed, it is ``running`` and waits
    with progress reports.
    """
    rt = runtime.current()
    try:
        claim = rt.server.claim(job_id, claim_id=uuid.uuid4().hex)
    except Unauthorized as refusal:
        token_refused_at_claim(rt, job_id, refusal)
    except HomefleetError as refusal:
        log.warning("job %s: delivery refused at claim (%s: %s); nothing run", job_id, refusal.reason, refusal.message)
        # No outcome of this delivery's own: the journal's state (and the event told of it by
        # the delivery that ran it, or by the server) stands in Flower, not a SUCCESS.
        raise Ignore() from refusal
    lock = rt.cache_lock
    while not lock.acquire(timeout=WAIT_REPORT_S):
        log.info("job %s waits for the start-up preload of committed models", job_id)
        try:
            report_progress(job_id, 0, max(1, int(claim.params.get("steps", 1))))
        except (JobCancelled, TokenRefused) as stopped:  # cancelled (or the token refused) while it waited
            report_failure(rt, job_id, stopped, None, None)
    try:
        try:
            mark_working(rt.redis, rt.keys, rt.settings.machine, job_id)  # a kill from here on is this job's (R21)
        except redis.RedisError as error:  # Redis gone longer than the client rides out: claimed, so reported (R19)
            report_failure(rt, job_id, error, None, None)
        run_claimed(rt, claim)
    finally:
        lock.release()


TOKEN_REFUSED_TTL_S = 24 * 3600
"""How long a job's ``Keys.token_refused`` mark is kept, in seconds (as ``Keys.delivered``'s)."""


def token_refused_at_claim(rt: runtime.WorkerRuntime, job_id: str, refusal: Unauthorized) -> NoReturn:
    """The server refused this worker's token at a claim (401: the machine's token was rotated,
    ``homefleet machines rotate-token``, or the machine removed). The refused claim changed
    nothing: the job is still ``queued`` and never ran. This worker stops taking jobs at once
    (its parent is told with SIGTERM: Celery's warm shutdown, then exit ``EX_CONFIG``, 78, as for
    a token refused at start, with the same log line), so its machine goes offline; the job is
    marked ``Keys.token_refused`` for reconciliation, which publishes it again to the machine's
    queue in journal order (R8) for the worker started with the new token. At most once holds:
    only a journaled claim runs a job (R19).

    Raises:
        Ignore: always; the delivery has no outcome of its own.
    """
    machine = rt.settings.machine
    rt.refuse_token()
    os.kill(os.getppid(), signal.SIGTERM)  # the parent stops consuming before this task returns
    log.critical("%s", refused_at_start(machine, refusal))
    words = f"its claim by {machine}'s worker was refused: the server refused that worker's token ({refusal.message})"
    try:
        rt.redis.set(rt.keys.token_refused(job_id), words, ex=TOKEN_REFUSED_TTL_S)
    except redis.RedisError as error:  # then reconciliation ends it lost, and says so
        log.error("job %s: its refused claim not recorded (%s); reconciliation will end it lost", job_id, error)
    raise Ignore() from refusal


def token_refused_while_running(rt: runtime.WorkerRuntime, job_id: str, refusal: Unauthorized, what: str) -> NoReturn:
    """The server refused this worker's token (401) at a call about a running job (``what``: its
    progress report, failure report or result upload): the machine's token was rotated or the
    machine removed. Nothing this run makes can reach the server, so the run stops (a result is
    not kept: the server ends the job, ``homefleet machines rotate-token`` at once), this worker
    stops taking jobs and exits ``EX_CONFIG`` (78) as at a refused claim, and the job is marked
    ``Keys.token_refused`` with these words, which reconciliation journals if it ends the job
    (the token was changed by hand, not through the CLI). Never run again by itself (R19).

    Raises:
        Ignore: always; the delivery has no outcome of its own (the server's ending stands).
    """
    machine = rt.settings.machine
    if not rt.token_refused:  # the first refusal of this worker stops it (once)
        rt.refuse_token()
        os.kill(os.getppid(), signal.SIGTERM)
        log.critical("%s", refused_at_start(machine, refusal))
    words = (
        f"{machine}'s worker stopped the job: the server refused that worker's token at its {what} ({refusal.message})"
    )
    log.error("job %s: %s; nothing more of it is run or reported", job_id, words)
    try:
        rt.redis.set(rt.keys.token_refused(job_id), words, ex=TOKEN_REFUSED_TTL_S)
    except redis.RedisError as error:
        log.error("job %s: its refused token not recorded (%s)", job_id, error)
    raise Ignore() from refusal


def run_claimed(rt: runtime.WorkerRuntime, claim: Claim) -> None:
    """Verify, load, run, upload a claimed job; every failure is reported to the server.

    1. fetch its inputs from the server, checked against their digests (never its folders);
    2. make room by the residency rules: the machine's commitments (R16), a video's memory (R17);
    3. make the model resident (``tasks/loading.py``: verify R5, load R15);
    4. run the kind's pipeline with progress reports (:class:`ProgressReports`), its LoRA adapters loaded onto the warm
       pipeline for the run and unloaded after it (``tasks/adapters.py``);
    5. upload the result with its digest and provenance (R2).
    """
    job_id, model_id, kind, params = claim.job_id, claim.model_id, claim.kind, claim.params
    log.info("job %s claimed: %s %s", job_id, kind, model_id)
    # None until measured: a failure reports only the times that were taken (a run cut short
    # has no run time), so the server never learns a timing from a job that did not run (R13).
    load_s: float | None = None
    run_s: float | None = None
    cold = False
    try:
        # 1. Inputs, by digest.
        inputs = {field: rt.server.input_file(params[field]) for field in spec(kind).inputs}
        # 2. Residency rules.
        rt.cache.protected = rt.commitments()  # R16: unchanged while work is queued; re-read per job
        if kind == "video" and (dropped := rt.cache.unload_unprotected(keep=model_id)):  # R17
            log.info("job %s: video needs the memory; unloaded warm models %s", job_id, ", ".join(dropped))
            rt.record_warm()
        # 3. Resident, verified.
        working = claim.working_bytes
        if working is None:  # the server's estimate, else the embedded coefficients by kind and size
            working = working_bytes(kind, job_request(model_id, "", kind, "", params).size)
        loaded = make_resident(rt, claim.manifest, working)
        load_s, cold = loaded.load_s, loaded.cold
        provenance = embedded_provenance(
            model_id=model_id,
            manifest=claim.manifest,
            kind=kind,
            params=params,
            inputs={field: params[field] for field in inputs},
            machine=rt.settings.machine,
            device=rt.device().name,
            adapters=provenance_entries(claim.adapters),
            sampler=scheduler_name(loaded.pipeline),
        )
        # 4. Run, with the job's adapters on the warm pipeline.
        with adapters_applied(rt, model_id, loaded.pipeline, claim.adapters) as applied:
            started = time.perf_counter()
            output = runner(kind)(
                loaded.pipeline,
                params,
                ProgressReports(job_id),
                provenance,
                inputs,
                family=claim.manifest.family,
            )
            run_s = time.perf_counter() - started
        provenance = {**provenance, **output.record, **applied.record}  # journaled only (token counts, adapter load)
    except Exception as error:  # noqa: BLE001 (reported, logged with its traceback) every failure reaches the journal
        report_failure(rt, job_id, error, load_s, run_s)
    # 5. Upload; a result the server cannot store yet is spooled and retried (tasks/spool.py).
    digest = bytes_digest(output.data)
    try:
        more = [(extra, bytes_digest(extra)) for extra in output.more]  # images 2..n
        upload_result(rt, job_id, output.data, output.media_type, digest, load_s or 0.0, run_s, cold, provenance, more)
    except Unauthorized as refusal:
        token_refused_while_running(rt, job_id, refusal, "result upload")
    except (Conflict, httpx.HTTPError) as refusal:
        # Not running any more (the server ended it meanwhile, and said so), or not reported
        # (reconciliation ends it, and says so): no outcome of this task's own.
        log.error("job %s: the server did not take the result: %s", job_id, refusal)
        raise Ignore() from refusal
    except HomefleetError as refusal:  # refused (integrity): the server failed the job
        log.error("job %s: the server did not take the result: %s", job_id, refusal)
        raise JobNotSucceeded(job_id, refusal.reason or "result_refused", refusal.message) from refusal
    except JobNotSucceeded:
        raise
    except Exception as error:  # noqa: BLE001 (reported, logged) never a job left running with nobody running it
        report_failure(rt, job_id, error, load_s, run_s)
    log.info(
        "job %s succeeded: %s (%d bytes), load %.2f s, run %.2f s",
        job_id,
        digest,
        len(output.data),
        load_s or 0.0,
        run_s,
    )


def scheduler_name(pipeline: Any) -> str | None:
    """The class name of a diffusers pipeline's scheduler (``EulerDiscreteScheduler``), or None
    for a pipeline without one (text)."""
    scheduler = getattr(pipeline, "scheduler", None)
    return type(scheduler).__name__ if scheduler is not None else None


def report_failure(
    rt: runtime.WorkerRuntime, job_id: str, error: Exception, load_s: float | None, run_s: float | None
) -> NoReturn:
    """Report ``error`` as the job's failure (its :func:`failure_reason`, its type and text) and
    end the task: :class:`JobNotSucceeded` once the server took it, Celery's ``Ignore`` when the
    server had ended the job meanwhile or cannot be reached (reconciliation ends it, R19)."""
    if isinstance(error, TokenRefused):
        token_refused_while_running(rt, job_id, error.refusal, error.what)
    reason = failure_reason(error)
    message = str(error) if reason == CANCELLED else f"{type(error).__name__}: {error}"
    if reason == CANCELLED:
        log.warning("job %s: %s", job_id, message)
    else:
        log.error("job %s failed (%s)", job_id, reason, exc_info=error)
    if reason == OOM:
        release_failed_run(error)
    try:
        rt.server.fail(job_id, reason, message, load_s=load_s, run_s=run_s)
    except Unauthorized as refusal:
        token_refused_while_running(rt, job_id, refusal, "failure report")
    except Conflict as refusal:  # the server had ended it meanwhile (e.g. terminated, hung)
        log.warning("job %s: failure not taken, the job had ended: %s", job_id, refusal.message)
        raise Ignore() from error
    except httpx.HTTPError as lost:  # still running in the journal: reconciliation ends it, and says so
        log.error("job %s: failure not reported, the server is unreachable: %s", job_id, lost)
        raise Ignore() from error
    if reason == CANCELLED:  # the server ended it cancelled and told Flower (task-revoked): no outcome of ours
        raise Ignore() from error
    raise JobNotSucceeded(job_id, reason, message) from error


def release_failed_run(error: BaseException) -> None:
    """Free what a run that ran out of memory still holds before this pool process takes its
    next job (R21: a smaller job still runs on the machine). The error's traceback keeps the
    failed forward pass's frames, and their locals keep its tensors (hundreds of MB for a large
    image), alive for as long as the exception is referenced: Celery keeps it with the task's
    outcome. Once the error is logged its frames' locals are cleared (those still running are
    skipped, :func:`traceback.clear_frames`) and the cycles through them collected."""
    traceback.clear_frames(error.__traceback__)
    gc.collect()


def upload_result(
    rt: runtime.WorkerRuntime,
    job_id: str,
    data: bytes,
    media_type: str,
    digest: str,
    load_s: float,
    run_s: float,
    cold: bool,
    provenance: dict[str, Any],
    more: list[tuple[bytes, str]] | None = None,
) -> None:
    """Upload the result (R2). While the server cannot store it (507 ``storage_full``, 5xx) the
    bytes are kept in the worker's spool and the upload is retried with backoff; when the
    retries are spent the job is reported ``failed`` with reason ``result_not_stored`` naming
    the spooled file, which stays for ``homefleet results recover``.

    When the spool cannot keep them either (its disk full: ``ENOSPC``, ``EDQUOT``, ``EFBIG``, or
    any other ``OSError``) the bytes stay in this task's memory only: the spool write is tried
    again at each refused attempt, the upload retried the same bounded number of times
    (``result_upload_attempts``, pausing ``result_retry_s`` seconds then twice as long each
    time: 4 attempts over 7 s by default), and if both still refuse the job is reported
    ``failed`` ``result_not_stored`` at once, the message naming the server's refusal and the
    spool's error (the result is lost; nothing is left for ``results recover``).

    A spooled result is brought in later by the worker's :class:`tasks.spool.SpoolRecovery`
    (every ``result_recover_interval_s``) or by ``homefleet results recover``.

    Raises:
        JobNotSucceeded: the retries were spent (the job is failed ``result_not_stored``).
        Conflict, httpx.HTTPError, HomefleetError: as ``ServerClient.upload``; a spooled copy
            is then removed, except after a transport error: a server unreachable past its
            client's retries (``server_retry_s``) may still take it, so the result stays in
            the spool.
    """
    settings = rt.settings
    spool = ResultSpool(settings.result_spool)
    kept: Path | None = None
    spool_error: OSError | None = None  # the spool's last refusal while nothing is kept

    def keep(why: str) -> None:
        """Keep the result in the spool (once), logging ``why`` the server did not take it."""
        nonlocal kept, spool_error
        try:
            kept = spool.keep(
                Spooled(
                    job_id=job_id,
                    digest=digest,
                    media_type=media_type,
                    load_s=load_s,
                    run_s=run_s,
                    cold_load=cold,
                    provenance=provenance,
                    spooled_at=time.time(),
                    more_digests=[d for _, d in more or []],
                ),
                data,
                tuple(extra for extra, _ in more or []),
            )
        except OSError as refusal:  # the worker's disk is full too: the bytes stay in memory only
            spool_error = refusal
            discard_partial(spool, job_id)
            log.error("job %s: %s and neither could the spool (%s); kept in memory only", job_id, why, refusal)
        else:
            spool_error = None
            log.error("job %s: %s; kept in %s", job_id, why, kept)

    def attempt() -> object:
        try:
            return rt.server.upload(
                job_id,
                data,
                media_type,
                digest,
                load_s=load_s,
                run_s=run_s,
                cold_load=cold,
                provenance=provenance,
                more=more,
            )
        except HomefleetError as error:
            if retriable(error) and kept is None:
                keep(f"the server could not store the result ({error.message})")
            raise
        except httpx.HTTPError as error:  # the server unreachable past its client's own retries
            if kept is None:
                keep(
                    f"the server could not be reached to take the result ({error}): this worker uploads it "
                    f"within {settings.result_recover_interval_s:.0f} s of the server answering (or run "
                    f"`homefleet results recover` on machine {settings.machine} once it answers)"
                )
            raise

    try:
        upload_with_retries(attempt, settings.result_upload_attempts, settings.result_retry_s, job_id)
    except HomefleetError as error:
        if not retriable(error) or (kept is None and spool_error is None):
            if kept is not None:
                spool.remove(job_id)
            raise
        if kept is not None:
            message = (
                f"the server could not store the result after {settings.result_upload_attempts} attempts "
                f"({error.message}); it is kept on machine {settings.machine} in {kept}: its worker tries it "
                f"again every {settings.result_recover_interval_s:.0f} s until the server has room (or run "
                "`homefleet results recover` there)"
            )
        else:
            message = (
                f"the server could not store the result after {settings.result_upload_attempts} attempts "
                f"({error.status_code} {error.reason}: {error.message}) and machine {settings.machine} "
                f"could not keep it in its spool {spool.root} ({describe_os_error(spool_error)}); "
                "the result is lost: free space on both and run the job again"
            )
        log.error("job %s: %s", job_id, message)
        rt.server.fail(job_id, RESULT_NOT_STORED, message, load_s=load_s, run_s=run_s)
        raise JobNotSucceeded(job_id, RESULT_NOT_STORED, message) from error
    if kept is not None:
        spool.remove(job_id)


def discard_partial(spool: ResultSpool, job_id: str) -> None:
    """Remove what a failed spool write left (images 2..n written before the disk filled);
    an error doing so is logged, never raised."""
    try:
        spool.remove(job_id)
    except OSError as error:
        log.warning("job %s: a partial spool entry in %s was not removed: %s", job_id, spool.root, error)


def describe_os_error(error: OSError | None) -> str:
    """``ENOSPC: No space left on device`` and the like: the errno's name and its text."""
    if error is None:
        return "no error"
    name = errno.errorcode.get(error.errno or 0, "")
    text = error.strerror or str(error)
    return f"{name}: {text}" if name else text
