"""schemathesis hooks of the real-HTTP fuzz run (app/devtools/fuzz.py loads them with
``SCHEMATHESIS_HOOKS``): one check, :func:`schema_valid_is_not_refused`, and one ``before_call``
hook, :func:`use_uploaded_inputs`, that puts real uploaded inputs into some schema-valid bodies.

The OpenAPI document states every limit JSON Schema can state (app/api/openapi.py), so a
schema-valid request is accepted. The few refusals (422) a schema cannot rule out are allowed
below, each by its reason, with why; any other 422 to a schema-valid request fails the run.
schemathesis' own ``positive_data_acceptance`` lets 422 through on the job routes
(tests/fuzz/schemathesis.toml) so that this check, which reads the reason, decides.
"""

from __future__ import annotations

import ast
import json
import os
import random
import threading
from typing import Any

import schemathesis

# schemathesis' --workers N generates cases in N threads, and hypothesis parses a lambda's source
# (ast.parse) when it describes a strategy. On CPython 3.11 the AST constructor keeps its recursion
# depth in per-interpreter state, so two threads parsing at once can crash a worker with
# "SystemError: AST constructor recursion depth mismatch" (CPython gh-106905): schemathesis then
# reports a runtime error and exits 1 although the server answered well. One lock makes the parses
# take turns (they are rare and short: hypothesis caches each description).
_AST_LOCK = threading.Lock()
_ast_parse = ast.parse


#: how often a parse is tried again when the race still hit it (another thread built AST objects
#: outside ast.parse); the parse is pure, so its repeat is the same tree
AST_PARSE_TRIES = 5


def _serialized_parse(*args: Any, **kwargs: Any) -> Any:
    with _AST_LOCK:
        for attempt in range(AST_PARSE_TRIES):
            try:
                return _ast_parse(*args, **kwargs)
            except SystemError as error:
                if "recursion depth mismatch" not in str(error) or attempt == AST_PARSE_TRIES - 1:
                    raise
        raise AssertionError("unreachable")


ast.parse = _serialized_parse

#: reason -> why a schema-valid request may still get it (what JSON Schema cannot state)
UNSTATABLE: dict[str, str] = {
    "invalid_size": "width x height over max_pixels (a product of two fields), or an input image whose output would be",
    "invalid_prompt": "an image prompt's tokens in the text encoder's tokenizer (a word may be several tokens)",
    "context_length_exceeded": "a text prompt's tokens in the model's own tokenizer (a character may be several byte "
    "tokens; a chat request's prompt is its messages once chat-templated), alone or with max_new_tokens, over the "
    "model's max_input_tokens / max_total_tokens",
    "input_type": "an upload's bytes must decode as a PNG, JPEG or WebP image",
    "invalid_image": "an uploaded part must be an image (its bytes and media type)",
    "input_corrupt": "an input image must decode",
    "invalid_inputs": "Hugging Face image-to-image: `inputs` must be an image in base64",
    "invalid_grammar": "a grammar (JSON schema or regular expression) must compile",
    "invalid_webhook_url": "a webhook's host must be on the fleet's allow-list, and its key have a secret",
    "unknown_file": "an input id must name a file uploaded to this server (POST /v1/files)",
    "idempotency_key_reused": "an Idempotency-Key sent before with another body (state across requests, R20)",
    "no_machine": "auto placement: no machine could run the model even once back online (its verified "
    "models, family and memory: state of the fleet, not the request; every able machine offline or "
    "receiving a sync is a 503 instead)",
    "adapter_family_mismatch": "an adapter must be of the model's family (two fields, and the registry)",
    "adapter_base_mismatch": "an adapter must be made for the model's cross-attention width (two fields, and "
    "the files they name)",
    "invalid_stream_options": "OpenAI's stream_options goes with stream: true only (two fields)",
}
#: (reason, param) -> why: a generic reason allowed for one param only
PARAM_UNSTATABLE: dict[tuple[str, str], str] = {
    (
        "invalid_params",
        "params.strength",
    ): "int(steps x strength) must leave a denoising step (a product of two fields)",
    ("unknown_machine", "machine"): "GET /v1/jobs?machine= must name a machine of the live fleet file, or one "
    "that jobs were placed on (the fleet's state, not the request's)",
    ("invalid_expand_prompt", "params.expand_prompt"): "POST /v1/jobs?dry_run=true decides a placement without "
    "running the expansion's text job: a query parameter and a "
    "body field together",
}
#: (method, path) -> more reasons that route may answer a schema-valid request, and why
ROUTE_UNSTATABLE: dict[tuple[str, str], dict[str, str]] = {
    ("POST", "/v1/images/generations"): {
        "unknown_param": "an extra field (the SDK's extra_body) is taken as a param of the chosen model's kind "
        "or refused naming it: which names are params depends on the model, not on this body's schema",
    },
    ("POST", "/v1/images/edits"): {
        "unknown_param": "as for /v1/images/generations: an extra form field must be a param of the model's kind",
    },
    ("POST", "/hf/models/{model}"): {
        "kind_not_supported": "the path's model must run the body's task (text-to-image, or image-to-image "
        "with parameters.prompt): one schema for a path parameter and a body cannot say so",
        "unsupported_kind": "as kind_not_supported",
        "unknown_param": "a text model's path takes TGI's parameters, not text-to-image's that this body's schema "
        "states (app/api/routes/hf.py)",
    },
    ("POST", "/hf/models/{model}/v1/chat/completions"): {
        "kind_not_supported": "the path's model must run text: one schema for a path parameter and a body cannot "
        "say so",
    },
}
#: routes whose 422 is about a stored job, not the request: requeue submits the job it repeats again
STORED_JOB_ROUTES = {("POST", "/v1/jobs/{job_id}/requeue")}


