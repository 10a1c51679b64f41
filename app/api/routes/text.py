"""OpenAI-compatible text generation: ``POST /v1/completions`` and
``POST /v1/chat/completions``, thin fronts over one ``text`` job each (docs/api.md, "OpenAI and
Hugging Face routes").

The body's ``model`` names a registered text model (default: the first); ``max_tokens``
(``max_completion_tokens`` for chat) becomes ``max_new_tokens``, ``temperature`` and ``top_p``
pass through, ``seed`` too; ``target`` (a machine or ``"auto"``) is Homefleet's extra field
(the SDKs' ``extra_body``). A chat's ``messages`` go through the model's own chat template on
the server (app/jobs/validation.py ``Validator.chat_prompt``), so the prompt's tokens are
counted and checked against ``max_input_tokens`` / ``max_total_tokens`` before any device (R22).

Placement, idempotency of a client's retries and the wait bound are the image routes' (C10,
app/api/routes/images.py ``run_jobs``): the request waits for its job at most ``images_wait_s``
or the client's announced timeout, then answers 409 ``job_pending`` naming it. Errors have
OpenAI's shape.

``stream: true`` answers Server-Sent Events (sse-starlette) once the job is submitted (a refusal
is still a plain error): OpenAI's chunks (``text_completion`` / ``chat.completion.chunk``), each
carrying the text generated since the last (the worker reports the text so far with each
token's progress, app/jobs/progress.py), then a last chunk with ``finish_reason`` and
``usage`` (with ``stream_options.include_usage``, the usage in a chunk of its own after it,
OpenAI's shape), then ``data: [DONE]``. The last text comes from the verified result (R2). A client
that disconnects stops its stream and cancels its jobs (:func:`cancel_when_abandoned`).

``response_format`` constrains the output in every form the SDKs send (OpenAI's ``json_schema``
and ``json_object``, huggingface_hub's and TGI's ``json_object`` / ``json`` with ``value``,
``regex``: :func:`app.core.constraints.from_response_format`; one it cannot honour is refused
naming the field, never dropped), enforced while decoding (app/core/constraints.py, llguidance); a schema that does
not compile is refused ``invalid_grammar`` before any device.

A refusal is 400 with OpenAI's error shape, as OpenAI answers it (app/api/openai_errors.py
``OPENAI_INVALID_STATUS``); a prompt over the context is OpenAI's ``context_length_exceeded``.
A request leaves out ``temperature``: OpenAI's 1 (:data:`OPENAI_TEMPERATURE`), unless the
model's own defaults set one.

The helpers here (:func:`run_text_job`, :func:`submit_text_job`, :func:`follow`) are the one
home of a text request's way through a job; the TGI routes (app/api/routes/tgi.py) are fronts
over them too.

``stop`` (a string or up to 4): generation ends once the decoded text holds one, the text cut
before it (``finish_reason`` ``stop``); a stream never sends text past it. ``n`` (at most
:data:`MAX_CHOICES`): n text jobs submitted as one call (a retried request gets them all, C10),
job i seeded ``seed + i`` when a seed is given; choice i is job i's text.

A field the route does not take is refused naming it (400 ``unknown_param``, OpenAI's
"Unrecognized request argument supplied"), never ignored: a misspelt ``max_tokenz`` would run with
the default. OpenAI fields Homefleet does not run (``logprobs``, ``tools``, ``tool_choice``,
``frequency_penalty``, ``logit_bias``, ``suffix``, ``echo``, ``best_of``…: :data:`CHAT_UNSUPPORTED`,
:data:`COMPLETION_UNSUPPORTED`) are accepted only at a value that changes nothing (null, ``0``,
``false``, ``[]``…).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any, ClassVar

import anyio
from anyio import to_thread
from fastapi import APIRouter, Request
from pydantic import ConfigDict, Field, field_validator, model_validator

from app.api.auth import request_key_id
from app.api.openai_errors import client_fields
from app.api.routes.deps import Context, result_file
from app.api.routes.images import (
    MAX_PROMPT_CHARS,
    ImageCall,
    model_or_default,
    run_jobs,
    submitted,
)
from app.api.strict_json import StrictJsonRoute
from app.core import constraints
from app.core.errors import Conflict, NotFound, Rejected
from app.core.kinds import CHAT_SHOWN_PARAM, GREEDY_TEMPERATURE, MAX_NEW_TOKENS, nth_seed
from app.core.request_body import ANY_VALUE, RequestBody, refuse_unsupported
from app.core.states import ENDED, JobState
from app.core.textgen import MAX_STOP_SEQUENCES, ChatRole, TokenDecoder, safe_to_send, stop_sequences
from app.db.tables import Job
from app.jobs.progress import Progress
from routing.placement import SERVER

router = APIRouter(route_class=StrictJsonRoute)
log = logging.getLogger(__name__)

KIND = "text"
CLIENT_FIELDS = {
    "max_new_tokens": "max_tokens",
    "prompt": "prompt",
    "grammar": "response_format",
    "stop": "stop",
    "seed": "seed",
    "temperature": "temperature",
    "top_p": "top_p",
}
"""A text job's params -> the OpenAI fields they come from: a refusal names the client's field
(app/api/openai_errors.py ``renamed``); a chat's prompt is its ``messages``."""
OPENAI_TEMPERATURE = 1.0
"""A request's ``temperature`` when it sends none: OpenAI's default (and TGI's chat route's), so
``n``, ``seed`` and ``top_p`` change the answer as they do there; 0 asks for greedy decoding.
(A text job of ``POST /v1/jobs`` and TGI's ``/generate`` decode greedily unless asked.)"""
MAX_CHOICES = 8
"""A request's ``n`` at most: n text jobs, submitted as one call (C10: a retried request gets them all)."""
OPENAI_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "frequency_penalty": (0, 0.0),
    "presence_penalty": (0, 0.0),
    "logit_bias": ({},),
    "user": (ANY_VALUE,),  # labels the caller; changes no answer (many client libraries send it)
    "metadata": (ANY_VALUE,),
    "safety_identifier": (ANY_VALUE,),
    "prompt_cache_key": (ANY_VALUE,),
}
"""OpenAI fields of both text routes that Homefleet does not run -> the values that change nothing
(null too): accepted at those, else refused naming the field (``unknown_param``); never ignored."""
COMPLETION_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    **OPENAI_UNSUPPORTED,
    "suffix": ("",),
    "echo": (False,),
    "best_of": (1,),
}
""":data:`OPENAI_UNSUPPORTED` of ``POST /v1/completions``."""
CHAT_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    **OPENAI_UNSUPPORTED,
    "tools": ([],),
    "tool_choice": ("none",),
    "functions": ([],),
    "function_call": ("none",),
    "parallel_tool_calls": (True, False),  # OpenAI's default true: with no tools, no effect
    "modalities": (["text"],),
    "audio": (),
    "prediction": (),
    "store": (False,),
    "service_tier": ("auto", "default"),  # OpenAI's default "auto"
    "reasoning_effort": (),
    "verbosity": (),
    "web_search_options": (),
    "prompt_cache_options": (),
    "prompt_cache_retention": (),
    "moderation": (),
    "tool_prompt": (),  # huggingface_hub's, beside tools
}
""":data:`OPENAI_UNSUPPORTED` of ``POST /v1/chat/completions``."""


