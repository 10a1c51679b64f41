"""Hugging Face text-generation-inference's API: ``POST /generate``,
``POST /generate_stream`` and ``POST /`` (TGI's compatibility route: either, by ``stream``; what
``huggingface_hub.InferenceClient(base_url=...).text_generation`` calls), thin fronts over one
``text`` job each, through the OpenAI text routes' helpers (app/api/routes/text.py): the same
placement, idempotency of a client's retries, wait bound and backpressure.

Body: ``inputs`` (the prompt), ``parameters`` (TGI's names: ``max_new_tokens``, ``temperature``,
``top_p``, ``seed``, ``do_sample``, ``details``, ``return_full_text``, ``grammar``), and
Homefleet's extra top-level fields ``model`` (a registered text model; default: the first) and
``target`` (a machine or ``"auto"``, the default here: TGI's clients send no extra field, so
Auto places what they send; the OpenAI routes default to the server's own machine as the image
routes do). As in TGI, sampling is on when ``do_sample`` is true or
``temperature`` (not 1) or ``top_p`` (below 1) is given; else decoding is greedy.
``grammar`` (``{"type": "json", "value": <JSON schema>}``, ``{"type": "regex", "value": ...}`` or
``{"type": "json_schema", "value": {"name", "schema"}}``)
constrains the output (app/core/constraints.py); one that does not compile is a 422. ``stop``
(up to 4 sequences) ends the text before the first one generated (``finish_reason``
``stop_sequence``; the tokens' texts, streamed or in ``details``, end before it too: they join
into the cut ``generated_text``; ``details`` give each token its own text, the stream holds back
an ending that could still grow into a stop sequence until the next token). A TGI parameter
Homefleet does not run (``top_k``, ``repetition_penalty``…) is refused when set, and any other
field, top-level or in ``parameters``, is refused naming it (a misspelt ``paramters`` would drop
every parameter): TGI's serde ignores unknown fields, Homefleet never does.

Answers: ``{"generated_text", "details"?}``; ``details``: ``finish_reason`` (``eos_token`` or
``length``), ``generated_tokens``, ``seed`` (null when greedy), ``prefill`` (empty), ``tokens``
(``id``, ``text``, ``logprob``: natural log, ``special``). The stream: one SSE event per
generated token ``{"index", "token", "generated_text": null, "details": null}``, the last one with
``generated_text`` (the verified result, R2) and ``details`` (``finish_reason``,
``generated_tokens``, ``input_length``, ``seed``). Errors have TGI's shape
(app/api/openai_errors.py), in the stream too.

A request that accepts images only (``huggingface_hub``'s ``text_to_image`` and ``image_to_image``
on ``InferenceClient(base_url=SERVER)``) is refused from its headers, before its body is read
(:class:`TgiRoute`): these routes generate text; the image tasks are served under ``/hf``.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, Callable, Coroutine
from typing import Any

from anyio import to_thread
from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import ConfigDict, Field, ValidationError
from sse_starlette.sse import EventSourceResponse

from app.api.auth import request_key_id
from app.api.openai_errors import client_fields, tgi_error, tgi_validation_error
from app.api.routes.deps import Context
from app.api.routes.images import IMAGE_TO_IMAGE_KINDS, MAX_PROMPT_CHARS
from app.api.routes.text import (
    cancel_when_abandoned,
    ended_badly,
    follow,
    job_tokens,
    run_text_job,
    submit_text_job,
    text_of,
    usage_of,
)
from app.api.strict_json import StrictJsonRoute
from app.context import ServerContext
from app.core import constraints
from app.core.errors import HomefleetError, Rejected
from app.core.kinds import GREEDY_TEMPERATURE, MAX_NEW_TOKENS, greedy
from app.core.request_body import RequestBody, refuse_unknown, refuse_unsupported
from app.core.states import JobState
from app.core.textgen import MAX_STOP_SEQUENCES, TokenDecoder, stop_sequences
from app.db.tables import Job
from app.jobs.progress import Progress
from routing.placement import AUTO


def accepts_images_only(request: Request) -> bool:
    """Whether the request's ``Accept`` names image types only (``huggingface_hub``'s
    ``text_to_image`` and ``image_to_image`` send ``image/png``; ``text_generation`` sends none)."""
    types = [part.split(";")[0].strip().lower() for part in request.headers.get("accept", "").split(",")]
    types = [kind for kind in types if kind]
    return bool(types) and all(kind.startswith("image/") for kind in types)


IMAGE_TASK_KINDS = ("txt2img", *IMAGE_TO_IMAGE_KINDS)
"""The kinds the Hugging Face image tasks run (text-to-image's and image-to-image's,
app/api/routes/hf.py): the models a refused image request is pointed to."""


def image_request_refused(ctx: ServerContext, path: str, accept: str) -> Rejected:
    """The refusal of an image task sent to TGI's text route ``path`` (reason
    ``unsupported_kind``, param ``model``: 422 in TGI's shape): the message says that the route
    generates text and where the image tasks are served, naming the models in service that
    run them (``/hf/models/<model>``) and ``/hf`` (the first txt2img or edit model)."""
    models = [record.id for record in ctx.registry.list() if set(record.kinds) & set(IMAGE_TASK_KINDS)]
    where = ", ".join(f"/hf/models/{model}" for model in models) if models else "no model in service runs an image kind"
    return Rejected(
        f"POST {path} generates text (text-generation-inference's route), not an image (Accept: {accept}); "
        "text_to_image and image_to_image are served at POST /hf/models/<model>, e.g. "
        f'InferenceClient(base_url=SERVER + "/hf/models/<model>") ({where}), or at POST /hf, which runs '
        'the first model of the task; see docs/api.md, "OpenAI and Hugging Face routes"',
        reason="unsupported_kind",
        param="model",
    )


class TgiRoute(StrictJsonRoute):
    """A strict-JSON route (:class:`StrictJsonRoute`) that answers a request accepting images only
    with :func:`image_request_refused` in TGI's shape, from its headers, before its body is read:
    ``InferenceClient(base_url=SERVER).text_to_image`` posts its payload (or, for
    ``image_to_image`` without parameters, the image's bytes) to ``POST /``, where it met TGI's
    ``parameters`` refusal or a text model's defaults instead of being told where images are."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def refusing_images(request: Request) -> Response:
            if accepts_images_only(request):
                ctx: ServerContext = request.app.state.ctx
                refusal = await to_thread.run_sync(
                    image_request_refused, ctx, request.url.path, request.headers.get("accept", "")
                )
                return tgi_error(refusal)
            return await handler(request)

        return refusing_images


router = APIRouter(route_class=TgiRoute)

UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    name: (False, 0, 0.0, [], "")
    for name in (
        "top_k",
        "repetition_penalty",
        "frequency_penalty",
        "truncate",
        "typical_p",
        "watermark",
        "best_of",
        "top_n_tokens",
        "decoder_input_details",
        "adapter_id",
    )
}
"""TGI parameters Homefleet does not run: refused when set (not null, false, 0 or empty). With the
fields of :class:`Parameters` they are all of TGI's ``GenerateParameters``; any other key of
``parameters`` is refused too (TGI's serde ignores an unknown one; here a misspelt parameter is
never ignored)."""

