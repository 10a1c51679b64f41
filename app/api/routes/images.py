"""OpenAI-compatible Images API and the Hugging Face text-to-image task.

- ``POST /v1/images/generations`` (JSON: ``prompt``, ``model``, ``n``, ``size`` "WxH",
  ``response_format`` ``b64_json`` | ``url``; Homefleet extras ``steps``, ``target``,
  ``negative_prompt`` through the SDK's ``extra_body``): one txt2img job per image, waited
  for, answered ``{"created", "data": [{"b64_json"} | {"url"}]}``.
- ``POST /v1/images/edits`` (multipart: ``image``, ``prompt``, ``model``, ``n``,
  ``response_format``): the upload is validated (bytes, media type, R22), stored as an
  input, and one ``edit`` job per image runs on it.
- ``POST /hf/models/{model}`` (and ``POST /hf``, the first txt2img model): ``{"inputs": prompt, "parameters": {...}}`` -> image bytes
  (a parameter Homefleet does not run is refused, 422 ``unknown_param``),
  what ``huggingface_hub.InferenceClient(base_url=".../hf/models/<model>").text_to_image``
  sends.

Errors on these routes have OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``
(mapped in app/api/server.py). Once a job has been submitted, every error answer carries
``x-should-retry: false`` so the SDKs' automatic retries never create a second job (R20):
domain errors and unexpected ones alike (:func:`submitted`). The wait for the jobs
(``images_wait_s``) ends well before the OpenAI SDK's own read timeout (600 s), after which it
would resend the request without reading that header.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any, Literal

from anyio import to_thread
from fastapi import APIRouter, File, Form, Request, UploadFile
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field

from app.api.routes.deps import Context
from app.api.strict_json import StrictJsonRoute
from app.context import ServerContext
from app.core.errors import HomefleetError, NotFound, Rejected
from app.core.limits import limits_for
from app.core.states import ENDED, JobState
from app.db.tables import Job
from app.jobs.validation import check_submission, check_upload
from app.store.media import sniff
from routing.placement import SERVER

router = APIRouter(route_class=StrictJsonRoute)
log = logging.getLogger(__name__)

POLL_S = 0.1


class JobFailed(HomefleetError):
    """Raised when a job submitted for an image request ended without a result."""

    status_code = 500
    default_reason = "job_failed"


class ImageGeneration(BaseModel):
    """``POST /v1/images/generations`` (OpenAI's fields; others such as ``quality`` are ignored)."""

    model_config = ConfigDict(extra="ignore")

    prompt: str = Field(min_length=1, max_length=32000)
    model: str | None = Field(None, max_length=64, description="registered model id; default: the first txt2img model")
    n: int = Field(1, ge=1, description="number of images (one job each); at most the family's max_batch (invalid_n)")
    size: str | None = Field(None, max_length=32, description="'WxH' in pixels, or 'auto' (the model's default)")
    response_format: Literal["b64_json", "url"] | None = Field(None, description="default b64_json")
    steps: int | None = Field(None, ge=1, le=10_000, description="Homefleet extra: denoising steps")
    negative_prompt: str | None = Field(None, max_length=32000)
    target: str = Field(SERVER, min_length=1, max_length=32, description="Homefleet extra: machine or 'auto'")


class HfParameters(BaseModel):
    """The text-to-image ``parameters`` Homefleet runs (txt2img's params under Hugging Face's
    names). Any other key is kept in ``model_extra`` and refused by :func:`hf_params`."""

    model_config = ConfigDict(extra="allow")

    negative_prompt: str | None = Field(None, max_length=32000)
    width: int | None = Field(None, ge=1, le=100_000)
    height: int | None = Field(None, ge=1, le=100_000)
    num_inference_steps: int | None = Field(None, ge=1, le=10_000)
    guidance_scale: float | None = Field(None, allow_inf_nan=False)  # range checked with the job's params (app/core/kinds.py)
    seed: int | None = Field(None, ge=0, lt=2**31)


#: Hugging Face parameter -> txt2img param
HF_PARAMS: dict[str, str] = {"negative_prompt": "negative_prompt", "width": "width", "height": "height",
                             "num_inference_steps": "steps", "guidance_scale": "guidance_scale", "seed": "seed"}


def hf_params(prompt: str, parameters: HfParameters) -> dict[str, Any]:
    """txt2img params from a Hugging Face text-to-image request.

    Raises:
        Rejected: reason ``unknown_param`` for a parameter Homefleet does not run (e.g.
            ``scheduler``), naming it and listing the ones it takes; it is refused rather
            than ignored.
    """
    unknown = list(parameters.model_extra or {})
    if unknown:
        named = ", ".join(f"parameters.{name}" for name in unknown)
        raise Rejected(f"{named} {'is' if len(unknown) == 1 else 'are'} not supported; text-to-image takes "
                       f"{', '.join(HF_PARAMS)}", reason="unknown_param", param=f"parameters.{unknown[0]}")
    params: dict[str, Any] = {"prompt": prompt}
    for name, param in HF_PARAMS.items():
        value = getattr(parameters, name)
        if value is not None:
            params[param] = value
    return params


class HfTextToImage(BaseModel):
    """The Hugging Face Inference text-to-image payload."""

    model_config = ConfigDict(extra="ignore")

    inputs: str = Field(min_length=1, max_length=32000)
    parameters: HfParameters = Field(default_factory=HfParameters)


class AfterSubmit(HomefleetError):
    """Wraps an error raised once a job may have started: answered with ``x-should-retry: false``."""

    def __init__(self, error: HomefleetError) -> None:
        super().__init__(error.message, reason=error.reason, param=error.param)
        self.status_code = error.status_code
        self.original = error


@contextmanager
def submitted(job_ids: list[str]) -> Iterator[None]:
    """Answer every error raised inside as :class:`AfterSubmit` once ``job_ids`` is not empty
    (a job may have started; R20). ``job_ids`` is read when the error is raised, so a caller
    may append to it inside. An error that is not Homefleet's own (e.g. a result file that
    cannot be read) becomes 500 ``internal_error`` naming the jobs; it is logged with its
    traceback.

    Raises:
        AfterSubmit: any error, once ``job_ids`` is not empty; before that, the error as raised.
    """
    try:
        yield
    except AfterSubmit:
        raise
    except HomefleetError as error:
        if job_ids:
            raise AfterSubmit(error) from error
        raise
    except Exception as error:
        if not job_ids:
            raise
        log.exception("image request failed after jobs %s were submitted", ", ".join(job_ids))
        raise AfterSubmit(JobFailed(
            f"{type(error).__name__} after jobs {', '.join(job_ids)} were submitted: {error}; do not resubmit: "
            "follow them with GET /v1/jobs/{id} and fetch each result with GET /v1/jobs/{id}/result",
            reason="internal_error",
        )) from error


def parse_size(size: str | None) -> dict[str, int]:
    """``"512x512"`` -> ``{"width": 512, "height": 512}``; None/``"auto"`` -> ``{}``.

    Raises:
        Rejected: reason ``invalid_size`` for anything else.
    """
    if size is None or size == "auto":
        return {}
    width, sep, height = size.lower().partition("x")
    if not sep or not width.isdigit() or not height.isdigit():
        raise Rejected(f"`size` must be 'WIDTHxHEIGHT' in pixels (e.g. '512x512') or 'auto', got {size!r}",
                       reason="invalid_size")
    return {"width": int(width), "height": int(height)}


def check_count(ctx: ServerContext, model: str, count: int) -> None:
    """Refuse more images in one request than the model family's ``max_batch`` (R22). ``n`` is
    a property of the request (one job per image), not a job param: no kind reads it.

    An unregistered model is left to the submission itself, which refuses it (404
    ``unknown_model``) and journals the refusal like any other.

    Raises:
        Rejected: reason ``invalid_n``, naming the value and the limit.
    """
    try:
        record = ctx.registry.get(model)
    except NotFound:
        return  # run_jobs refuses it and journals the refusal
    check_submission({"n": count}, limits_for(ctx.settings.limits, record.family))


def default_model(ctx: ServerContext, kind: str) -> str:
    """The first registered model (by id) that runs ``kind``. Raises NotFound when none does."""
    for record in ctx.registry.list():
        if kind in record.kinds:
            return record.id
    raise NotFound(f"no registered model runs {kind}; register one with `homefleet models add`", reason="no_model")


async def run_jobs(ctx: ServerContext, model: str, params: dict[str, Any], target: str, count: int,
                   kind: str = "txt2img") -> list[Job]:
    """Submit ``count`` jobs of ``kind`` and wait until they have ended (``images_wait_s``).

    Raises:
        HomefleetError: the first submission was refused (nothing started).
        AfterSubmit: a later submission was refused, a job did not succeed, the wait ran out
            (reason ``timeout``; the jobs keep their places and run), or anything else failed
            once a job existed (:func:`submitted`).
    """
    ids: list[str] = []
    with submitted(ids):
        for _ in range(count):
            submission = await to_thread.run_sync(ctx.dispatcher.submit, model, kind, dict(params), target)
            ids.append(submission.job.id)
        deadline = time.monotonic() + ctx.settings.images_wait_s
        while True:
            jobs = [await to_thread.run_sync(ctx.journal.get, job_id) for job_id in ids]
            if all(job.state in ENDED for job in jobs):
                break
            if time.monotonic() > deadline:
                raise JobFailed(f"jobs {', '.join(ids)} did not end within {ctx.settings.images_wait_s} s "
                                "(images_wait_s); they keep running: do not resubmit, follow them with "
                                "GET /v1/jobs/{id} and fetch each result with GET /v1/jobs/{id}/result",
                                reason="timeout")
            await asyncio.sleep(POLL_S)
        for job in jobs:
            if job.state != JobState.succeeded:
                raise JobFailed(f"job {job.id} ended {job.state}: {job.reason}: {job.message}", reason=job.reason or "job_failed")
    return jobs


@router.post("/v1/images/generations")
async def generate_images(body: ImageGeneration, ctx: Context, request: Request) -> dict[str, Any]:
    """OpenAI ``images.generate``: 200 ``{"created", "data"}`` once every image exists."""
    model = body.model or await to_thread.run_sync(default_model, ctx, "txt2img")
    params: dict[str, Any] = {"prompt": body.prompt, **parse_size(body.size)}
    if body.steps is not None:
        params["steps"] = body.steps
    if body.negative_prompt is not None:
        params["negative_prompt"] = body.negative_prompt
    await to_thread.run_sync(check_count, ctx, model, body.n)
    jobs = await run_jobs(ctx, model, params, body.target, body.n)
    with submitted([job.id for job in jobs]):
        return {"created": int(time.time()),
                "data": [image_item(job, body.response_format, request, body.prompt) for job in jobs]}


@router.post("/v1/images/edits")
async def edit_images(
    ctx: Context,
    request: Request,
    image: Annotated[UploadFile, File(description="the image to edit (PNG, JPEG or WebP; sides multiples of 8)")],
    prompt: Annotated[str, Form(min_length=1, max_length=32000)],
    model: Annotated[str | None, Form(max_length=64)] = None,
    n: Annotated[int, Form(ge=1)] = 1,  # at most the family's max_batch (invalid_n)
    size: Annotated[str | None, Form(max_length=32)] = None,
    response_format: Annotated[Literal["b64_json", "url"] | None, Form()] = None,
) -> dict[str, Any]:
    """OpenAI ``images.edit``: the upload is checked (bytes, media type by content; R22) and
    stored as an input (``POST /v1/files``'s store), then one ``edit`` job per image runs on
    it. ``size`` is accepted for compatibility; an edit keeps the input's size."""
    model_id = model or await to_thread.run_sync(default_model, ctx, "edit")
    record = await to_thread.run_sync(ctx.registry.get, model_id)
    limits = limits_for(ctx.settings.limits, record.family)
    data = await image.read(limits.max_upload_bytes + 1)  # no more than one byte past the limit into memory
    check_upload(image.size if image.size is not None else len(data), sniff(data[:16]) or "application/octet-stream", limits)
    check_submission({"n": n}, limits)  # one job per image (R22)
    parse_size(size)
    stored = await to_thread.run_sync(ctx.inputs.add, data)
    jobs = await run_jobs(ctx, model_id, {"prompt": prompt, "image": stored.id}, SERVER, n, kind="edit")
    with submitted([job.id for job in jobs]):
        return {"created": int(time.time()), "data": [image_item(job, response_format, request, prompt) for job in jobs]}


def image_item(job: Job, response_format: str | None, request: Request, prompt: str) -> dict[str, str]:
    """One ``data`` entry: the result as base64 (default) or as its URL."""
    if response_format == "url":
        return {"url": str(request.base_url).rstrip("/") + f"/v1/jobs/{job.id}/result", "revised_prompt": prompt}
    return {"b64_json": base64.b64encode(Path(job.result_path or "").read_bytes()).decode(), "revised_prompt": prompt}


@router.post("/hf", response_class=Response)
async def hf_text_to_image_default(body: HfTextToImage, ctx: Context) -> Response:
    """Hugging Face ``text_to_image`` with the first txt2img model (``InferenceClient(base_url=".../hf")``)."""
    return await hf_text_to_image(await to_thread.run_sync(default_model, ctx, "txt2img"), body, ctx)


@router.post("/hf/models/{model}", response_class=Response)
async def hf_text_to_image(model: str, body: HfTextToImage, ctx: Context) -> Response:
    """Hugging Face ``text_to_image``: the image's bytes (``image/png``)."""
    [job] = await run_jobs(ctx, model, hf_params(body.inputs, body.parameters), SERVER, 1)
    with submitted([job.id]):
        return Response(Path(job.result_path or "").read_bytes(), media_type=job.result_media_type or "image/png")