class StreamOptions(RequestBody):
    """OpenAI's ``stream_options``: ``include_usage`` sends the usage in a last chunk of its own,
    with no choices (OpenAI's shape); its other options are ignored."""

    model_config = ConfigDict(extra="ignore")

    include_usage: bool | None = None


class Sampling(RequestBody):
    """The sampling fields both routes share (OpenAI's names). Any other field is refused naming
    it (:meth:`params`), as OpenAI refuses an unrecognized argument: a misspelt ``max_tokenz``
    never runs with the default; an OpenAI field Homefleet does not run (:attr:`UNSUPPORTED`) is
    accepted only at a value that changes nothing."""

    model_config = ConfigDict(extra="allow", json_schema_extra={"additionalProperties": False})

    ROUTE: ClassVar[str] = "Homefleet's text routes"
    UNSUPPORTED: ClassVar[dict[str, tuple[Any, ...]]] = OPENAI_UNSUPPORTED

    model: str | None = Field(
        None, min_length=1, max_length=64, description="registered text model id; default: the first"
    )
    max_tokens: int | None = Field(
        None,
        ge=1,
        le=MAX_NEW_TOKENS,
        description="new tokens at most (max_new_tokens); default: the model's default, else for a chat the rest "
        "of the context, else 16, each at most the rest of the context",
    )
    temperature: float | None = Field(
        None,
        ge=0.0,
        le=2.0,
        allow_inf_nan=False,
        description=f"default {OPENAI_TEMPERATURE:g}, as OpenAI's; 0 (any below {GREEDY_TEMPERATURE:g}): greedy",
    )
    top_p: float | None = Field(None, gt=0.0, le=1.0, allow_inf_nan=False)
    seed: int | None = Field(None, ge=0, lt=2**63)
    n: int = Field(
        1,
        ge=1,
        le=MAX_CHOICES,
        description=f"choices, one text job each (at most {MAX_CHOICES}); with a seed, choice i runs with seed + i",
    )
    stop: str | list[str] | None = Field(
        None,
        description=f"up to {MAX_STOP_SEQUENCES} sequences: the text ends "
        "before the first one generated (finish_reason stop)",
    )
    stream: bool = Field(False, description="Server-Sent Events of the text as it is generated")
    stream_options: StreamOptions | None = Field(
        None,
        description="include_usage: the usage in a last chunk with no choices; without it the finish "
        "chunk carries it (one choice) or a last chunk their sum (n > 1)",
    )
    target: str = Field(SERVER, min_length=1, max_length=32, description="Homefleet extra: machine or 'auto'")
    response_format: dict[str, Any] | None = Field(
        None,
        description='{"type": "json_schema", "json_schema": {"name", "schema": {...}}}, {"type": "json_object"}'
        ' (optionally with its schema as "value"), TGI\'s {"type": "json" | "regex", "value": ...} '
        'or {"type": "text"}: the output is constrained while decoding (llguidance)',
    )

    @model_validator(mode="before")
    @classmethod
    def _null_is_not_given(cls, data: Any) -> Any:
        """A field sent as null takes its default, as OpenAI's schema allows null for every
        optional field (``"n": null``, ``"stream": null``)."""
        if isinstance(data, dict):
            return {key: value for key, value in data.items() if value is not None or key not in cls.model_fields}
        return data

    def wants_logprobs(self) -> bool:
        """Whether the answer carries each generated token's log probability (``logprobs``)."""
        return False

    def params(self, max_tokens: int | None = None) -> dict[str, Any]:
        """The job's sampling params (absent fields: the text kind's defaults), with ``grammar``
        from ``response_format``.

        Raises:
            Rejected: reason ``unknown_param`` for a field the route does not take, or a field of
                :attr:`UNSUPPORTED` at a value that would change the answer, naming it
                (:func:`app.core.request_body.refuse_unsupported`); a malformed
                ``response_format`` (reason ``invalid_response_format``); ``stream_options``
                without ``stream`` (reason ``invalid_stream_options``).
        """
        refuse_unsupported(self.model_extra or {}, self.UNSUPPORTED, type(self).model_fields, self.ROUTE)
        if self.stream_options is not None and not self.stream:  # OpenAI refuses it so too
            raise Rejected(
                "`stream_options` is only allowed with `stream: true`",
                reason="invalid_stream_options",
                param="stream_options",
            )
        params: dict[str, Any] = {}
        try:
            grammar = constraints.from_response_format(self.response_format)
        except constraints.FormatRefused as error:
            field = f"response_format{error.field}"
            raise Rejected(f"`{field}` {error}", reason="invalid_response_format", param=field) from error
        if grammar is not None:
            params["grammar"] = grammar
        try:
            stops = stop_sequences(self.stop)
        except ValueError as error:
            raise Rejected(f"`stop` {error}", reason="invalid_stop", param="stop") from error
        if stops:
            params["stop"] = stops
        new = max_tokens if max_tokens is not None else self.max_tokens
        for name, value in (
            ("max_new_tokens", new),
            ("temperature", self.temperature),
            ("top_p", self.top_p),
            ("seed", self.seed),
        ):
            if value is not None:
                params[name] = value
        return params


