"""The Hugging Face Inference API's routes: a model's task on ``/hf/models/{model}``, as Hugging
Face's own Inference API serves each model on its own URL.

- ``POST /hf/models/{model}`` (and ``POST /hf``, the first txt2img model): ``{"inputs": prompt,
  "parameters": {...}}`` -> image bytes (a parameter Homefleet does not run is refused, 400
  ``unknown_param``), what ``huggingface_hub.InferenceClient(base_url=".../hf/models/<model>").text_to_image``
  sends.
- ``POST /hf/models/{model}`` with ``parameters.prompt`` and ``inputs`` an image in base64:
  Hugging Face ``image_to_image``, one job of the first of :data:`IMAGE_TO_IMAGE_KINDS` the model
  runs (``edit``; ``img2img`` for a Stable Diffusion model, as Hugging Face serves it; ``upscale``)
  on the decoded image, checked and stored as an input like an upload.
- ``POST /hf/models/{model}`` for a model that runs text: TGI's request and answers (``inputs``,
  ``parameters``, ``stream``; app/api/routes/tgi.py), what ``InferenceClient(base_url=
  ".../hf/models/<model>").text_generation`` sends; errors in TGI's shape, so that the client
  raises its ``ValidationError``. ``POST /`` (TGI's route) takes the model in the body instead.
- ``POST /hf/models/{model}/v1/chat/completions``: OpenAI's chat completions for that model
  (app/api/routes/text.py), where Hugging Face's router serves a model's chat and what
  ``InferenceClient(base_url=".../hf/models/<model>").chat_completion`` calls.

The image tasks' errors have OpenAI's shape, and once a job has been submitted every error carries
``x-should-retry: false`` and ``job_ids`` (R20; app/api/routes/images.py).
"""

from __future__ import annotations

import base64
import binascii
import json
import re
import time
from collections.abc import Callable, Coroutine
from typing import Any

from anyio import to_thread
from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import ConfigDict, Field
from starlette.types import Message

from app.api.openai_errors import tgi_error
from app.api.routes import text, tgi
from app.api.routes.deps import Context, result_file
from app.api.routes.images import (
    HF_NO_MODEL,
    IMAGE_TO_IMAGE_KINDS,
    MAX_PROMPT_CHARS,
    ImageCall,
    default_model,
    run_jobs,
    submitted,
)
from app.api.strict_json import StrictJsonRoute, is_json
from app.context import ServerContext
from app.core.errors import NotFound, Rejected
from app.core.kinds import MAX_SEED
from app.core.limits import limits_for
from app.core.request_body import RequestBody, refuse_unknown
from app.jobs.validation import check_upload
from app.store.media import sniff
from routing.placement import AUTO, SERVER
from routing.timings import TEXT_KIND

RAW_IMAGE_PATHS = ("/hf", "/hf/models/{model}")
"""The routes that also take an image as the whole body (:class:`HfRoute`)."""


class HfRoute(StrictJsonRoute):
    """A strict-JSON route (:class:`StrictJsonRoute`) that on :data:`RAW_IMAGE_PATHS` also takes
    an image as the whole body (PNG, JPEG, WebP or GIF by its first bytes, any content type but
    JSON): what ``InferenceClient.image_to_image`` sends when given no parameter at all (the
    image's bytes, not the JSON payload). It is read as ``{"inputs": <the image in base64>}``,
    the payload the client sends with parameters; any other body is left as it came."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        if self.path not in RAW_IMAGE_PATHS:
            return handler

        async def handler_taking_an_image(request: Request) -> Response:
            if is_json(request):
                return await handler(request)
            data = await request.body()
            if not (sniff(data[:16]) or "").startswith("image/"):
                return await handler(request)
            payload = json.dumps({"inputs": base64.b64encode(data).decode()}).encode()
            headers = [(k, v) for k, v in request.scope["headers"] if k not in (b"content-type", b"content-length")]
            headers += [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
            sent = False

            async def receive() -> Message:
                nonlocal sent
                if sent:
                    return await request.receive()
                sent = True
                return {"type": "http.request", "body": payload, "more_body": False}

            return await handler(Request({**request.scope, "headers": headers}, receive))

        return handler_taking_an_image


router = APIRouter(route_class=HfRoute)


MODEL_PATH = re.compile(r"^/hf/models/(?P<model>[^/]+)$")
"""``POST /hf/models/{model}``'s path (decoded, as ``request.url.path`` gives it)."""


def runs_text(ctx: ServerContext, model: str) -> bool:
    """Whether ``model`` is a registered model that runs text (False for an unknown id)."""
    try:
        return TEXT_KIND in ctx.registry.get(model).kinds
    except NotFound:
        return False


