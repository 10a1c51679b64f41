"""OpenAI's error shape for the OpenAI-compatible routes:
``{"error": {"message", "type", "param", "code"}}`` (platform.openai.com/docs/guides/error-codes);
and text-generation-inference's for TGI's routes (``POST /``, ``/generate``, ``/generate_stream``):
``{"error": message, "error_type": "validation" | "overloaded" | "generation" | ...}``
(huggingface_hub raises its ``ValidationError``, ``OverloadedError``… from ``error_type``),
with Homefleet's ``reason`` beside them. 401, 403 and 404 carry no ``error_type``: huggingface_hub
raises a non-HTTP ``UnknownError`` for one it does not know, losing the status, and its
``HfHubHTTPError`` (``response.status_code``) without one.

``x-should-retry: false`` is set on an error answered after a job may have started, so that
the OpenAI SDK's automatic retries (it retries 408, 409, 429 and 5xx by default unless that
header says false) never create a second job (R20); such an error names the jobs
(``error.job_ids``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from app.api.strict_json import printable
from app.core.errors import HomefleetError, Rejected

OPENAI_PREFIXES = ("/v1/images/", "/hf", "/v1/completions", "/v1/chat/completions", "/v1/models")
OPENAI_UNSERVED = (
    "/v1/embeddings",
    "/v1/responses",
    "/v1/audio/",
    "/v1/moderations",
    "/v1/assistants",
    "/v1/threads",
    "/v1/batches",
    "/v1/fine_tuning/",
    "/v1/vector_stores",
    "/v1/uploads",
    "/v1/realtime",
    "/v1/conversations",
)
"""OpenAI API paths this server does not answer: an SDK call to one gets OpenAI's error shape
(404, the SDK's ``NotFoundError``) naming the routes it does answer, not Homefleet's."""
TGI_PATHS = ("/", "/generate", "/generate_stream")
"""TGI's routes (app/api/routes/tgi.py); ``GET /`` is the fleet page, which answers no errors of its own."""
TGI_ERROR_TYPES = {
    409: "incomplete_generation",
    424: "generation",
    429: "overloaded",
    503: "overloaded",
}
TGI_UNTYPED = (401, 403, 404)
"""Statuses TGI's routes answer without an ``error_type`` (module docstring): TGI itself never
answers them, and huggingface_hub knows only ``validation``, ``overloaded``, ``generation`` and
``incomplete_generation``; for any other it raises ``UnknownError``, not an HTTP error."""
TGI_GENERATION_FAILED = 424
"""TGI's status for a generation that failed (its ``InferError::GenerationError``: 424 Failed
Dependency, ``error_type: generation``): a TGI route's job that ended without a result, never a 500."""

OPENAI_INVALID_STATUS = 400
"""The status of a refused request on the OpenAI-compatible routes: OpenAI's (and vLLM's) 400,
which the SDKs raise as ``BadRequestError`` and client libraries act on (a context-window
fallback keys on it with the code ``context_length_exceeded``), where Homefleet's own routes
answer 422 (R22)."""

ERROR_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "conflict_error",
    429: "rate_limit_error",
}


#: reason -> the request field it is about, where the error does not name one itself
REASON_PARAMS = {
    "unknown_model": "model",
    "model_retired": "model",
    "no_model": "model",
    "kind_not_supported": "model",  # an OpenAI route's kind is fixed: the model is what does not fit it
    "unknown_machine": "target",
}


def is_openai_route(path: str) -> bool:
    return path.startswith(OPENAI_PREFIXES) or path.startswith(OPENAI_UNSERVED)


def is_tgi_route(path: str) -> bool:
    return path in TGI_PATHS


def tgi_error_type(status_code: int) -> str | None:
    """TGI's ``error_type`` of a status: none for 401, 403 and 404 (:data:`TGI_UNTYPED`); 409
    (the job is still running, ``job_pending``): ``incomplete_generation``; 429 and 503:
    ``overloaded``; 424 (the job failed) and other 5xx: ``generation``; other 4xx: ``validation``."""
    if status_code in TGI_UNTYPED:
        return None
    return TGI_ERROR_TYPES.get(status_code, "generation" if status_code >= 500 else "validation")


def _after_submit(error: HomefleetError, headers: dict[str, str]) -> list[str] | None:
    """The jobs an error after a submission names (``headers`` get ``x-should-retry: false``
    and the first job's ``Location``), or None for an error before any job (R20, C10)."""
    job_ids: list[str] | None = getattr(error, "job_ids", None)  # images.AfterSubmit: a job may have started
    if job_ids is not None:
        headers["x-should-retry"] = "false"
        if job_ids:
            headers["Location"] = f"/v1/jobs/{job_ids[0]}"
    return job_ids


def tgi_error(error: HomefleetError, headers: dict[str, str] | None = None) -> JSONResponse:
    """TGI's answer to a domain error: ``{"error", "error_type", "reason"[, "job_ids"]}``
    (no ``error_type`` for 401, 403 and 404: :func:`tgi_error_type`), with the headers of
    :func:`openai_error`. A job that ended without a result (an error
    whose ``job_failed`` is true, e.g. app/api/routes/images.py ``JobFailed``) is
    :data:`TGI_GENERATION_FAILED` with the job's reason and message, as TGI answers a failed
    generation."""
    headers = dict(headers or {})
    job_ids = _after_submit(error, headers)
    cause = getattr(error, "original", error)  # images.AfterSubmit wraps the error raised after a submission
    status = TGI_GENERATION_FAILED if getattr(cause, "job_failed", False) else error.status_code
    body: dict[str, Any] = {"error": error.message}
    kind = tgi_error_type(status)
    if kind is not None:
        body["error_type"] = kind
    body["reason"] = error.reason
    if job_ids is not None:
        body["job_ids"] = job_ids
    return JSONResponse(status_code=status, content=body, headers=headers)