class Completion(Sampling):
    """``POST /v1/completions``: ``prompt`` (one string)."""

    ROUTE: ClassVar[str] = "POST /v1/completions"
    UNSUPPORTED: ClassVar[dict[str, tuple[Any, ...]]] = COMPLETION_UNSUPPORTED

    logprobs: int | None = Field(
        None,
        ge=0,
        le=0,
        description="0: each generated token's log probability in the choice's logprobs (legacy shape); "
        "alternatives (above 0) are not served",
    )

    def wants_logprobs(self) -> bool:
        return self.logprobs is not None

    prompt: str = Field(
        min_length=1, max_length=MAX_PROMPT_CHARS * 8
    )  # 4 bytes a character at most: within max_request_bytes


class ChatMessage(RequestBody):
    """One chat message: ``role`` and ``content``, a string or OpenAI's list of content parts, of
    which these text models take the text ones (``{"type": "text", "text": ...}``), joined with
    newlines as vLLM joins them. Any other part (``image_url``, ``input_audio``, ``file``) is
    refused naming ``messages.N.content``: a text model cannot see it. ``name`` (OpenAI's
    participant name) goes to the chat template with the message, which may use it. The fields an
    earlier answer's assistant message carries when a client sends it back as history (the SDK's
    ``model_dump()``: ``refusal``, ``audio``, ``function_call`` null, ``annotations`` and
    ``tool_calls`` empty or null; huggingface_hub's: ``reasoning``, ``tool_call_id`` null) are
    taken; a tool call is refused naming it; any other field is refused naming
    ``messages.N.<field>``, never ignored."""

    model_config = ConfigDict(extra="forbid")

    role: ChatRole
    content: str = Field(max_length=MAX_PROMPT_CHARS * 32)
    name: str | None = Field(None, min_length=1, max_length=64, description="the participant's name")
    refusal: None = Field(None, description="an earlier answer's (always null here)")
    audio: None = None
    function_call: None = None
    annotations: list[Any] | None = Field(None, max_length=0, description="an earlier answer's (empty)")
    tool_calls: list[Any] | None = Field(None, max_length=0, description="tool calls are not run here")
    tool_call_id: None = None
    reasoning: None = Field(None, description="huggingface_hub's answer message carries it (null)")
    reasoning_content: None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts(cls, value: object) -> object:
        if not isinstance(value, list):
            return value
        texts = []
        for index, part in enumerate(value):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text" or not isinstance(part.get("text"), str):
                shown = repr(kind) if isinstance(kind, str) else type(part).__name__
                raise ValueError(
                    f"part {index} is not a text part ({{'type': 'text', 'text': str}}), got {shown[:64]}: "
                    "a text model reads text only"
                )
            unknown = sorted(str(key) for key in part if key not in ("type", "text"))
            if unknown:  # refused, as a message's unknown field is: never dropped unread
                raise ValueError(
                    f"part {index} has a field a text part does not take: {unknown[0][:64]!r} "
                    "(a text part is {'type': 'text', 'text': str})"
                )
            texts.append(part["text"])
        return "\n".join(texts)

    def for_template(self) -> dict[str, str]:
        """The message as the chat template reads it: ``role``, ``content`` and ``name`` if given."""
        return {"role": self.role, "content": self.content, **({"name": self.name} if self.name else {})}


