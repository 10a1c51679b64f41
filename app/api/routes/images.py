"""OpenAI-compatible Images API, and the helpers every image and text route submits and waits with.

- ``POST /v1/images/generations`` (JSON: ``prompt``, ``model``, ``n``, ``size`` "WxH",
  ``response_format`` ``b64_json`` | ``url``; Homefleet extras ``steps``, ``target``,
  ``negative_prompt`` through the SDK's ``extra_body``): ONE txt2img job making the ``n`` images
  in one pipeline call (``params.n``, consecutive seeds), waited for, answered
  ``{"created", "data": [{"b64_json"} | {"url"}]}`` with the images in order.
- ``POST /v1/images/edits`` (multipart: ``image``, ``prompt``, ``model``, ``n``,
  ``response_format``): the upload is validated (bytes, media type, R22), stored as an
  input, and one ``edit`` job per image runs on it.

The Hugging Face Inference routes (``/hf``, ``/hf/models/{model}``) are in
app/api/routes/hf.py; they run their image jobs through this module's helpers.

Errors on these routes have OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``
(mapped in app/api/server.py). Once a job has been submitted, every error answer carries
``x-should-retry: false`` and ``job_ids`` so the SDKs' automatic retries never create a second
job (R20): domain errors and unexpected ones alike (:func:`submitted`).

One job per call, whatever the client's timeout (C10). A request waits for its jobs at most
``images_wait_s``, and less when the client says it gives up sooner
(``x-stainless-read-timeout``, sent by the OpenAI SDK, or ``Prefer: wait=N``, RFC 7240, for any
other client such as ``huggingface_hub``'s): it is answered :func:`reply_margin_s` before that
with 409 ``job_pending`` naming the jobs, which keep their places and run; the SDK does not
retry it. A retried request (``x-stainless-retry-count`` > 0) of a call already seen gets that
call's jobs (app/jobs/calls.py).
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import math
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Annotated, Any, Literal

from anyio import to_thread
from fastapi import APIRouter, File, Form, Request, UploadFile
from pydantic import ConfigDict, Field

from app.api.auth import bearer_token, request_key_id
from app.api.openai_errors import client_fields
from app.api.result_urls import signed_result_url
from app.api.routes.deps import Context, result_file
from app.api.strict_json import StrictJsonRoute
from app.context import ServerContext
from app.core.config import Settings
from app.core.errors import HomefleetError, JobPending, NotFound, Rejected, ServerStopping
from app.core.kinds import ADAPTERS_PARAM, BATCH_PARAM, family_kind_spec, nth_seed
from app.core.limits import MAX_IDEMPOTENCY_KEY, limits_for
from app.core.request_body import RequestBody, refuse_unknown, refuse_unsupported
from app.core.states import ENDED, JobState
from app.db.tables import Job
from app.jobs.calls import call_fingerprint, keyed_fingerprint
from app.jobs.validation import check_submission, check_upload
from app.store.media import sniff
from routing.placement import AUTO, SERVER, MachineView

router = APIRouter(route_class=StrictJsonRoute)
log = logging.getLogger(__name__)

POLL_S = 0.1
MAX_PROMPT_CHARS = 32000  # a prompt's characters on these routes (its tokens are checked with the job, R22)
READ_TIMEOUT_HEADER = "x-stainless-read-timeout"  # the OpenAI SDK's read timeout, seconds
RETRY_COUNT_HEADER = "x-stainless-retry-count"  # how many times the OpenAI SDK already resent this request
#: what Hugging Face's ``image_to_image`` runs on a model (app/api/routes/hf.py): the first of these kinds it runs
IMAGE_TO_IMAGE_KINDS = ("edit", "img2img", "upscale")


class JobFailed(HomefleetError):
    """Raised when a job submitted for an image or text request ended without a result: 500
    (OpenAI's ``server_error``) on the OpenAI routes, 424 ``generation`` on TGI's
    (app/api/openai_errors.py ``tgi_error``)."""

    status_code = 500
    default_reason = "job_failed"
    job_failed = True


class JobWasCancelled(JobFailed):
    """Raised when a job submitted for an image or text request was cancelled before it ended
    (``POST /v1/jobs/{id}/cancel``, or purged from its queue): 409 with the job's reason
    (``cancelled``, ``purged``) on the OpenAI routes, since the request was ended by a caller,
    not by a fault of the server; 424 ``generation`` on TGI's, as any job without a result."""

    status_code = 409
    default_reason = "cancelled"


def reply_margin_s(timeout_s: float) -> float:
    """How long before a client's announced timeout its answer is sent: a fifth of it, between
    0.25 s and 2 s (the answer's own transfer and the client's clock start before ours)."""
    return min(2.0, max(0.25, 0.2 * timeout_s))


def announced_timeout_s(request: Request) -> float | None:
    """The shortest wait the client announced, in seconds: ``x-stainless-read-timeout`` (OpenAI
    SDK) or ``Prefer: wait=N`` (RFC 7240); None when it announced none (or nothing finite and
    positive)."""
    values = [request.headers.get(READ_TIMEOUT_HEADER)]
    for prefer in request.headers.getlist("prefer"):
        for token in prefer.split(","):
            name, _, wait = token.strip().partition("=")
            if name.strip().lower() == "wait":
                values.append(wait.strip())
    seconds = []
    for value in values:
        try:
            number = float(value) if value is not None else math.nan
        except ValueError:
            continue
        if math.isfinite(number) and number > 0:
            seconds.append(number)
    return min(seconds) if seconds else None


@dataclass(frozen=True)
class ImageCall:
    """One request of an image route: its call's fingerprint (app/jobs/calls.py), whether it is
    a client's automatic retry, when it must be answered (``time.monotonic()`` seconds), and
    the id of its API key (its jobs' ``api_key_id``, whose quota applies)."""

    fingerprint: str
    retried: bool
    answer_by: float
    api_key_id: str | None = None
    body: str | None = None  # with an Idempotency-Key: the body's fingerprint (app/jobs/calls.py)

    @classmethod
    def of(
        cls, request: Request, settings_wait_s: float, body: dict[str, Any], started: float | None = None
    ) -> ImageCall:
        """The call of ``request`` with canonical ``body`` (what was asked: fields and file
        digests), whose wait began at ``started`` (``time.monotonic()``; default now)."""
        wait_s = settings_wait_s
        announced = announced_timeout_s(request)
        if announced is not None:
            wait_s = min(wait_s, announced - reply_margin_s(announced))
        try:
            retried = int(request.headers.get(RETRY_COUNT_HEADER, "0")) > 0
        except ValueError:
            retried = False
        key = bearer_token(request.headers.get("authorization", "")) or ""
        fingerprint, keyed = call_fingerprint(key, request.url.path, body), None
        idempotency_key = request.headers.get("idempotency-key")
        if idempotency_key is not None:  # a deliberate resend (R20): the key, not the SDK's retry count
            if not 1 <= len(idempotency_key) <= MAX_IDEMPOTENCY_KEY:
                raise Rejected(
                    f"the `Idempotency-Key` header must be 1 to {MAX_IDEMPOTENCY_KEY} characters, "
                    f"got {len(idempotency_key)}",
                    reason="invalid_idempotency_key",
                    param="Idempotency-Key",
                )
            fingerprint, keyed = keyed_fingerprint(key, request.url.path, idempotency_key), fingerprint
        return cls(
            fingerprint=fingerprint,
            retried=retried or keyed is not None,
            answer_by=(time.monotonic() if started is None else started) + max(0.0, wait_s),
            api_key_id=request_key_id(request),
            body=keyed,
        )


OPENAI_IGNORED = ("quality", "style", "user", "background", "moderation", "output_compression", "output_format")
"""OpenAI image fields Homefleet accepts and does not act on (documented in docs/api.md), but
for the values of :data:`OPENAI_HONOURED` it cannot give."""
OPENAI_HONOURED: dict[str, tuple[Any, ...]] = {
    "output_format": (None, "png"),
    "background": (None, "auto", "opaque"),
}
"""Of :data:`OPENAI_IGNORED`, the fields whose other values ask for another file than the one
Homefleet returns (a PNG without transparency): refused, not ignored, so a client that asks
for a JPEG is not handed a PNG it believes is one."""
OPENAI_MAPPED = ("prompt", "n", "width", "height", "image", "mask")
"""Job params the OpenAI image routes set from OpenAI's own fields (``size`` -> width, height;
the upload): not taken again as extras."""


SIZE_FIELDS = {"width": "size", "height": "size", "size": "size", "n": "n"}
"""Job params -> the OpenAI fields they come from (``size`` is ``WxH``): a refusal names the
client's field (app/api/openai_errors.py ``renamed``); the other params keep their names."""


class ImageGeneration(RequestBody):
    """``POST /v1/images/generations``: OpenAI's fields (:data:`OPENAI_IGNORED` ones accepted,
    not acted on); any other field is an extra (the SDK's ``extra_body``), a job param of
    txt2img on the model's family or refused (:func:`extra_params`)."""

    model_config = ConfigDict(extra="allow")

    prompt: str = Field(min_length=1, max_length=MAX_PROMPT_CHARS)
    model: str | None = Field(
        None, min_length=1, max_length=64, description="registered model id; default: the first txt2img model by id"
    )
    n: int = Field(
        1,
        json_schema_extra={"minimum": 1},  # checked with the family's max_batch: invalid_n either way
        description="number of images (one job making them all, consecutive seeds); at least 1, at most "
        "the family's max_batch (invalid_n)",
    )
    size: str | None = Field(None, max_length=32, description="'WxH' in pixels, or 'auto' (the model's default)")
    response_format: Literal["b64_json", "url"] | None = Field(None, description="default b64_json")
    steps: int | None = Field(  # no schema maximum: the family's limit is the one a user meets (invalid_steps)
        None,
        ge=1,
        description="Homefleet extra: denoising steps; at most the model family's max_steps "
        "(150 unless HOMEFLEET_LIMITS says otherwise), checked with the job (invalid_steps)",
    )
    negative_prompt: str | None = Field(None, max_length=MAX_PROMPT_CHARS)
    target: str = Field(SERVER, min_length=1, max_length=32, description="Homefleet extra: machine or 'auto'")
    expand_prompt: str | None = Field(
        None,
        max_length=64,
        description="not on this route (refused): prompt expansion runs on POST /v1/jobs (params.expand_prompt)",
    )


class AfterSubmit(HomefleetError):
    """Wraps an error raised once a job may have started: answered with ``x-should-retry: false``
    and the ids of the request's jobs (``job_ids``)."""

    def __init__(self, error: HomefleetError, job_ids: list[str]) -> None:
        super().__init__(error.message, reason=error.reason, param=error.param)
        self.status_code = error.status_code
        self.original = error
        self.job_ids = list(job_ids)


@contextmanager
def submitted(job_ids: list[str]) -> Iterator[None]:
    """Answer every error raised inside as :class:`AfterSubmit` once ``job_ids`` is not empty
    (a job may have started; R20). ``job_ids`` is read when the error is raised, so a caller
    may append to it inside. An error that is not Homefleet's own (e.g. a result file that
    cannot be read) becomes 500 ``internal_error`` naming the jobs; it is logged with its
    traceback.

    Raises:
        AfterSubmit: any error, once ``job_ids`` is not empty; before that, the error as raised.
        ServerStopping: as raised: the server is stopping, the request may be sent again.
    """
    try:
        yield
    except (AfterSubmit, ServerStopping):  # the latter is resendable: the next server answers it (C10)
        raise
    except HomefleetError as error:
        if job_ids:
            raise AfterSubmit(error, job_ids) from error
        raise
    except Exception as error:
        if not job_ids:
            raise
        log.exception("image request failed after jobs %s were submitted", ", ".join(job_ids))
        raise AfterSubmit(
            JobFailed(
                f"{type(error).__name__} after jobs {', '.join(job_ids)} were submitted: {error}; do not resubmit: "
                "follow them with GET /v1/jobs/{id} and fetch each result with GET /v1/jobs/{id}/result",
                reason="internal_error",
            ),
            job_ids,
        ) from error


def extra_params(ctx: ServerContext, model: str, kind: str, extras: dict[str, Any]) -> dict[str, Any]:
    """The job params given as extras (the SDK's ``extra_body``) on an OpenAI image route:
    each a param ``kind`` takes on the model's family (``seed``, ``guidance_scale``,
    ``adapters``... as ``POST /v1/jobs`` takes them; their values are checked with the job's),
    never one set from OpenAI's own fields (:data:`OPENAI_MAPPED`); :data:`OPENAI_IGNORED`
    fields are dropped, but for a value :data:`OPENAI_HONOURED` does not hold.

    Raises:
        Rejected: reason ``unknown_param`` naming the first extra that is neither (param: its
            name as sent), listing the ones the kind takes here, also for an ``output_format``
            or ``background`` this server cannot give (:func:`app.core.request_body.refuse_unsupported`).
    """
    try:
        family = ctx.registry.get(model).family
    except NotFound:
        family = ""  # refused by the submission itself (404 unknown_model), journaled
    kind_spec = family_kind_spec(family, kind)
    taken = [
        name for name in (*kind_spec.params, ADAPTERS_PARAM) if name in kind_spec.accepted and name not in OPENAI_MAPPED
    ]
    where = f"this route's extras (the params of kind {kind} on the model's family)"
    honoured = {n: v for n, v in extras.items() if n in OPENAI_HONOURED}
    refuse_unsupported(honoured, OPENAI_HONOURED, taken, "OpenAI's image fields: Homefleet returns PNG files")
    refuse_unknown([name for name in extras if name not in OPENAI_IGNORED and name not in taken], taken, where)
    return {name: value for name, value in extras.items() if name not in OPENAI_IGNORED}


def parse_size(size: str | None) -> dict[str, int]:
    """``"512x512"`` -> ``{"width": 512, "height": 512}``; None/``"auto"`` -> ``{}``.

    Raises:
        Rejected: reason ``invalid_size`` for anything else.
    """
    if size is None or size == "auto":
        return {}
    width, sep, height = size.lower().partition("x")
    if not sep or not width.isdigit() or not height.isdigit():
        raise Rejected(
            f"`size` must be 'WIDTHxHEIGHT' in pixels (e.g. '512x512') or 'auto', got {size!r}", reason="invalid_size"
        )
    return {"width": int(width), "height": int(height)}


def check_count(ctx: ServerContext, model: str, count: int) -> None:
    """Refuse more images in one request than the model family's ``max_batch`` (R22), before
    any job exists (the job's own ``params.n`` is checked again at submission).

    An unregistered model is left to the submission itself, which refuses it (404
    ``unknown_model``) and journals the refusal like any other.

    Raises:
        Rejected: reason ``invalid_n``, naming the value and the limit.
    """
    try:
        record = ctx.registry.get(model)
    except NotFound:
        return  # run_jobs refuses it and journals the refusal
    check_submission({"n": count}, limits_for(ctx.settings.limits, record.family), family=record.family)


def default_model(ctx: ServerContext, kind: str, chat: bool = False, target: str = SERVER) -> str:
    """The model a request of ``kind`` that names none runs on ``target`` (a machine, or
    ``"auto"``): among the models in service that run ``kind``, those that ``target`` can run now
    first (:func:`runs_now`; for ``"auto"``, any machine: a model no machine can run now would
    only be refused or wait), then by id; for a ``chat`` request the first of that order whose
    tokenizer has a chat template (a chat through one without is refused), falling back to the
    first of the order when none has one (the chat is then refused naming that model).

    Raises:
        NotFound: reason ``no_model`` when none does, naming the retired ones that did.
    """
    views = ctx.machines.views()
    machines = list(views.values()) if target == AUTO else [views[target]] if target in views else []
    records = sorted(
        (r for r in ctx.registry.list() if kind in r.kinds),
        key=lambda r: (not any(runs_now(view, r.id, r.family) for view in machines), r.id),
    )
    for record in records if chat else records[:1]:
        if not chat or ctx.dispatcher.validator.tokenizers.has_chat_template(record.id):
            return record.id
    if records:
        return records[0].id
    retired = [record.id for record in ctx.registry.list(retired=True) if record.retired_at and kind in record.kinds]
    was = f" (retired: {', '.join(retired)})" if retired else ""
    raise NotFound(f"no model in service runs {kind}{was}; register one with `homefleet models add`", reason="no_model")


def runs_now(machine: MachineView, model_id: str, family: str) -> bool:
    """Whether ``machine`` could take a job of ``model_id`` (of ``family``) now, as far as the
    choice of a default model needs: online, neither draining nor receiving a sync, its
    families include ``family`` and it verified the model's files (R4, R10). Memory and queue
    limits are left to placement, which names them."""
    return (
        machine.online
        and not machine.draining
        and not machine.syncing
        and family in machine.families
        and model_id in machine.verified_models
    )


HF_NO_MODEL = "dummy"
"""The ``model`` huggingface_hub's ``InferenceClient`` sends on chat completions when it was given
none, or only a URL (``huggingface_hub/inference/_providers/hf_inference.py``): TGI, serving one
model, ignores it; here it names no model unless a model of that id is in service."""


async def model_or_default(
    ctx: ServerContext, model: str | None, kind: str, chat: bool = False, target: str = SERVER
) -> str:
    """``model``, or when none is named (:data:`HF_NO_MODEL` counting as none) :func:`default_model`
    of ``kind`` for ``target`` (``chat``: the first with a chat template; read off the event loop)."""
    if model and (model != HF_NO_MODEL or await to_thread.run_sync(is_registered, ctx, model)):
        return model
    return await to_thread.run_sync(default_model, ctx, kind, chat, target)


def is_registered(ctx: ServerContext, model: str) -> bool:
    """Whether ``model`` is a registered model id in service (not retired)."""
    try:
        ctx.registry.get(model)
        ctx.registry.check_in_service(model)
    except NotFound:
        return False
    return True


async def run_jobs(
    ctx: ServerContext,
    call: ImageCall,
    model: str,
    params: dict[str, Any],
    target: str,
    count: int,
    kind: str = "txt2img",
    seed_step: bool = False,
) -> list[Job]:
    """Submit ``count`` jobs of ``kind`` for ``call`` (or, for a client's retry of a call already
    seen, take that call's jobs: C10) and wait until they have ended or ``call.answer_by``.
    ``seed_step``: job i runs with ``params.seed + i`` when a seed is given (a text request's
    ``n`` choices, each its own job; without a seed each draws its own).

    Raises:
        HomefleetError: the first submission was refused (nothing started).
        AfterSubmit: a later submission was refused, a job did not succeed, the wait ran out
            (:class:`JobPending`, 409 ``job_pending``; the jobs keep their places and run), or
            anything else failed once a job existed (:func:`submitted`).
    """
    ids: list[str] = []
    with submitted(ids):
        seen = await seen_call(ctx, call) if call.retried else None
        if seen is not None:
            ids.extend(seen)
            log.info("a retried image request gets its first call's jobs %s (C10)", ", ".join(ids))
            if len(ids) < count:
                raise JobFailed(
                    f"the first request of this call submitted {len(ids)} of {count} jobs "
                    f"({', '.join(ids)}); the others were refused",
                    reason="partly_refused",
                )
        else:
            await submit_call(ctx, call, model, params, target, count, kind, ids, seed_step)
        jobs = [await ctx.waiting.until_ended(job_id, call.answer_by - time.monotonic()) for job_id in ids]
        if pending := [job.id for job in jobs if job.state not in ENDED]:
            raise JobPending(
                f"jobs {', '.join(pending)} have not ended before this request had to be answered (the "
                "client's announced timeout, or images_wait_s); they keep their places and run: do not "
                "resubmit, follow them with GET /v1/jobs/{id} and fetch each result with "
                "GET /v1/jobs/{id}/result",
                ids,
            )
        for job in jobs:
            if job.state != JobState.succeeded:
                ended = JobWasCancelled if job.state == JobState.cancelled else JobFailed
                raise ended(f"job {job.id} ended {job.state}: {job.reason}: {job.message}", reason=job.reason or None)
    return jobs


async def seen_call(ctx: ServerContext, call: ImageCall) -> list[str] | None:
    """The jobs of the call a retried request repeats, once its first request has submitted them
    all; None when no such call is remembered (the retry then submits as a first request would).

    Raises:
        JobPending: the first request is still submitting when this one must be answered.
    """
    while True:
        found = await to_thread.run_sync(ctx.calls.find, call.fingerprint)
        if found is None:
            return None
        if call.body is not None and found.body != call.body:
            raise Rejected(
                "this Idempotency-Key was sent before with another request body (its jobs: "
                f"{', '.join(found.jobs) or 'none yet'}); use a new key for a new request (R20)",
                reason="idempotency_key_reused",
                param="Idempotency-Key",
            )
        if found.complete:
            return list(found.jobs)
        if time.monotonic() >= call.answer_by:
            raise JobPending(
                f"the first request of this call is still submitting its jobs "
                f"({', '.join(found.jobs) or 'none submitted yet'}); do not resubmit: they will be "
                "listed by GET /v1/jobs once submitted",
                list(found.jobs),
            )
        await asyncio.sleep(POLL_S)


async def submit_call(
    ctx: ServerContext,
    call: ImageCall,
    model: str,
    params: dict[str, Any],
    target: str,
    count: int,
    kind: str,
    ids: list[str],
    seed_step: bool = False,
) -> None:
    """Submit the call's ``count`` jobs, appending each id to ``ids`` and remembering them under
    the call's fingerprint as they are submitted (a retry arriving meanwhile waits for all).
    A call whose first submission is refused is forgotten. Raises what a submission raises."""
    record = partial(ctx.calls.record, call.fingerprint, body=call.body)
    await to_thread.run_sync(lambda: record([], complete=False))
    try:
        for index in range(count):
            each = dict(params)
            if seed_step and isinstance(params.get("seed"), int):
                each["seed"] = nth_seed(params["seed"], index)
            submission = await to_thread.run_sync(
                partial(ctx.dispatcher.submit, model, kind, each, target, api_key_id=call.api_key_id)
            )
            ids.append(submission.job.id)
            if len(ids) < count:
                await to_thread.run_sync(
                    lambda: ctx.calls.record(call.fingerprint, ids, complete=False, body=call.body)
                )
    finally:
        if ids:
            await to_thread.run_sync(lambda: record(ids, complete=True))
        else:
            await to_thread.run_sync(ctx.calls.forget, call.fingerprint)


@router.post("/v1/images/generations")
async def generate_images(body: ImageGeneration, ctx: Context, request: Request) -> dict[str, Any]:
    """OpenAI ``images.generate``: 200 ``{"created", "data"}`` once every image exists; 409
    ``job_pending`` naming the jobs when they have not ended before the client's announced
    timeout (C10)."""
    call = ImageCall.of(request, ctx.settings.images_wait_s, body.model_dump(mode="json"))
    model = await model_or_default(ctx, body.model, "txt2img", target=body.target)
    params: dict[str, Any] = {
        "prompt": body.prompt,
        **parse_size(body.size),
        **await to_thread.run_sync(extra_params, ctx, model, "txt2img", body.model_extra or {}),
    }
    if body.steps is not None:
        params["steps"] = body.steps
    if body.expand_prompt is not None:  # refused, never ignored: a text job first is POST /v1/jobs'
        params["expand_prompt"] = body.expand_prompt
    if body.negative_prompt is not None:
        params["negative_prompt"] = body.negative_prompt
    with client_fields({**{name: name for name in params}, **SIZE_FIELDS}):
        await to_thread.run_sync(check_count, ctx, model, body.n)
        if body.n > 1:
            params[BATCH_PARAM] = body.n  # one job, one pipeline call
        jobs = await run_jobs(ctx, call, model, params, body.target, 1)
    with submitted([job.id for job in jobs]):
        return {
            "created": int(time.time()),
            "data": [
                image_item(job, body.response_format, ctx.settings, caller_key(request), body.prompt, index)
                for job in jobs
                for index in range(max(1, len(job.results or [])))
            ],
        }


@router.post("/v1/images/edits")
async def edit_images(
    ctx: Context,
    request: Request,
    prompt: Annotated[str, Form(min_length=1, max_length=MAX_PROMPT_CHARS)],
    image: Annotated[
        UploadFile | None, File(description="the image to edit (PNG, JPEG or WebP; any size: the result keeps it)")
    ] = None,
    model: Annotated[str | None, Form(max_length=64)] = None,
    n: Annotated[int, Form(json_schema_extra={"minimum": 1})] = 1,  # 1 to the family's max_batch (invalid_n)
    size: Annotated[str | None, Form(max_length=32)] = None,
    response_format: Annotated[Literal["b64_json", "url"] | None, Form()] = None,
) -> dict[str, Any]:
    """OpenAI ``images.edit``: the upload is checked (bytes, media type by content; R22) and
    stored as an input (``POST /v1/files``'s store), then one ``edit`` job per image runs on
    it (image i seeded ``seed + i`` when a ``seed`` extra is given). Extra form fields (the SDK's
    ``extra_body``) are edit params or refused (:func:`extra_params`); so is any file but the one
    image (:func:`the_one_image`: a ``mask`` is refused, not ignored). ``size`` is accepted for
    compatibility; an edit keeps the input's size. 409
    ``job_pending`` as for generations (C10)."""
    started = time.monotonic()
    form = await request.form()
    image = the_one_image(image, form)
    model_id = await model_or_default(ctx, model, "edit", target=SERVER)
    record = await to_thread.run_sync(ctx.registry.get, model_id)
    limits = limits_for(ctx.settings.limits, record.family)
    data = await image.read(limits.max_upload_bytes + 1)  # no more than one byte past the limit into memory
    check_upload(
        image.size if image.size is not None else len(data), sniff(data[:16]) or "application/octet-stream", limits
    )
    check_submission({"n": n}, limits, family=record.family)  # one job per image (R22)
    parse_size(size)
    extras = await to_thread.run_sync(extra_params, ctx, model_id, "edit", form_extras(form))
    stored = await to_thread.run_sync(ctx.inputs.add, data, "image")
    fields = {
        "image": stored.id,
        "prompt": prompt,
        "model": model,
        "n": n,
        "size": size,
        "response_format": response_format,
        **extras,
    }  # the call as asked: the file by its digest
    call = ImageCall.of(request, ctx.settings.images_wait_s, fields, started=started)
    jobs = await run_jobs(
        ctx, call, model_id, {"prompt": prompt, "image": stored.id, **extras}, SERVER, n, kind="edit", seed_step=True
    )
    with submitted([job.id for job in jobs]):
        return {
            "created": int(time.time()),
            "data": [image_item(job, response_format, ctx.settings, caller_key(request), prompt) for job in jobs],
        }


EDIT_FIELDS = ("image", "prompt", "model", "n", "size", "response_format")
LISTED_IMAGE = "image[]"
"""The field the openai SDK names the input when ``images.edit`` is given a list of images."""


def the_one_image(image: UploadFile | None, form: Any) -> UploadFile:
    """The input of ``POST /v1/images/edits``: its one file, sent as ``image`` (or as a list of
    one, ``image[]``); every file part of ``form`` (the multipart form) is checked, so none is
    dropped without a word.

    Raises:
        Rejected: reason ``unknown_param`` (param: the field) for a file under any other name;
            for ``mask``, saying that this route edits the whole image and where masked edits
            run (``inpaint``); reason ``invalid_image`` (param ``image``) when there is no image
            or more than one: an edit job takes one input image.
    """
    files = [(name, value) for name, value in form.multi_items() if not isinstance(value, str)]
    for name, _ in files:
        if name == "mask":
            raise Rejected(
                "`mask` is not taken here: this route runs an `edit` job on the whole image; for a masked "
                "edit submit an `inpaint` job (`POST /v1/jobs` with `params.image` and `params.mask`, "
                "docs/api.md) on a model that runs inpaint",
                reason="unknown_param",
                param="mask",
            )
        if name not in ("image", LISTED_IMAGE):
            raise Rejected(
                f"`{name}` is a file this route does not take; it takes one file, `image`",
                reason="unknown_param",
                param=name,
            )
    images = [value for name, value in files if name in ("image", LISTED_IMAGE)]
    if image is not None and not images:
        images = [image]
    if len(images) != 1:
        raise Rejected(
            f"`image` must be one file, the image to edit; got {len(images)} (an edit job takes one input image: "
            "send several requests for several inputs)",
            reason="invalid_image",
            param="image",
        )
    return images[0]


_BRACKETED = re.compile(r"^(?P<base>[^\[\]]+)\[(?P<first>[^\[\]]*)\](?:\[(?P<second>[^\[\]]+)\])?$")
"""A form field in the openai SDK's ``brackets`` encoding of a nested ``extra_body`` value
(openai-python ``_qs.py``, ``array_format="brackets"``): ``name[]`` (a list's item),
``name[key]`` (an object's field) or ``name[][key]`` (a field of a list's object)."""


FORM_TEXT_FIELDS = frozenset({"prompt", "negative_prompt", "format", "scheduler", "target", "expand_prompt", "id"})
"""Form fields (and fields of a form's objects: an adapter's ``id``) whose value is text
whatever it looks like: ``negative_prompt=42`` is the text "42", an adapter id of digits is an
id (a form carries every value as text; the others are parsed as JSON)."""


def form_extras(form: Any) -> dict[str, Any]:
    """The extra fields of an edit's multipart form (the SDK's ``extra_body``), each parsed as
    JSON where it is JSON (``11`` -> 11, ``[...]``), else kept as its text; a text field
    (:data:`FORM_TEXT_FIELDS`) is always its text. Nested values arrive
    in the openai SDK's bracket encoding (:data:`_BRACKETED`) and are rebuilt: ``x[]=1``,
    ``x[]=2`` is ``[1, 2]``; ``x[k]=v`` is ``{"k": v}``; a list of objects arrives field by field,
    every value of one field before the next field's (the SDK groups equal names), so object i
    takes each field's i-th value: ``adapters[][id]=a``, ``adapters[][id]=b``,
    ``adapters[][scale]=0.5``, ``adapters[][scale]=1`` is ``[{"id": "a", "scale": 0.5}, {"id":
    "b", "scale": 1}]``. A name whose base is also sent plain, or deeper, stays apart under its own
    name (then refused as unknown, naming it).

    Raises:
        Rejected: reason ``invalid_params`` naming the list, when its fields have different
            counts (an object without a field its neighbours have): the form cannot say which
            object each value belongs to; the message says to give each object every field or
            to send the list as one JSON string.
    """
    extras: dict[str, Any] = {}
    fields: dict[str, dict[str, list[Any]]] = {}  # list of objects: base -> field -> values in order
    for name, value in form.multi_items():
        if name in EDIT_FIELDS or not isinstance(value, str):
            continue
        found = _BRACKETED.match(name)
        field = (found["second"] or found["first"] or found["base"]) if found is not None else name
        try:
            parsed: Any = value if field in FORM_TEXT_FIELDS else json.loads(value)
        except ValueError:
            parsed = value
        if found is None:
            extras[name] = parsed
            continue
        base, first, second = found["base"], found["first"], found["second"]
        if first and second is None:  # name[key]: an object's field
            into = extras.setdefault(base, {})
            if isinstance(into, dict):
                into[first] = parsed
            else:
                extras[name] = parsed
        elif first:  # name[k1][k2]: deeper than any param goes
            extras[name] = parsed
        elif second is None:  # name[]: a list's item
            items = extras.setdefault(base, [])
            if isinstance(items, list):
                items.append(parsed)
            else:
                extras[name] = parsed
        else:  # name[][key]: one field of a list of objects
            fields.setdefault(base, {}).setdefault(second, []).append(parsed)
    for base, columns in fields.items():
        if base in extras:
            extras.update({f"{base}[][{key}]": values for key, values in columns.items()})
            continue
        counts = {key: len(values) for key, values in columns.items()}
        if len(set(counts.values())) != 1:
            told = ", ".join(f"{count} {base}[][{key}]" for key, count in counts.items())
            raise Rejected(
                f"{base}: the form holds {told}, so it cannot say which object each value belongs to (the "
                f"openai SDK sends a list's fields grouped by name); give every object of {base} the same "
                f'fields, or send {base} as one JSON string (extra_body={{"{base}": json.dumps([...])}})',
                reason="invalid_params",
                param=base,
            )
        extras[base] = [dict(zip(columns, row, strict=True)) for row in zip(*columns.values(), strict=True)]
    return extras


def caller_key(request: Request) -> str | None:
    """The API key the request carries (``Authorization: Bearer``): what its result URLs are
    signed with (app/api/result_urls.py); None when it carries none."""
    return bearer_token(request.headers.get("authorization", ""))


def image_item(
    job: Job, response_format: str | None, settings: Settings, api_key: str | None, prompt: str, index: int = 0
) -> dict[str, str]:
    """One ``data`` entry: result ``index`` of ``job`` (its images in order) as base64
    (default) or as its absolute URL (``response_format`` ``url``): ``settings.base_url`` (never
    from the request's Host) + ``/v1/jobs/<id>/result`` (``?index=i`` after the first), signed
    with ``api_key`` so that it opens without the key for ``result_url_ttl_s``
    (app/api/result_urls.py ``signed_result_url``), as OpenAI's URLs do."""
    if response_format == "url":
        return {"url": signed_result_url(settings, api_key, job.id, index), "revised_prompt": prompt}
    return {"b64_json": base64.b64encode(result_file(job, index).read_bytes()).decode(), "revised_prompt": prompt}