CLIENT_FIELDS = {
    "max_new_tokens": "parameters.max_new_tokens",
    "prompt": "inputs",
    "grammar": "parameters.grammar",
    "stop": "parameters.stop",
    "seed": "parameters.seed",
    "temperature": "parameters.temperature",
    "top_p": "parameters.top_p",
}
"""A text job's params -> TGI's fields: a refusal's message names the client's field."""

FINISH_REASONS = {"stop": "eos_token", "length": "length"}
"""The text kind's finish reason -> TGI's (a stop sequence's: ``stop_sequence``, :func:`finish_reason`)."""


def finish_reason(usage: dict[str, Any]) -> str:
    """TGI's finish reason of a text job's usage: ``stop_sequence`` when a ``stop`` sequence
    ended it, else :data:`FINISH_REASONS`'s."""
    if usage.get("stop_sequence") is not None:
        return "stop_sequence"
    return FINISH_REASONS.get(usage.get("finish_reason", "length"), "length")


class Parameters(RequestBody):
    """TGI's ``parameters`` (TGI's others are refused when set: :data:`UNSUPPORTED`; any other key
    is refused naming it)."""

    model_config = ConfigDict(extra="allow", json_schema_extra={"additionalProperties": False})

    max_new_tokens: int | None = Field(None, ge=1, le=MAX_NEW_TOKENS, description="new tokens at most; default 16")
    temperature: float | None = Field(
        None,
        gt=0.0,
        le=2.0,
        allow_inf_nan=False,
        description=f"above 0 as in TGI; below {GREEDY_TEMPERATURE:g}: greedy",
    )
    top_p: float | None = Field(None, gt=0.0, le=1.0, allow_inf_nan=False)
    seed: int | None = Field(None, ge=0, lt=2**63)
    do_sample: bool = Field(False, description="sample (seeded); false: greedy unless temperature or top_p is set")
    details: bool = Field(False, description="answer details: finish reason, token counts, tokens, seed")
    return_full_text: bool | None = Field(False, description="prepend the prompt to generated_text")
    stop: list[str] | None = Field(
        None,
        description=f"up to {MAX_STOP_SEQUENCES} sequences: the text ends before "
        "the first one generated (finish_reason stop_sequence)",
    )
    grammar: dict[str, Any] | None = Field(
        None,
        description='{"type": "json", "value": <JSON schema>}, {"type": "regex", "value": "<regex>"} or '
        '{"type": "json_schema", "value": {"name", "schema"}}',
    )

    def sampling(self) -> bool:
        """Whether decoding samples (TGI's rule: ``do_sample``, or a temperature or top_p that changes the
        distribution)."""
        return (
            self.do_sample
            or (self.temperature is not None and self.temperature != 1.0)
            or (self.top_p is not None and self.top_p < 1.0)
        )

    def job_params(self, inputs: str) -> dict[str, Any]:
        """The text job's params.

        Raises:
            Rejected: reason ``unknown_param``: a parameter of :data:`UNSUPPORTED` is set, or a
                key that is no TGI parameter (a misspelt one), naming it.
        """
        refuse_unsupported(
            self.model_extra or {}, UNSUPPORTED, type(self).model_fields, "TGI's `parameters`", prefix="parameters."
        )
        params: dict[str, Any] = {"prompt": inputs}
        if self.max_new_tokens is not None:
            params["max_new_tokens"] = self.max_new_tokens
        if self.sampling():
            params["temperature"] = self.temperature if self.temperature is not None else 1.0
            if self.top_p is not None:
                params["top_p"] = self.top_p
        else:
            params["temperature"] = 0.0
        if self.seed is not None:
            params["seed"] = self.seed
        try:
            stops = stop_sequences(self.stop)
        except ValueError as error:
            raise Rejected(f"`parameters.stop` {error}", reason="invalid_stop", param="parameters.stop") from error
        if stops:
            params["stop"] = stops
        try:
            grammar = constraints.from_tgi_grammar(self.grammar)
        except constraints.FormatRefused as error:
            field = f"parameters.grammar{error.field}"
            raise Rejected(f"`{field}` {error}", reason="invalid_grammar", param=field) from error
        if grammar is not None:
            params["grammar"] = grammar
        return params