class ChatCompletion(Sampling):
    """``POST /v1/chat/completions``: ``messages`` (``role``, text ``content``)."""

    ROUTE: ClassVar[str] = "POST /v1/chat/completions"
    UNSUPPORTED: ClassVar[dict[str, tuple[Any, ...]]] = CHAT_UNSUPPORTED

    messages: list[ChatMessage] = Field(min_length=1, max_length=1024)
    max_completion_tokens: int | None = Field(
        None, ge=1, le=MAX_NEW_TOKENS, description="OpenAI's newer name of max_tokens"
    )
    logprobs: bool | None = Field(None, description="each generated token's log probability in logprobs.content")
    top_logprobs: int | None = Field(None, ge=0, le=0, description="alternatives are not served: 0 or null")

    def wants_logprobs(self) -> bool:
        return bool(self.logprobs)


def usage_of(job: Job) -> dict[str, Any]:
    """The job's journaled usage (tasks/kinds/text.py): token counts and finish reason."""
    return dict((job.provenance or {}).get("usage") or {})


def text_of(job: Job) -> str:
    """The job's result: UTF-8 text, verified by digest when it was stored (R2).

    Raises:
        NotFound: ``result_missing`` when its file is gone (:func:`app.api.routes.deps.result_file`).
    """
    return result_file(job).read_bytes().decode("utf-8")


def _usage(usage: dict[str, Any]) -> dict[str, int]:
    return {name: int(usage.get(name, 0)) for name in ("prompt_tokens", "completion_tokens", "total_tokens")}


def usage_total(usages: list[dict[str, Any]]) -> dict[str, int]:
    """The usage of a request's ``n`` choices, as OpenAI counts it: the prompt's tokens once (every
    choice's job reads the same prompt), the choices' completion tokens summed, and their total."""
    prompt = _usage(usages[0])["prompt_tokens"] if usages else 0
    completion = sum(_usage(usage)["completion_tokens"] for usage in usages)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