def answers_as_tgi(ctx: ServerContext, path: str) -> bool:
    """Whether ``path`` is ``/hf/models/{model}`` of a text model, whose errors have TGI's shape
    (app/api/server.py answers a body that fails validation there so, as TGI's routes)."""
    match = MODEL_PATH.match(path)
    return match is not None and runs_text(ctx, match["model"])


class HfParameters(RequestBody):
    """The ``parameters`` Homefleet runs, under Hugging Face's names: text-to-image's (txt2img's
    params) and, with ``prompt`` set, image-to-image's (:data:`HF_IMAGE_PARAMS`). Any other key
    is kept in ``model_extra`` and refused (:func:`hf_params`, :func:`hf_image_to_image`), as
    the schema says (``additionalProperties: false``)."""

    model_config = ConfigDict(extra="allow", json_schema_extra={"additionalProperties": False})

    prompt: str | None = Field(
        None,
        min_length=1,
        max_length=MAX_PROMPT_CHARS,
        description="image-to-image: the instruction; `inputs` is then the image in base64",
    )

    negative_prompt: str | None = Field(None, max_length=MAX_PROMPT_CHARS)
    width: int | None = Field(None, ge=1, le=100_000)
    height: int | None = Field(None, ge=1, le=100_000)
    num_inference_steps: int | None = Field(  # no schema maximum: the family's limit (invalid_steps)
        None,
        ge=1,
        description="at most the model family's max_steps (150 unless HOMEFLEET_LIMITS says otherwise)",
    )
    guidance_scale: float | None = Field(
        None, allow_inf_nan=False
    )  # range checked with the job's params (app/core/kinds.py)
    seed: int | None = Field(None, ge=0, le=MAX_SEED)


#: Hugging Face parameter -> txt2img param
HF_PARAMS: dict[str, str] = {
    "negative_prompt": "negative_prompt",
    "width": "width",
    "height": "height",
    "num_inference_steps": "steps",
    "guidance_scale": "guidance_scale",
    "seed": "seed",
}


#: Hugging Face image-to-image parameter -> edit/upscale param
HF_IMAGE_PARAMS: dict[str, str] = {
    "prompt": "prompt",
    "negative_prompt": "negative_prompt",
    "num_inference_steps": "steps",
    "guidance_scale": "guidance_scale",
    "seed": "seed",
}


#: Hugging Face image-to-image parameter -> img2img param: those of edit, and how far the image is
#: noised (``strength``, which ``InferenceClient.image_to_image`` passes as an extra keyword)
HF_IMG2IMG_PARAMS: dict[str, str] = {**HF_IMAGE_PARAMS, "strength": "strength"}


def hf_params(prompt: str, parameters: HfParameters) -> dict[str, Any]:
    """txt2img params from a Hugging Face text-to-image request.

    Raises:
        Rejected: reason ``invalid_inputs`` for a prompt over :data:`MAX_PROMPT_CHARS`;
            reason ``unknown_param`` for a parameter Homefleet does not run (e.g.
            ``scheduler``), naming it and listing the ones it takes; it is refused rather
            than ignored.
    """
    if len(prompt) > MAX_PROMPT_CHARS:
        raise Rejected(
            f"`inputs` (the prompt) must be at most {MAX_PROMPT_CHARS} characters, got {len(prompt)}",
            reason="invalid_inputs",
            param="inputs",
        )
    refuse_unknown(list(parameters.model_extra or {}), HF_PARAMS, "text-to-image's parameters", prefix="parameters.")
    params: dict[str, Any] = {"prompt": prompt}
    for name, param in HF_PARAMS.items():
        value = getattr(parameters, name)
        if value is not None:
            params[param] = value
    return params