class Generate(RequestBody):
    """``POST /generate``, ``/generate_stream`` and ``/``: TGI's ``GenerateRequest`` with
    Homefleet's ``model`` and ``target``. Any other top-level field (a misspelt ``paramters``,
    whose parameters would all be dropped) is refused naming it (:meth:`check`)."""

    model_config = ConfigDict(extra="allow", json_schema_extra={"additionalProperties": False})

    inputs: str = Field(min_length=1, max_length=MAX_PROMPT_CHARS * 8)  # as /v1/completions: within max_request_bytes
    parameters: Parameters = Field(default_factory=Parameters)
    stream: bool = Field(False, description="POST / only: answer as /generate_stream does")
    model: str | None = Field(
        None, min_length=1, max_length=64, description="Homefleet extra: registered text model id"
    )
    target: str = Field(AUTO, min_length=1, max_length=32, description="Homefleet extra: machine or 'auto' (default)")

    def check(self) -> dict[str, Any]:
        """The text job's params, once every field has been checked (before anything is submitted).

        Raises:
            Rejected: reason ``unknown_param`` for a top-level field TGI's request does not have
                (:func:`app.core.request_body.refuse_unknown`) or a parameter as
                :meth:`Parameters.job_params` refuses it.
        """
        refuse_unknown(list(self.model_extra or {}), type(self).model_fields, "TGI's request")
        return self.parameters.job_params(self.inputs)