async def run_text_job(
    ctx: Any, request: Request, fields: dict[str, Any], model: str | None, params: dict[str, Any], target: str
) -> tuple[Job, str, dict[str, Any]]:
    """Submit one text job (``params``) for the request whose canonical body is ``fields`` (or
    take a retried call's job: C10), wait for it as the image routes do, and read it: the job,
    its verified text and its journaled usage. ``model`` None: the first text model."""
    (answer,) = await run_text_jobs(ctx, request, fields, model, params, target, 1)
    return answer


async def run_text_jobs(
    ctx: Any,
    request: Request,
    fields: dict[str, Any],
    model: str | None,
    params: dict[str, Any],
    target: str,
    count: int,
) -> list[tuple[Job, str, dict[str, Any]]]:
    """:func:`run_text_job` for ``count`` choices: ``count`` text jobs submitted as one call
    (a retried request gets them all, C10), job i seeded ``seed + i`` when a seed is given;
    each (job, verified text, usage), in order."""
    call = ImageCall.of(request, ctx.settings.images_wait_s, fields)
    chosen = await model_or_default(ctx, model, KIND, target=target)
    jobs = await run_jobs(ctx, call, chosen, params, target, count, kind=KIND, seed_step=True)
    answers = []
    with submitted([job.id for job in jobs]):
        for job in jobs:
            answers.append((job, await to_thread.run_sync(text_of, job), usage_of(job)))
    return answers


async def submit_text_job(
    ctx: Any, model: str | None, params: dict[str, Any], target: str, api_key_id: str | None = None
) -> tuple[str, str]:
    """Submit one text job now, for a streaming answer: (job id, model id); a job of API key
    ``api_key_id`` (its quota applies). A refusal raises (answered as a plain error before any
    stream starts)."""
    chosen = await model_or_default(ctx, model, KIND, target=target)
    submission = await to_thread.run_sync(
        lambda: ctx.dispatcher.submit(chosen, KIND, params, target, api_key_id=api_key_id)
    )
    return str(submission.job.id), chosen


async def follow(ctx: Any, job_id: str) -> AsyncIterator[Progress | Job]:
    """A text job as it runs: each new progress report (its text, token ids and logprobs so
    far), then the ended job (last), woken by the job's changes (app/jobs/waiting.py). A client
    that disconnects stops the iteration (and a stream's :func:`cancel_when_abandoned` its job)."""
    async for change in ctx.waiting.follow(job_id):
        if isinstance(change, Progress) or change.state in ENDED:
            yield change


class Logprobs:
    """A choice's ``logprobs`` in OpenAI's shape, from the ids and natural-log probabilities the
    worker reports (``provenance.tokens`` / ``provenance.logprobs``, or a progress report's so
    far): a chat's ``{"content": [{"token", "logprob", "bytes", "top_logprobs": []}]}``, a
    completion's ``{"tokens", "token_logprobs", "top_logprobs": null, "text_offset"}``. Each token's
    text is its share of the answer (:class:`app.core.textgen.TokenDecoder` with the job's
    ``stops``: a token inside a UTF-8 character has the empty string, special tokens and the
    tokens of a stop sequence too, and the last token of an ended job any unfinished character),
    so the texts join into the answer. :meth:`more` gives the entries of the tokens not given yet
    (a stream's chunk; ``hold``: a stream, whose text waits while it could grow into a stop
    sequence, and its tokens' texts with it)."""

    def __init__(self, decoder: TokenDecoder, chat: bool) -> None:
        self.decoder = decoder
        self.chat = chat
        self.given = 0
        self.offset = 0

    def more(self, ids: list[int], logprobs: list[float], ended: bool = False) -> dict[str, Any] | None:
        """The entries of ``ids[given:]`` (None when there is none); ``ended``: ``ids`` are the
        ended job's, its last token the answer's last."""
        fresh = list(zip(ids[self.given :], logprobs[self.given :], strict=False))
        if not fresh:
            return None
        self.given += len(fresh)
        last = self.given - 1 if ended and self.given == len(ids) else -1
        start = self.given - len(fresh)
        texts = [self.decoder.add(token, last=start + i == last) for i, (token, _) in enumerate(fresh)]
        if self.chat:
            return {
                "content": [
                    {"token": text, "logprob": logprob, "bytes": list(text.encode()), "top_logprobs": []}
                    for text, (_, logprob) in zip(texts, fresh, strict=True)
                ]
            }
        offsets = []
        for text in texts:
            offsets.append(self.offset)
            self.offset += len(text)
        return {
            "tokens": texts,
            "token_logprobs": [logprob for _, logprob in fresh],
            "top_logprobs": None,
            "text_offset": offsets,
        }