class HfInference(RequestBody):
    """The Hugging Face Inference payload: text-to-image (``inputs``: the prompt, at most
    :data:`MAX_PROMPT_CHARS` characters) or image-to-image (``inputs``: the image in base64, with or
    without ``parameters.prompt``, :meth:`image_to_image`; the whole body is bounded by
    ``max_request_bytes``). Any other top-level field (a misspelt ``paramters``, whose
    parameters would all be dropped) is refused naming it (:func:`hf_inference`)."""

    model_config = ConfigDict(extra="allow", json_schema_extra={"additionalProperties": False})

    inputs: str = Field(min_length=1, max_length=2 * 1024 * 1024)
    parameters: HfParameters = Field(default_factory=HfParameters)

    def image_to_image(self) -> bool:
        """Whether this is image-to-image: ``parameters.prompt`` set, or ``inputs`` an image in
        base64 (``InferenceClient.image_to_image`` without a prompt: its first bytes are PNG's,
        JPEG's, WebP's or GIF's, which no prompt's are), not a prompt to draw."""
        if self.parameters.prompt is not None:
            return True
        head = self.inputs[:32]
        try:
            data = base64.b64decode(head[: len(head) // 4 * 4], validate=True)
        except (binascii.Error, ValueError):
            return False
        return (sniff(data) or "").startswith("image/")


TEXT_GENERATION_PARAMETERS = frozenset(tgi.Parameters.model_fields) | frozenset(tgi.UNSUPPORTED)
"""TGI's ``parameters``: those text-to-image does not share (:data:`HF_PARAMS`) say a payload
is ``text_generation``'s (:func:`asks_for_text`)."""


def asks_for_text(body: HfInference) -> bool:
    """Whether ``body`` is ``InferenceClient.text_generation``'s payload (TGI's ``stream`` field,
    or a parameter only text generation takes: ``max_new_tokens``, ``details``…), not
    text-to-image's."""
    text_only = TEXT_GENERATION_PARAMETERS - frozenset(HfParameters.model_fields)
    return "stream" in (body.model_extra or {}) or bool(set(body.parameters.model_extra or {}) & text_only)


@router.post("/hf", response_class=Response)
async def hf_inference_default(body: HfInference, ctx: Context, request: Request) -> Response:
    """Hugging Face ``text_to_image`` with the first txt2img model (``InferenceClient(base_url=".../hf")``),
    or ``image_to_image`` (``parameters.prompt`` set) with the first edit model."""
    kind = "edit" if body.image_to_image() else "txt2img"
    return await hf_inference(await to_thread.run_sync(default_model, ctx, kind), body, ctx, request)


@router.post("/hf/models/{model}", response_class=Response)
async def hf_inference(model: str, body: HfInference, ctx: Context, request: Request) -> Response:
    """Hugging Face ``text_to_image`` (``inputs``: the prompt): the image's bytes (``image/png``).
    Hugging Face ``image_to_image`` (``inputs``: the image in base64, ``parameters.prompt``: the
    instruction): the edited image's bytes, from a job of the first of :data:`IMAGE_TO_IMAGE_KINDS`
    the model runs. 409 ``job_pending`` naming the job when it has not ended before the
    client's announced timeout (``Prefer: wait=N``; C10). An unknown model is 404
    ``unknown_model`` before any parameter is read. A text model's path answers as TGI's
    ``POST /`` does for that model (:func:`app.api.routes.tgi.answer_for_model`), or 422
    ``unsupported_kind`` when the client accepts only images; an image model's path refuses
    ``text_generation``'s payload so (:func:`asks_for_text`)."""
    started = time.monotonic()
    record = await to_thread.run_sync(ctx.registry.get, model)  # 404 unknown_model before any parameter is read
    if TEXT_KIND in record.kinds:
        if tgi.accepts_images_only(request):  # text_to_image or image_to_image: a text job would answer no image
            return tgi_error(
                Rejected(
                    f"model {model!r} runs text: it answers text_generation here, not an image (Accept: "
                    f"{request.headers['accept']}); text-to-image needs a model that runs txt2img, image-to-image "
                    f"one that runs {', '.join(IMAGE_TO_IMAGE_KINDS)}",
                    reason="unsupported_kind",
                    param="model",
                )
            )
        return await tgi.answer_for_model(model, await request.json(), ctx, request)
    if asks_for_text(body):  # text_generation on an image model's URL: no image answered as text
        raise Rejected(
            f"model {model!r} runs {', '.join(record.kinds)}: it answers text_to_image and image_to_image "
            "here, not text_generation; text generation needs a model that runs text",
            reason="unsupported_kind",
            param="model",
        )
    refuse_unknown(list(body.model_extra or {}), type(body).model_fields, "the Hugging Face Inference payload")
    if not body.image_to_image():
        kind, params = "txt2img", hf_params(body.inputs, body.parameters)
        fields = {"model": model, **body.model_dump(mode="json")}
    else:
        kind, params = await to_thread.run_sync(hf_image_to_image, ctx, model, body)
        fields = {"model": model, "image": params["image"], "parameters": body.parameters.model_dump(mode="json")}
    call = ImageCall.of(request, ctx.settings.images_wait_s, fields, started=started)
    try:
        [job] = await run_jobs(ctx, call, model, params, SERVER, 1, kind=kind)
    except Rejected as error:  # before any job (after one: AfterSubmit): name the client's field
        names = HF_PARAMS if kind == "txt2img" else HF_IMG2IMG_PARAMS if kind == "img2img" else HF_IMAGE_PARAMS
        raise hf_refusal(error, names) from error
    with submitted([job.id]):
        found = result_file(job)
        return Response(found.read_bytes(), media_type=found.media_type)


def hf_refusal(error: Rejected, names: dict[str, str]) -> Rejected:
    """``error`` naming the Hugging Face parameter (``parameters.guidance_scale``) where it names
    the job's param it maps to (``params.guidance_scale``; ``names``: Hugging Face name -> param)."""
    for name, param in names.items():
        if error.param == f"params.{param}":
            renamed = Rejected(
                error.message.replace(f"params.{param}", f"parameters.{name}"),
                reason=error.reason,
                param=f"parameters.{name}",
            )
            renamed.job_id = error.job_id  # the journaled refusal
            return renamed
    return error


def hf_image_to_image(ctx: ServerContext, model: str, body: HfInference) -> tuple[str, dict[str, Any]]:
    """The kind and params of a Hugging Face image-to-image request: ``inputs`` decoded from
    base64, checked like an upload (R22) and stored as an input.

    Raises:
        NotFound: no such model.
        Rejected: the model runs none of :data:`IMAGE_TO_IMAGE_KINDS` (``unsupported_kind``),
            ``inputs`` is not base64 (``invalid_inputs``), the image is over the family's
            ``max_upload_bytes`` or not PNG/JPEG/WebP (``invalid_inputs``), or a parameter
            Homefleet does not run (``unknown_param``).
    """
    record = ctx.registry.get(model)
    kind = next((kind for kind in IMAGE_TO_IMAGE_KINDS if kind in record.kinds), None)
    if kind is None:
        raise Rejected(
            f"model {model!r} runs {', '.join(record.kinds)}; image-to-image needs a model that runs "
            f"{', '.join(IMAGE_TO_IMAGE_KINDS)}",
            reason="unsupported_kind",
            param="model",
        )
    try:
        data = base64.b64decode(body.inputs, validate=True)
    except (binascii.Error, ValueError) as error:
        raise Rejected(
            f"`inputs` must be the image in base64 for image-to-image (parameters.prompt is set): {error}",
            reason="invalid_inputs",
            param="inputs",
        ) from error
    limits = limits_for(ctx.settings.limits, record.family)
    check_upload(len(data), sniff(data[:16]) or "application/octet-stream", limits, field="inputs")
    taken = HF_IMG2IMG_PARAMS if kind == "img2img" else HF_IMAGE_PARAMS
    extra = body.parameters.model_extra or {}
    unknown = [name for name in extra if name not in taken]
    unknown += [name for name in ("width", "height") if getattr(body.parameters, name) is not None]
    refuse_unknown(unknown, taken, "image-to-image's parameters", prefix="parameters.")
    params: dict[str, Any] = {"image": ctx.inputs.add(data, field="inputs").id}
    for name, param in taken.items():
        value = extra[name] if name in extra else getattr(body.parameters, name, None)
        if value is not None:
            params[param] = value
    return kind, params


@router.post("/hf/v1/chat/completions", response_model=None)
async def hf_chat_completions_any(body: text.ChatCompletion, ctx: Context, request: Request) -> Any:
    """OpenAI ``chat.completions`` under ``/hf``: what ``InferenceClient(base_url=".../hf")
    .chat_completion(messages, model=...)`` calls, the model in the body (none, or
    :data:`HF_NO_MODEL`: the first text model with a chat template). ``target`` defaults to
    ``"auto"`` here, as on TGI's routes (that client sends no extra field)."""
    if "target" not in body.model_fields_set:
        body = body.model_copy(update={"target": AUTO})
    return await text.chat_completions(body, ctx, request)


@router.post("/hf/models/{model}/v1/chat/completions", response_model=None)
async def hf_chat_completions(model: str, body: text.ChatCompletion, ctx: Context, request: Request) -> Any:
    """OpenAI ``chat.completions`` for the text model of the path (app/api/routes/text.py's
    answers, streamed too): what ``InferenceClient(base_url=".../hf/models/<model>").chat_completion``
    calls, which sends ``model`` ``"dummy"`` (:data:`HF_NO_MODEL`) when given a URL. ``target``
    defaults to ``"auto"`` here, as on TGI's routes (that client sends no extra field).

    Raises:
        Rejected: reason ``invalid_model`` when the body's ``model`` names another model.
    """
    tgi.refuse_other_model(body.model, model, "/v1/chat/completions", also=(HF_NO_MODEL,))
    update: dict[str, Any] = {"model": model}
    if "target" not in body.model_fields_set:  # Hugging Face's clients send none: Auto, as on TGI's routes
        update["target"] = AUTO
    return await text.chat_completions(body.model_copy(update=update), ctx, request)