def token_entry(decoder: TokenDecoder, token: int, logprob: float | None, last: bool = False) -> dict[str, Any]:
    """TGI's token object of ``token``: its share of the decoded text (:class:`TokenDecoder`)."""
    return {
        "id": token,
        "text": decoder.add(token, last),
        "logprob": logprob if logprob is not None else 0.0,
        "special": decoder.special(token),
    }


def seed_of(job: Job) -> int | None:
    """The seed a sampled job ran with (None for greedy decoding, as TGI answers)."""
    params = job.params or {}
    sampled = not greedy(float(params.get("temperature", 0.0) or 0.0))
    return int(params["seed"]) if sampled and "seed" in params else None


async def generate_once(body: Generate, ctx: Any, request: Request) -> dict[str, Any]:
    """One text job, waited for: TGI's ``generate`` answer (module docstring)."""
    params = body.parameters.job_params(body.inputs)
    job, text, usage = await run_text_job(ctx, request, body.model_dump(mode="json"), body.model, params, body.target)
    answer: dict[str, Any] = {"generated_text": body.inputs + text if body.parameters.return_full_text else text}
    if body.parameters.details:
        stops = (job.params or {}).get("stop") or ()
        decoder = await to_thread.run_sync(ctx.dispatcher.validator.tokenizers.decoder, job.model_id, stops, False)
        ids, logprobs = job_tokens(job)  # hold=False: the job has ended
        entries = [
            token_entry(decoder, token, logprobs[i] if i < len(logprobs) else None, last=i == len(ids) - 1)
            for i, token in enumerate(ids)
        ]
        answer["details"] = {
            "finish_reason": finish_reason(usage),
            "generated_tokens": int(usage.get("completion_tokens", len(ids))),
            "seed": seed_of(job),
            "prefill": [],
            "tokens": entries,
        }
    answer["job_id"] = job.id
    return answer


async def generate_stream_answer(body: Generate, ctx: Any, api_key_id: str | None = None) -> Any:
    """One text job of API key ``api_key_id``, submitted now (a refusal is a plain error),
    answered as TGI's event stream."""
    params = body.parameters.job_params(body.inputs)
    job_id, model = await submit_text_job(ctx, body.model, params, body.target, api_key_id)
    decoder = await to_thread.run_sync(ctx.dispatcher.validator.tokenizers.decoder, model, params.get("stop") or ())

    async def events() -> AsyncGenerator[str, None]:
        sent = 0  # tokens sent; the newest reported one is held back: the last event carries the last token

        def event(token: dict[str, Any], text: str | None = None, details: dict[str, Any] | None = None) -> str:
            return json.dumps(
                {
                    "index": sent,
                    "token": token,
                    "generated_text": text,
                    "details": details,
                    "top_tokens": None,
                    "job_id": job_id,
                }
            )

        async for update in follow(ctx, job_id):
            if isinstance(update, Progress):
                ids, logprobs = update.tokens or [], update.logprobs or []
                while sent < len(ids) - 1:
                    sent += 1
                    yield event(
                        token_entry(decoder, ids[sent - 1], logprobs[sent - 1] if sent <= len(logprobs) else None)
                    )
                continue
            job = update
            if job.state != JobState.succeeded:
                yield json.dumps(
                    {"error": ended_badly(job), "error_type": "generation", "reason": job.reason, "job_id": job_id}
                )
                return
            final = await to_thread.run_sync(text_of, job)
            ids, logprobs = job_tokens(job)
            while sent < len(ids) - 1:
                sent += 1
                yield event(token_entry(decoder, ids[sent - 1], logprobs[sent - 1] if sent <= len(logprobs) else None))
            usage = usage_of(job)
            last = ids[-1] if ids else -1
            rest = final[len(decoder.sent) :] if final.startswith(decoder.sent) else ""  # the verified text's end (R2)
            sent += 1
            details = {
                "finish_reason": finish_reason(usage),
                "generated_tokens": int(usage.get("completion_tokens", len(ids))),
                "input_length": int(usage.get("prompt_tokens", 0)),
                "seed": seed_of(job),
            }
            token = {
                "id": last,
                "text": rest,
                "logprob": logprobs[-1] if logprobs else 0.0,
                "special": decoder.special(last),
            }
            yield event(token, body.inputs + final if body.parameters.return_full_text else final, details)

    return EventSourceResponse(
        cancel_when_abandoned(ctx, [job_id], events()),  # a client that leaves cancels its job
        headers={"x-should-retry": "false", "x-homefleet-job-id": job_id},
    )