def job_tokens(job: Job) -> tuple[list[int], list[float]]:
    """The job's generated token ids and their natural-log probabilities (its provenance)."""
    provenance = job.provenance or {}
    return [int(t) for t in provenance.get("tokens") or []], [float(p) for p in provenance.get("logprobs") or []]


def cancel_unended(ctx: Any, job_ids: list[str]) -> None:
    """Ask each of ``job_ids`` that has not ended to stop (``POST /v1/jobs/{id}/cancel``'s way:
    a queued one is cancelled at once, a running one stops between steps)."""
    for job_id in job_ids:
        try:
            job = ctx.dispatcher.request_cancel(job_id)
        except (Conflict, NotFound):
            continue  # it ended meanwhile
        log.info("job %s: its stream's client went away before the end; cancel requested (%s)", job_id, job.state)


async def cancel_when_abandoned(ctx: Any, job_ids: list[str], events: AsyncGenerator[str, None]) -> AsyncIterator[str]:
    """``events`` (a stream's SSE data), ending its jobs when the stream ends before them: a client
    that closes its stream (the SDKs' ``stream.close()``, a dropped connection) gets its jobs
    cancelled, as OpenAI-compatible and TGI servers abort a generation whose client left, so the
    machine takes its next job instead of generating text no one reads (:func:`cancel_unended`).
    A stream that reached its end, or an error event, cancels nothing."""
    finished = False
    try:
        async for event in events:
            yield event
        finished = True
    finally:
        with anyio.CancelScope(shield=True):  # the disconnect cancels this task: the cancel must still run
            await events.aclose()
            if not finished:
                await to_thread.run_sync(cancel_unended, ctx, job_ids)


def ended_badly(job: Job) -> str:
    """The message of a text job that ended without succeeding."""
    return f"job {job.id} ended {job.state}: {job.reason}: {job.message}"