def refusal_param(body: Any) -> str | None:
    """The field an error body names (``param``), if any."""
    if not isinstance(body, dict):
        return None
    error = body.get("error")
    param = error.get("param") if isinstance(error, dict) else body.get("param")
    return param if isinstance(param, str) else None


def refusal_reason(body: Any) -> str | None:
    """The reason of an error body in any of the API's three shapes (``Error``: error.reason;
    ``OpenAIError``: error.code; ``TGIError``: reason); None when there is none."""
    if not isinstance(body, dict):
        return None
    error = body.get("error")
    if isinstance(error, dict):
        reason = error.get("reason") or error.get("code")
        return reason if isinstance(reason, str) else None
    reason = body.get("reason")
    return reason if isinstance(reason, str) else None


@schemathesis.check
def schema_valid_is_not_refused(ctx: Any, response: Any, case: Any) -> bool | None:
    """A refusal (422; 400 on the OpenAI-compatible routes, app/api/openai_errors.py
    ``OPENAI_INVALID_STATUS``) of a schema-valid (positive) request fails, unless its reason is
    one a schema cannot rule out (:data:`UNSTATABLE`, :data:`ROUTE_UNSTATABLE`,
    :data:`PARAM_UNSTATABLE`) or it is about a stored job."""
    meta = getattr(case, "meta", None)
    if response.status_code not in (400, 422) or meta is None or not meta.generation.mode.is_positive:
        return None
    route = (case.method.upper(), case.operation.path)
    if route in STORED_JOB_ROUTES:
        return None
    try:
        body = json.loads(response.content)
    except ValueError:
        body = None
    reason = refusal_reason(body)
    allowed = {**UNSTATABLE, **ROUTE_UNSTATABLE.get(route, {})}
    if reason not in allowed and (reason, refusal_param(body)) not in PARAM_UNSTATABLE:
        raise AssertionError(
            f"a schema-valid request was refused {response.status_code} ({reason}): the OpenAPI document should state "
            f"that limit (app/api/openapi.py); body: {response.content[:300]!r}"
        )
    return None


#: environment variable naming the run's uploaded inputs: JSON {"pairs": [[image id, mask id], ...],
#: "png": path of one uploaded image}
INPUTS_ENV = "HOMEFLEET_FUZZ_INPUTS"
#: the share of schema-valid bodies that get a real input instead of the generated one: the rest keep
#: a random id (404 unknown_file), so both answers stay covered
REAL_INPUT_SHARE = 0.5
_rng = random.Random(1)


def _inputs() -> dict[str, Any]:
    raw = os.environ.get(INPUTS_ENV)
    return json.loads(raw) if raw else {}


@schemathesis.hook
def before_call(ctx: Any, case: Any, **kwargs: Any) -> None:
    """See :func:`use_uploaded_inputs`."""
    use_uploaded_inputs(case)


def use_uploaded_inputs(case: Any) -> None:
    """For half of the schema-valid cases: ``POST /v1/jobs`` whose ``params`` has ``image`` (or
    ``mask``) gets the id of a real upload (:data:`INPUTS_ENV`), so that edit, img2img, inpaint and
    upscale jobs really run (a generated ``strength`` becomes 1.0, which leaves a denoising step
    whatever the steps: hypothesis favours 0 and tiny values, refused 422). A schema-valid body
    stays schema-valid (a real id matches the ``blake3:`` pattern); a case with any negative
    component is left as generated, and so are ``POST /v1/files`` (the run uploads before) and
    ``POST /v1/images/edits`` (a real PNG put into a multipart case generated as invalid made one
    the server rightly accepted: schemathesis' ST201)."""
    meta = getattr(case, "meta", None)
    inputs = _inputs()
    if not inputs or meta is None or not meta.generation.mode.is_positive or not isinstance(case.body, dict):
        return
    if any(info.mode.is_negative for info in getattr(meta, "components", {}).values()):
        return  # a part of it is schema-violating: a real input there could make it valid
    if _rng.random() >= REAL_INPUT_SHARE:
        return
    route = (case.method.upper(), case.operation.path)
    if route == ("POST", "/v1/jobs"):
        params = case.body.get("params")
        if isinstance(params, dict):
            # a mask of its image's size (inpaint); the upscaler takes the smallest (its x4 output within max_pixels)
            image, mask = inputs["pairs"][0] if case.body.get("kind") == "upscale" else _rng.choice(inputs["pairs"])
            for name, value in (("image", image), ("mask", mask)):
                if name in params:
                    params[name] = value
            if isinstance(params.get("strength"), int | float):
                params["strength"] = 1.0  # int(steps x strength) must leave a step: any steps do with 1.0