def refuse_other_model(named: str | None, model: str, elsewhere: str, also: tuple[str, ...] = ()) -> None:
    """Refuse a body whose ``model`` (``named``) is not the path's ``model``: none, ``also``'s
    (a placeholder a client sends) or the path's own is taken.

    Raises:
        Rejected: reason ``invalid_model``, naming both and ``elsewhere``, the route that picks
            the model from the body.
    """
    if named not in (None, model, *also):
        raise Rejected(
            f"`model` names {named!r} but the path runs {model!r}; leave `model` out of the body "
            f"(or post to {elsewhere} to pick the model in the body)",
            reason="invalid_model",
            param="model",
        )


async def answer_for_model(model: str, raw: Any, ctx: Any, request: Request) -> Response:
    """TGI's ``POST /`` for the text model ``model``, whatever the body names: what
    ``POST /hf/models/{model}`` answers when ``model`` runs text (app/api/routes/hf.py), so that
    ``InferenceClient(base_url=".../hf/models/<model>").text_generation`` picks its model.
    ``raw`` is the parsed JSON body. Every error is answered in TGI's shape (422 ``validation``
    for a body :class:`Generate` refuses or a ``model`` field naming another model).
    """
    try:
        try:
            body = Generate.model_validate(raw)
        except ValidationError as error:
            raise RequestValidationError(
                [{**detail, "loc": ("body", *detail["loc"])} for detail in error.errors(include_url=False)]
            ) from error
        refuse_other_model(body.model, model, "/")
        body.model = model
        body.check()
        with client_fields(CLIENT_FIELDS):
            if body.stream:
                answer: Response = await generate_stream_answer(body, ctx, request_key_id(request))
                return answer
            return JSONResponse(await generate_once(body, ctx, request))
    except RequestValidationError as error:
        return tgi_validation_error(error)
    except HomefleetError as error:
        return tgi_error(error)


@router.post("/generate", response_model=None)
async def generate(body: Generate, ctx: Context, request: Request) -> Any:
    """TGI ``generate``: 200 ``{"generated_text"[, "details"]}`` once the job has succeeded; 422
    (``error_type: validation``) for the token limits (``max_input_tokens``,
    ``max_total_tokens``) or a grammar that does not compile; 409 ``job_pending``
    (``incomplete_generation``) when the wait bound ran out, as the image routes (C10)."""
    body.check()  # refuse unknown fields and unsupported parameters before anything is submitted
    with client_fields(CLIENT_FIELDS):
        return JSONResponse(await generate_once(body, ctx, request))


@router.post(
    "/generate_stream",
    response_model=None,
    response_class=EventSourceResponse,
    responses={
        200: {
            "description": "Server-Sent Events, one per generated token",
            "content": {"text/event-stream": {"schema": {"type": "string"}}},
        }
    },
)
async def generate_stream(body: Generate, ctx: Context, request: Request) -> Any:
    """TGI ``generate_stream``: Server-Sent Events, one per generated token, the last with
    ``generated_text`` and ``details``."""
    body.check()
    with client_fields(CLIENT_FIELDS):
        return await generate_stream_answer(body, ctx, request_key_id(request))


@router.post(
    "/",
    response_model=None,
    responses={
        200: {
            "description": "the generated text (JSON), or with ``stream`` Server-Sent Events",
            "content": {"text/event-stream": {"schema": {"type": "string"}}},
        }
    },
)
async def compat_generate(body: Generate, ctx: Context, request: Request) -> Any:
    """TGI's root route (``huggingface_hub``'s ``text_generation`` calls it): :func:`generate`,
    or :func:`generate_stream` when ``stream`` is true."""
    body.check()
    with client_fields(CLIENT_FIELDS):
        if body.stream:
            return await generate_stream_answer(body, ctx, request_key_id(request))
        return JSONResponse(await generate_once(body, ctx, request))