async def stream_text(
    ctx: Any,
    body: Sampling,
    prompt: str,
    chat: bool,
    max_tokens: int | None = None,
    api_key_id: str | None = None,
    user_message: str | None = None,
) -> Any:
    """Submit the request's ``n`` text jobs now, jobs of API key ``api_key_id`` (a refusal of the
    first raises: a plain error; of a later one: an error naming the jobs submitted) and answer
    their texts as SSE chunks, choice after choice (``index``). No text past a ``stop``
    sequence is sent (:func:`app.core.textgen.safe_to_send`). A chat choice's first delta
    carries its ``role``, as OpenAI's do, also when that is its finish (a stop sequence at
    once). With ``stream_options.include_usage`` a last chunk without choices carries the usage
    (OpenAI's shape); without it, with ``n`` 1 the finish chunk carries ``usage``, with more a
    last chunk without choices their sum."""
    from sse_starlette.sse import EventSourceResponse

    model = await model_or_default(ctx, body.model, KIND, chat=chat, target=body.target)
    params = await to_thread.run_sync(
        with_openai_temperature, ctx, model, text_params(prompt, chat, user_message, body, max_tokens)
    )
    stops = list(params.get("stop") or [])
    job_ids: list[str] = []
    with submitted(job_ids):
        for index in range(body.n):
            each = {**params, "seed": nth_seed(params["seed"], index)} if "seed" in params else params
            job_id, model = await submit_text_job(ctx, model, each, body.target, api_key_id)
            job_ids.append(job_id)
    created = int(time.time())
    kind = "chat.completion.chunk" if chat else "text_completion"
    usage_alone = bool(body.stream_options and body.stream_options.include_usage) or len(job_ids) > 1
    opened: set[int] = set()  # the choices whose role was sent

    tokenizers = ctx.dispatcher.validator.tokenizers
    if body.wants_logprobs():
        await to_thread.run_sync(tokenizers.decoder, model)  # loads the tokenizer and end ids once

    def chunk(
        index: int,
        delta: str | None,
        finish: str | None = None,
        usage: dict[str, Any] | None = None,
        choices: bool = True,
        logprobs: dict[str, Any] | None = None,
    ) -> str:
        piece: dict[str, Any] = {"index": index, "finish_reason": finish, "logprobs": logprobs}
        if chat:
            piece["delta"] = {} if delta is None else {"content": delta}
            if choices and index not in opened:  # the choice's first chunk, text or not
                piece["delta"] = {"role": "assistant", **piece["delta"]}
                opened.add(index)
        else:
            piece["text"] = delta or ""
        out = {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{job_ids[0]}",
            "object": kind,
            "created": created,
            "model": model,
            "choices": [piece] if choices else [],
            "job_id": job_ids[index],
        }
        if usage is not None:
            out["usage"] = _usage(usage)
        return json.dumps(out)

    async def events() -> AsyncGenerator[str, None]:
        usages: list[dict[str, Any]] = []
        for index, job_id in enumerate(job_ids):
            sent = ""
            decoder = tokenizers.decoder(model, stops, hold=True) if body.wants_logprobs() else None
            given = Logprobs(decoder, chat) if decoder is not None else None
            async for update in follow(ctx, job_id):
                if isinstance(update, Progress):
                    so_far = safe_to_send((update.text or "").rstrip("\ufffd"), stops)  # a split UTF-8 char
                    if len(so_far) > len(sent) and so_far.startswith(sent):
                        ids = (update.tokens or [])[:-1]  # the newest waits: the end gives it its share
                        entries = given.more(ids, update.logprobs or []) if given else None
                        yield chunk(index, so_far[len(sent) :], logprobs=entries)
                        sent = so_far
                    continue
                job = update
                if job.state != JobState.succeeded:
                    yield json.dumps(
                        {
                            "error": {
                                "message": ended_badly(job),
                                "type": "server_error",
                                "code": job.reason,
                                "job_id": job_id,
                                "job_ids": job_ids,
                            }
                        }
                    )
                    return
                final = await to_thread.run_sync(text_of, job)
                rest = given.more(*job_tokens(job), ended=True) if given is not None else None
                if final.startswith(sent) and len(final) > len(sent):
                    yield chunk(index, final[len(sent) :], logprobs=rest)
                    rest = None
                usage = usage_of(job)
                usages.append(usage)
                finish = usage.get("finish_reason", "length")
                yield chunk(index, None, finish, None if usage_alone else usage, logprobs=rest)
        if usage_alone:
            yield chunk(0, None, usage=usage_total(usages), choices=False)
        yield "[DONE]"

    return EventSourceResponse(
        cancel_when_abandoned(ctx, job_ids, events()),
        headers={"x-should-retry": "false", "x-homefleet-job-id": job_ids[0]},
    )


def with_openai_temperature(ctx: Any, model: str, params: dict[str, Any]) -> dict[str, Any]:
    """``params`` with :data:`OPENAI_TEMPERATURE` where neither the client nor the model's own
    defaults (``models add --default``, R9) set a ``temperature``."""
    if "temperature" in params:
        return params
    try:
        defaults = ctx.registry.get(model).defaults or {}
    except NotFound:
        return params  # the submission refuses the model, naming it
    return params if "temperature" in defaults else {**params, "temperature": OPENAI_TEMPERATURE}


def text_params(
    prompt: str, chat: bool, user_message: str | None, body: Sampling, max_tokens: int | None
) -> dict[str, Any]:
    """A text job's params: the prompt (chat-templated with ``chat``), the chat's last user
    message to show as its prompt (``user_message``, :data:`app.core.kinds.CHAT_SHOWN_PARAM`;
    none for a completion), and the body's sampling params."""
    return {
        "prompt": prompt,
        **({"chat": True} if chat else {}),
        **({CHAT_SHOWN_PARAM: user_message} if user_message is not None else {}),
        **body.params(max_tokens),
    }


async def run_text(
    ctx: Any,
    request: Request,
    body: Sampling,
    prompt: str,
    chat: bool,
    max_tokens: int | None = None,
    user_message: str | None = None,
) -> list[tuple[Job, str, dict[str, Any]]]:
    """An OpenAI request's ``n`` jobs: :func:`run_text_jobs` with the body's sampling params."""
    model = await model_or_default(ctx, body.model, KIND, chat=chat, target=body.target)
    params = await to_thread.run_sync(
        with_openai_temperature, ctx, model, text_params(prompt, chat, user_message, body, max_tokens)
    )
    return await run_text_jobs(ctx, request, body.model_dump(mode="json"), model, params, body.target, body.n)