def tgi_validation_error(error: RequestValidationError) -> JSONResponse:
    """A request body that failed validation, as TGI answers it (422 ``validation``)."""
    answer = openai_validation_error(error)
    refused = json.loads(bytes(answer.body))["error"]
    return JSONResponse(
        status_code=422, content={"error": refused["message"], "error_type": "validation", "reason": refused["code"]}
    )


def error_type(status_code: int) -> str:
    if status_code >= 500:
        return "server_error"
    return ERROR_TYPES.get(status_code, "invalid_request_error")


def openai_error(error: HomefleetError, headers: dict[str, str] | None = None) -> JSONResponse:
    """The OpenAI-shaped answer to a domain error. ``param`` is the field the error names, else
    the field of its reason (``invalid_<field>``, R22; :data:`REASON_PARAMS`); a job param's
    ``params.`` prefix goes from both the ``param`` and the message. Errors after a
    submission carry ``x-should-retry: false``, the jobs' ids (``error.job_ids``) and the first
    job's URL (``Location``), so the caller can follow them (C10)."""
    headers = dict(headers or {})
    job_ids = _after_submit(error, headers)
    # a job param is a top-level field of an OpenAI request (``params.steps`` is ``steps``)
    param = (error.param or "").removeprefix("params.") or REASON_PARAMS.get(error.reason)
    if param is None and error.reason.startswith("invalid_"):
        param = error.reason.removeprefix("invalid_")
    message = error.message
    if error.param and error.param.startswith("params.") and param:  # the message names it as ``param`` does
        message = message.replace(error.param, param)
    body: dict[str, Any] = {
        "error": {"message": message, "type": error_type(error.status_code), "param": param, "code": error.reason}
    }
    if job_ids is not None:
        body["error"]["job_ids"] = job_ids
    status = OPENAI_INVALID_STATUS if error.status_code == 422 else error.status_code
    return JSONResponse(status_code=status, content=body, headers=headers)


def openai_validation_error(error: RequestValidationError) -> JSONResponse:
    """A request body that failed validation, as OpenAI answers it (:data:`OPENAI_INVALID_STATUS`)."""
    details = printable(error.errors())  # NaN or a lone surrogate in the input: echoed as text
    first = details[0] if details else {}
    location = [str(part) for part in first.get("loc", ()) if part not in ("body", "query", "header")]
    param = ".".join(location) or None
    message = f"`{param}`: {first.get('msg', 'invalid')}" if param else str(first.get("msg", "invalid request"))
    if "input" in first and param:
        given = first["input"]  # a string quoted; a number, list or object as the client sent it (JSON)
        message += f", got {given[:200]!r}" if isinstance(given, str) else f", got {json.dumps(given)[:200]}"
    body = {"error": {"message": message, "type": "invalid_request_error", "param": param, "code": "invalid_request"}}
    return JSONResponse(status_code=OPENAI_INVALID_STATUS, content=body)


def renamed(error: Rejected, names: Mapping[str, str]) -> Rejected:
    """``error`` naming the field the client sent where it names the job param that field became
    (``names``: job param -> client field, e.g. ``max_new_tokens`` -> ``max_tokens``,
    ``width`` -> ``size``): its ``param`` (from ``params.<name>``, ``<name>`` or the reason
    ``invalid_<name>``) and the message's ``params.<name>``, `` `<name>` `` and, for a name with an
    underscore that the client's field does not share, the bare name. An error naming no mapped param is returned
    as it is."""
    raw = error.param or ""
    param = raw.removeprefix("params.") or error.reason.removeprefix("invalid_")
    field = names.get(param)
    if field is None:
        return error
    group = [name for name, to in names.items() if to == field and name != field]  # width, height -> size
    shown = f"`{field}` ({param})" if len(group) > 1 else f"`{field}`"  # size (width)
    message = error.message
    if len(group) > 1:  # `width` x `height` -> `size` (width x height)
        message = message.replace(" x ".join(f"`{name}`" for name in group), f"`{field}` ({' x '.join(group)})")
    message = message.replace(f"params.{param}", field).replace(f"`{param}`", shown)
    if "_" in param and field.rpartition(".")[2] != param:  # TGI's parameters.max_new_tokens: the same name
        message = re.sub(rf"(?<![\w.]){re.escape(param)}(?!\w)", field, message)
    out = Rejected(message, reason=error.reason, param=field)
    out.job_id = error.job_id  # the journaled refusal
    return out


@contextmanager
def client_fields(names: Mapping[str, str]) -> Iterator[None]:
    """Answer a refusal raised inside (before any job: after one it is an ``AfterSubmit``)
    naming the client's own field (:func:`renamed`).

    Raises:
        Rejected: renamed.
    """
    try:
        yield
    except Rejected as error:
        raise renamed(error, names) from error