def answer_of(
    answers: list[tuple[Job, str, dict[str, Any]]],
    kind: str,
    content: Callable[[str], dict[str, Any]],
    logprobs: list[dict[str, Any] | None] | None = None,
) -> dict[str, Any]:
    """OpenAI's answer of ``kind`` (``text_completion``, ``chat.completion``): choice i is job i's
    text (``content`` shapes it), its finish reason, its ``logprobs`` (``logprobs[i]``, else
    null); ``usage`` the choices' (:func:`usage_total`: the prompt once); ``job_id`` the first
    job, ``job_ids`` every one."""
    first = answers[0][0]
    total = usage_total([usage for _, _, usage in answers])
    prefix = "chatcmpl" if kind == "chat.completion" else "cmpl"
    return {
        "id": f"{prefix}-{first.id}",
        "object": kind,
        "created": int(time.time()),
        "model": first.model_id,
        "choices": [
            {
                "index": index,
                **content(text),
                "finish_reason": usage.get("finish_reason", "length"),
                "logprobs": logprobs[index] if logprobs else None,
            }
            for index, (_, text, usage) in enumerate(answers)
        ],
        "usage": total,
        "job_id": first.id,
        "job_ids": [job.id for job, _, _ in answers],
        "machine": first.machine,
    }


async def choice_logprobs(
    ctx: Any, body: Sampling, answers: list[tuple[Job, str, dict[str, Any]]], chat: bool
) -> list[dict[str, Any] | None] | None:
    """Each choice's ``logprobs`` (:class:`Logprobs`) when the request asked for them, else None."""
    if not body.wants_logprobs() or not answers:
        return None
    tokenizers = ctx.dispatcher.validator.tokenizers
    model, stops = answers[0][0].model_id, list(getattr(answers[0][0], "params", {}).get("stop") or [])
    decoders = [await to_thread.run_sync(tokenizers.decoder, model, stops, False) for _ in answers]
    return [
        Logprobs(decoder, chat).more(*job_tokens(job), ended=True) if decoder is not None else None
        for decoder, (job, _, _) in zip(decoders, answers, strict=True)
    ]


@router.post("/v1/completions", response_model=None)
async def completions(body: Completion, ctx: Context, request: Request) -> Any:
    """OpenAI ``completions.create``: 200 with one choice once the job has succeeded; 400
    ``context_length_exceeded`` when the prompt exceeds the model's ``max_input_tokens`` or
    prompt + ``max_tokens`` its ``max_total_tokens``; 409 ``job_pending`` as the image routes (C10). ``stream``: SSE."""
    body.params()  # refuse unsupported fields before anything is submitted
    with client_fields(CLIENT_FIELDS):
        if body.stream:
            return await stream_text(ctx, body, body.prompt, chat=False, api_key_id=request_key_id(request))
        answers = await run_text(ctx, request, body, body.prompt, chat=False)
    logprobs = await choice_logprobs(ctx, body, answers, chat=False)
    return answer_of(answers, "text_completion", lambda text: {"text": text}, logprobs)


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(body: ChatCompletion, ctx: Context, request: Request) -> Any:
    """OpenAI ``chat.completions.create``: the messages through the model's chat template (400
    ``invalid_messages`` for a model without one), then as :func:`completions`."""
    body.params()
    model = await model_or_default(ctx, body.model, KIND, chat=True, target=body.target)
    body = body.model_copy(update={"model": model})
    messages = [m.for_template() for m in body.messages]
    prompt = await to_thread.run_sync(ctx.dispatcher.validator.chat_prompt, model, messages)
    # what the page shows as its prompt: the last user message, else (a system-only chat) the last message
    shown = next((m.content for m in reversed(body.messages) if m.role == "user"), body.messages[-1].content)
    names = {
        **CLIENT_FIELDS,
        "prompt": "messages",
        "max_new_tokens": "max_tokens" if body.max_completion_tokens is None else "max_completion_tokens",
    }
    with client_fields(names):
        if body.stream:
            return await stream_text(
                ctx,
                body,
                prompt,
                chat=True,
                max_tokens=body.max_completion_tokens,
                api_key_id=request_key_id(request),
                user_message=shown,
            )
        answers = await run_text(
            ctx, request, body, prompt, chat=True, max_tokens=body.max_completion_tokens, user_message=shown
        )
    logprobs = await choice_logprobs(ctx, body, answers, chat=True)
    return answer_of(
        answers, "chat.completion", lambda text: {"message": {"role": "assistant", "content": text}}, logprobs
    )
