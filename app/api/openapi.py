"""The OpenAPI documents, made to tell the truth: every status a route can answer,
with the common error body; the links a client (and schemathesis' stateful phase) follows
from a submission to its job; the public document apart from the internal one.

Statuses are added here, in one place, from what every route shares and a table of what some
routes add (:data:`ROUTE_STATUSES`):

- 400 a body that cannot be parsed (multipart, or bytes that are not JSON), 413 a body over
  its limit (app/api/body_limit.py), 422 a value refused (validation, R22): routes with a body;
- 401 a missing or unknown key (or machine token): routes with a security requirement;
- 404 an unknown job, machine, sync, model or file: routes with a path parameter;
- 422 a refused parameter: routes with any parameter;
- 503 Redis or the journal down (``redis_down``, ``journal_down``): every route but ``/metrics``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from typing import Any

from app.api.auth import INTERNAL_PREFIX
from app.api.openai_errors import OPENAI_PREFIXES, is_tgi_route
from app.core.kinds import CHAT_SHOWN_PARAM, KINDS, MAX_SEED, OUTPUT_SIZE_FIELDS, SERVER_SET_PARAMS
from app.core.limits import MAX_MODEL_ID, FamilyLimits
from app.core.textgen import MAX_STOP_CHARS, MAX_STOP_SEQUENCES
from app.jobs.validation import MAX_ADAPTER_SCALE
from routing.timings import ADAPTER_KIND

ERROR_BODY: dict[str, Any] = {
    "title": "Error",
    "type": "object",
    "required": ["error"],
    "description": "Every Homefleet error: a machine-readable reason and a message naming the field, the value and "
    "the limit (docs/api.md, Errors).",
    "properties": {
        "error": {
            "type": "object",
            "required": ["reason", "message"],
            "properties": {
                "reason": {
                    "type": "string",
                    "description": "e.g. invalid_width, unknown_model, queue_full, quota_queued",
                },
                "message": {"type": "string"},
                "job_id": {"type": "string", "description": "the journaled `rejected` job of a refused submission"},
            },
        },
        "detail": {"type": "array", "description": "validation details (422 invalid_request)", "items": {}},
    },
}
OPENAI_ERROR_BODY: dict[str, Any] = {
    "title": "OpenAIError",
    "type": "object",
    "required": ["error"],
    "description": "OpenAI's error shape, on the OpenAI and Hugging Face routes.",
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": "string", "description": "Homefleet's reason"},
                "job_ids": {
                    "type": "array",
                    "items": {"type": "string"},
                    "description": "the jobs this request submitted, on errors after a submission (R20, C10)",
                },
            },
        }
    },
}
TGI_ERROR_BODY: dict[str, Any] = {
    "title": "TGIError",
    "type": "object",
    "required": ["error"],
    "description": "text-generation-inference's error shape, on TGI's routes (POST /, /generate, /generate_stream).",
    "properties": {
        "error": {"type": "string"},
        "error_type": {
            "type": "string",
            "description": "validation, overloaded, generation, incomplete_generation; absent on 401, 403 and 404 "
            "(huggingface_hub then raises its HTTP error with the status)",
        },
        "reason": {"type": "string", "description": "Homefleet's reason"},
        "job_ids": {
            "type": "array",
            "items": {"type": "string"},
            "description": "the jobs this request submitted, on errors after a submission (R20, C10)",
        },
    },
}
DESCRIPTIONS = {
    400: "the body could not be parsed",
    401: "no key, or not one of this server's",
    403: "another machine's job",
    404: "no such job, machine, model, sync or file",
    409: "the state forbids it (e.g. the job has ended, the "
    "machine is busy, the image job is still pending: job_pending)",
    413: "the body is over its limit",
    422: "a value is refused: the message names the field, the value and the limit (R22)",
    424: "TGI's answer to a text job that ended without a result (error_type generation, the job's reason)",
    429: "the machine's or the fleet's queue is full, or the API key is at its quota (quota_queued, "
    "quota_gpu_seconds; Retry-After, R23)",
    500: "a job of an image request failed, or the server failed after submitting it (x-should-retry: false, job_ids)",
    503: "Redis or the journal does not answer, or the target machine is offline (Retry-After)",
    507: "the server could not store the file (disk full)",
}

#: (method, path) -> statuses that route adds to the shared ones (module docstring).
ROUTE_STATUSES: dict[tuple[str, str], tuple[int, ...]] = {
    ("post", "/v1/jobs"): (404, 409, 429, 503),
    ("get", "/v1/jobs"): (404,),  # a page cursor ``after`` that names no job
    ("post", "/v1/jobs/{job_id}/cancel"): (409,),
    ("post", "/v1/jobs/{job_id}/requeue"): (404, 409, 429, 503),  # as POST /v1/jobs; 404 also for an unknown job
    ("get", "/v1/jobs/{job_id}/result"): (409,),  # the job exists; its result does not yet (no_result)
    ("post", "/v1/images/generations"): (404, 409, 429, 500, 503),
    ("post", "/v1/images/edits"): (404, 409, 429, 500, 503),
    ("post", "/hf"): (404, 409, 429, 500, 503),
    ("post", "/v1/completions"): (404, 409, 429, 500, 503),
    ("post", "/v1/chat/completions"): (404, 409, 429, 500, 503),
    ("post", "/"): (404, 409, 424, 429, 500, 503),  # TGI's routes (app/api/routes/tgi.py)
    ("post", "/generate"): (404, 409, 424, 429, 500, 503),
    ("post", "/generate_stream"): (404, 409, 424, 429, 500, 503),
    ("post", "/hf/models/{model}"): (409, 424, 429, 500, 503),  # 424: a text model (TGI)
    ("post", "/hf/models/{model}/v1/chat/completions"): (409, 429, 500, 503),
    ("post", "/v1/machines/{machine}/sync"): (409, 503),
    ("put", "/v1/machines/{machine}/residency"): (409,),
    ("delete", "/v1/ooms"): (404,),
    ("post", "/internal/v1/jobs/{job_id}/claim"): (403, 409),
    ("post", "/internal/v1/jobs/{job_id}/progress"): (403, 409),
    ("post", "/internal/v1/jobs/{job_id}/result"): (403, 409, 507),
    ("post", "/internal/v1/jobs/{job_id}/failure"): (403, 409),
    ("post", "/internal/v1/syncs/{sync_id}/claim"): (403, 409),
    ("post", "/internal/v1/syncs/{sync_id}/progress"): (403, 409),
    ("post", "/internal/v1/syncs/{sync_id}/finish"): (403, 409),
}
OPEN_ROUTES = (("get", "/metrics"), ("get", "/"))  # no key and no Redis or journal: never 503 (the page holds no data)
NULL_IS_ABSENT = (
    "prompt",
    "negative_prompt",
    "width",
    "height",
    "steps",
    "frames",
    "n",
    "seed",
    "expand_prompt",
)  # answers without Redis or the journal


#: a JSON schema: an object, or true / false (JSON Schema's boolean schemas), as app/core/constraints.py takes
JSON_SCHEMA_VALUE: dict[str, Any] = {"type": ["object", "boolean"]}
#: OpenAI's ``response_format``: what app/core/constraints.py reads (any other type is refused)
RESPONSE_FORMAT: dict[str, Any] = {
    "anyOf": [
        # each type takes only its own keys (app/core/constraints.py RESPONSE_FORMAT_KEYS): nothing dropped
        {
            "type": "object",
            "required": ["type"],
            "properties": {"type": {"type": "string", "const": "text"}},
            "additionalProperties": False,
        },
        {
            "type": "object",
            "required": ["type"],
            "properties": {"type": {"type": "string", "const": "json_object"}, "value": JSON_SCHEMA_VALUE},
            "additionalProperties": False,
        },
        {
            "type": "object",
            "required": ["type", "json_schema"],
            "properties": {
                "type": {"type": "string", "const": "json_schema"},
                "json_schema": {
                    "type": "object",
                    "required": ["schema"],
                    "properties": {
                        "name": {"type": "string"},
                        "schema": JSON_SCHEMA_VALUE,
                        "strict": {"type": "boolean"},
                        "description": {"type": "string"},
                    },
                    "additionalProperties": False,
                },
            },
            "additionalProperties": False,
        },
        {"type": "null"},
    ],
    "description": "constrains the output: json_schema (its schema) or json_object (any JSON object); text: none",
}
#: text bodies (OpenAI's and TGI's) whose sampling numbers are the text kind's (app/core/kinds.py)
TEXT_BODIES = ("Completion", "ChatCompletion", "Parameters")
#: multipart bodies: a form field cannot carry null (an absent field is the default)
MULTIPART_BODIES = ("Body_edit_images_v1_images_edits_post", "Body_upload_file_v1_files_post")


def _nullable(schema: dict[str, Any], nullable: bool) -> dict[str, Any]:
    return {"anyOf": [schema, {"type": "null"}]} if nullable else schema


def _is_nullable(schema: dict[str, Any]) -> bool:
    return any(option == {"type": "null"} for option in schema.get("anyOf", []))


def integer_bounds(node: Any) -> None:
    """Every integer's bounds beyond a float's 53 bits as exact integers, in place: pydantic writes
    ``lt=2**63`` and ``le=2**63 - 1`` both as 9.223372036854776e18, a float that also admits
    2**63 + 190 (R22); an ``exclusiveMaximum`` becomes the ``maximum`` below it."""
    if isinstance(node, dict):
        bound = node.get("exclusiveMaximum")
        if node.get("type") == "integer" and isinstance(bound, (int, float)) and not isinstance(bound, bool):
            node.pop("exclusiveMaximum")
            node["maximum"] = int(bound) - 1 if float(bound).is_integer() else int(bound)
        top = node.get("maximum")
        if node.get("type") == "integer" and isinstance(top, float) and top >= 2.0**53:
            node["maximum"] = min(int(top), MAX_SEED) if top >= float(MAX_SEED) else int(top)
        for value in node.values():
            integer_bounds(value)
    elif isinstance(node, list):
        for value in node:
            integer_bounds(value)


def stated_limits(components: dict[str, Any], limits: FamilyLimits) -> None:
    """State on the OpenAI, TGI and Hugging Face bodies the limits their jobs are checked
    against (R22): the text kind's ``temperature`` and ``top_p`` ranges, OpenAI's
    ``response_format`` shapes, the Hugging Face sides' ``multipleOf`` and range, no null in a
    multipart form, and ``expand_prompt`` as the one value the image route takes (none)."""
    text = {number.name: number for number in KINDS["text"].numbers}
    for body in TEXT_BODIES:
        properties = components.get(body, {}).get("properties", {})
        for name in ("temperature", "top_p"):
            if name in properties:
                number = text[name]
                stated: dict[str, Any] = {"type": "number", "minimum": number.low, "maximum": number.high}
                old = properties[name].get("anyOf", [properties[name]])[0]
                if old.get("exclusiveMinimum", -1) >= number.low:  # the route's own bound is narrower (TGI: > 0)
                    stated = {"type": "number", "exclusiveMinimum": old["exclusiveMinimum"], "maximum": number.high}
                properties[name] = _nullable(stated, _is_nullable(properties[name]))
        if "stop" in properties:  # app/core/textgen.py stop_sequences: what a job's stop may be
            one = {"type": "string", "minLength": 1, "maxLength": MAX_STOP_CHARS}
            options = [option.get("type") for option in properties["stop"].get("anyOf", [properties["stop"]])]
            stop: list[dict[str, Any]] = [one] if "string" in options else []
            stop.append({"type": "array", "items": one, "maxItems": MAX_STOP_SEQUENCES})
            stated_stop = stop[0] if len(stop) == 1 else {"anyOf": stop}
            properties["stop"] = _nullable(stated_stop, _is_nullable(properties["stop"]))
        if "response_format" in properties:
            properties["response_format"] = RESPONSE_FORMAT
    hf = components.get("HfParameters", {}).get("properties", {})
    guidance = {number.name: number for number in KINDS["txt2img"].numbers}.get("guidance_scale")
    if "guidance_scale" in hf and guidance is not None:  # txt2img's range (edit/upscale: app/core/kinds.py)
        hf["guidance_scale"] = _nullable({"type": "number", "minimum": guidance.low, "maximum": guidance.high}, True)
    side = kind_params(limits)[0]["properties"]["params"]["properties"]["width"]
    for name in ("width", "height"):
        if name in hf:
            hf[name] = _nullable(side.get("anyOf", [side])[0], True)
    for body in MULTIPART_BODIES:
        for name, schema in components.get(body, {}).get("properties", {}).items():
            if isinstance(schema, dict) and _is_nullable(schema):
                others = [option for option in schema["anyOf"] if option != {"type": "null"}]
                rest = {key: value for key, value in schema.items() if key != "anyOf"}
                components[body]["properties"][name] = (
                    {**rest, **others[0]} if len(others) == 1 else {**rest, "anyOf": others}
                )
    for body in ("ImageGeneration", "Body_edit_images_v1_images_edits_post"):
        properties = components.get(body, {}).get("properties", {})
        if isinstance(properties.get("n"), dict) and properties["n"].get("type") == "integer":
            properties["n"] = {**properties["n"], "maximum": limits.max_batch}
    for body, fields in IMAGE_FIELDS.items():  # the family limits, as the jobs are checked (app/jobs/validation.py)
        properties = components.get(body, {}).get("properties", {})
        for name, (keyword, limit) in fields.items():
            if name in properties:
                schema = properties[name]
                options = schema.get("anyOf") if isinstance(schema.get("anyOf"), list) else [schema]
                for option in options:
                    if option.get("type") in ("string", "integer"):
                        option[keyword] = getattr(limits, limit)
    edit = components.get("Body_edit_images_v1_images_edits_post", {}).get("properties", {})
    if "size" in edit:
        edit["size"] = size_schema(limits)["anyOf"][0]
    image = components.get("ImageGeneration", {}).get("properties", {})
    if "expand_prompt" in image:
        image["expand_prompt"] = {
            "type": "null",
            "description": "not on this route (refused): prompt expansion runs on POST /v1/jobs (params.expand_prompt)",
        }


#: image body -> field -> (JSON Schema keyword, FamilyLimits field) it is bounded by
IMAGE_FIELDS: dict[str, dict[str, tuple[str, str]]] = {
    "ImageGeneration": {
        "prompt": ("maxLength", "max_prompt_chars"),
        "negative_prompt": ("maxLength", "max_prompt_chars"),
        "steps": ("maximum", "max_steps"),
    },
    "Body_edit_images_v1_images_edits_post": {"prompt": ("maxLength", "max_prompt_chars")},
    "HfParameters": {
        "prompt": ("maxLength", "max_prompt_chars"),
        "negative_prompt": ("maxLength", "max_prompt_chars"),
        "num_inference_steps": ("maximum", "max_steps"),
    },
}
#: routes that answer Server-Sent Events when the body's ``stream`` is true
STREAM_ROUTES = ("/v1/completions", "/v1/chat/completions", "/hf/models/{model}/v1/chat/completions")
#: one Server-Sent Event, as OpenAPI 3.1 has a ``text/event-stream`` schema describe each event: its
#: ``data`` (JSON text on every stream of this API) and its ``event`` type (``message`` when unnamed)
SSE_EVENT: dict[str, Any] = {
    "type": "object",
    "required": ["data"],
    "description": "one Server-Sent Event",
    "properties": {
        "data": {"type": "string", "contentMediaType": "application/json"},
        "event": {"type": "string"},
        "id": {"type": "string"},
        "retry": {"type": "integer"},
    },
}
#: body schema -> the kinds its ``model`` must run (a model field of any other body lists every model)
BODY_KINDS: dict[str, tuple[str, ...]] = {
    "ImageGeneration": ("txt2img",),
    "Body_edit_images_v1_images_edits_post": ("edit",),
    "Completion": ("text",),
    "ChatCompletion": ("text",),
    "Generate": ("text",),
}
#: path with a ``{model}`` parameter -> the kinds that model must run
PATH_MODEL_KINDS: dict[str, tuple[str, ...]] = {
    "/hf/models/{model}": ("txt2img", "edit", "upscale", "text"),
    "/hf/models/{model}/v1/chat/completions": ("text",),
}
#: paths whose errors have OpenAI's shape or, for a text model, TGI's (app/api/routes/hf.py)
EITHER_ERROR_PATHS = ("/hf/models/{model}",)
#: an OpenAI ``size`` is listed value by value up to this many sizes, else stated by a pattern
MAX_LISTED_SIZES = 512


def size_schema(limits: FamilyLimits) -> dict[str, Any]:
    """OpenAI's ``size`` (``"WxH"`` or ``"auto"``; null: the model's default) under ``limits``:
    every allowed size listed when they are few (sides multiples of ``multiple_of``, at least
    ``min_side``, width x height at most ``max_pixels``), else a pattern of the form."""
    step, low = limits.multiple_of, max(limits.min_side, limits.multiple_of)
    low += (-low) % step
    sizes: list[str] = []
    # widths in increasing order, each with the heights its area allows; stop as soon as there are
    # too many to list (the broadest limits allow millions: listing them all took 18 CPU-s)
    for width in range(low, limits.max_pixels // low + 1, step):
        heights = range(low, limits.max_pixels // width + 1, step)
        if not heights or len(sizes) + len(heights) > MAX_LISTED_SIZES:
            sizes = sizes if not heights else []
            break
        sizes += [f"{width}x{height}" for height in heights]
    description = (
        f"'WxH' in pixels (multiples of {limits.multiple_of}, at least {limits.min_side}, at most "
        f"{limits.max_pixels} pixels), or 'auto' (the model's default)"
    )
    if 0 < len(sizes) <= MAX_LISTED_SIZES:
        named: dict[str, Any] = {"type": "string", "enum": [*sizes, "auto"], "description": description}
    else:
        named = {"type": "string", "pattern": r"^(auto|[1-9][0-9]{0,5}x[1-9][0-9]{0,5})$", "description": description}
    return {"anyOf": [named, {"type": "null"}]}


def job_links() -> dict[str, Any]:
    """OpenAPI links from an answer carrying a job's ``id`` to what follows it (R24)."""
    job = {"job_id": "$response.body#/id"}
    return {
        "GetJob": {"operationId": "get_job_v1_jobs__job_id__get", "parameters": job},
        "JobEvents": {"operationId": "job_events_v1_jobs__job_id__events_get", "parameters": job},
        "JobResult": {"operationId": "get_result_v1_jobs__job_id__result_get", "parameters": job},
        "CancelJob": {"operationId": "cancel_job_v1_jobs__job_id__cancel_post", "parameters": job},
    }


def broadest(limits: Mapping[str, FamilyLimits]) -> FamilyLimits:
    """The most any family allows, field by field: what a request may ask before its model's
    family is known (the schema cannot name the model's family)."""
    families = list(limits.values()) or [FamilyLimits()]
    numbers = {
        name: max(getattr(family, name) for family in families)
        for name, info in FamilyLimits.model_fields.items()
        if info.annotation is int
    }
    numbers["multiple_of"] = min(family.multiple_of for family in families)
    numbers["min_side"] = min(family.min_side for family in families)
    return FamilyLimits(**numbers)


def kind_params(limits: FamilyLimits) -> list[dict[str, Any]]:
    """One ``JobCreate`` variant per kind (app/core/kinds.py): ``kind`` as a constant and the
    params that kind takes, with every limit JSON Schema can state (R22). What it cannot state
    is checked at submission: width x height <= ``max_pixels``, the prompt's tokens, that an
    input id names an uploaded file, that the model runs the kind."""
    text = {"type": "string", "maxLength": limits.max_prompt_chars}
    side = {
        "type": "integer",
        "minimum": limits.min_side,
        "multipleOf": limits.multiple_of,
        "maximum": max(
            limits.min_side, limits.max_pixels // limits.min_side // limits.multiple_of * limits.multiple_of
        ),
        "description": f"pixels; width x height at most {limits.max_pixels} (max_pixels)",
    }
    known: dict[str, dict[str, Any]] = {
        "prompt": {**text, "pattern": r"\S"},
        "negative_prompt": text,
        "width": side,
        "height": side,
        "steps": {"type": "integer", "minimum": 1, "maximum": limits.max_steps},
        "frames": {"type": "integer", "minimum": 1, "maximum": limits.max_frames},
        "seed": {"type": "integer", "minimum": 0, "maximum": MAX_SEED},
        "n": {
            "type": "integer",
            "minimum": 1,
            "maximum": limits.max_batch,
            "description": "images in one job (image i: seed + i); at most the family's max_batch",
        },
        "image": {
            "type": "string",
            "pattern": r"^blake3:[0-9a-f]{64}$",
            "description": "the id of a file uploaded with POST /v1/files",
        },
        "chat": {"type": "boolean", "description": "the prompt is chat-templated already"},
        CHAT_SHOWN_PARAM: {
            **text,
            "description": "a chat's last user message, shown as its prompt (the model reads `prompt` only)",
        },
        "expand_prompt": {
            "type": "string",
            "minLength": 1,
            "maxLength": MAX_MODEL_ID,
            "description": "a text model that expands the prompt first, as its own job",
        },
        "grammar": {
            "anyOf": [
                {"type": "null"},
                {
                    "type": "object",
                    "required": ["type", "value"],
                    "additionalProperties": False,
                    "description": "the output's constraint (llguidance): a JSON schema or a regular expression",
                    "properties": {
                        "type": {"type": "string", "enum": ["json", "regex"]},
                        "value": {"anyOf": [{"type": "object"}, {"type": "string"}]},
                    },
                },
            ]
        },
        "adapters": {
            "type": "array",
            "maxItems": limits.max_adapters,
            "description": "LoRA adapters for this job: registered adapters of the model's family, "
            "each id once; at most the family's max_adapters",
            "items": {
                "type": "object",
                "required": ["id"],
                "additionalProperties": False,
                "properties": {
                    "id": {"type": "string", "minLength": 1, "maxLength": MAX_MODEL_ID},
                    "scale": {
                        "type": "number",
                        "minimum": -MAX_ADAPTER_SCALE,
                        "maximum": MAX_ADAPTER_SCALE,
                        "description": "the adapter's weight (default 1; 0: the model as it is)",
                    },
                },
            },
        },
        "mask": {
            "type": "string",
            "pattern": r"^blake3:[0-9a-f]{64}$",
            "description": "inpaint: the id of an uploaded mask of the image's size (white: repaint)",
        },
    }
    variants = []
    for name, spec in KINDS.items():
        properties: dict[str, Any] = {}
        for param in spec.accepted:
            if param in SERVER_SET_PARAMS:
                continue  # the server sets it; a client's is refused
            if param in known:
                properties[param] = known[param]
            elif param in OUTPUT_SIZE_FIELDS:
                properties[param] = {"type": "integer", "description": "set by the server from the input image"}
        for number in spec.numbers:
            bound: dict[str, Any] = {"type": "integer" if number.integer else "number"}
            properties[number.name] = {**bound, "minimum": number.low, "maximum": number.high}
        if spec.formats:
            properties["format"] = {"type": "string", "enum": list(spec.formats)}
        required = [
            param
            for param in ("prompt", *spec.inputs)
            if param in properties and (param != "prompt" or spec.prompt_required)
        ]
        for param in NULL_IS_ABSENT:  # the server reads null as absent for these (app/jobs/validation.py)
            if param in properties and param not in required:
                properties[param] = {"anyOf": [properties[param], {"type": "null"}]}
        params: dict[str, Any] = {"type": "object", "properties": properties, "additionalProperties": False}
        if required:
            params["required"] = required
        variants.append(
            {
                "type": "object",
                "title": f"JobCreate ({name})",
                "additionalProperties": False,
                "required": ["model", "kind", "params"] if required else ["model", "kind"],
                "properties": {"kind": {"type": "string", "const": name}, "params": params},
            }
        )
    return variants


def model_enum(ids: Iterable[str], what: str = "a registered model id") -> dict[str, Any]:
    """A string that is one of ``ids`` (sorted)."""
    return {"type": "string", "enum": sorted(ids), "description": f"{what} (GET /v1/models)"}


def documented(
    schema: dict[str, Any],
    machines: Iterable[str] = (),
    limits: Mapping[str, FamilyLimits] | None = None,
    models: Iterable[str] | Mapping[str, Iterable[str]] = (),
) -> dict[str, Any]:
    """``schema`` with every operation's error statuses and links added (module docstring), the
    fleet's machine names as the values a machine parameter or ``target`` takes, the registered
    model ids as the values a model field takes (when there is one), and each kind's params.

    ``models``: model ids, or model id -> the kinds it runs; with the kinds, each body's
    ``model`` lists only the models that run what that body asks (:data:`BODY_KINDS`, and each
    ``JobCreate`` variant its kind's), so that a schema-valid body never names a model that
    cannot run it (R22); a kind no registered model runs is left out of ``JobCreate``."""
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    names = sorted(machines)
    kinds_of = (
        {model: set(kinds) for model, kinds in models.items()} if isinstance(models, Mapping) else dict.fromkeys(models)
    )
    model_ids = sorted(kinds_of)

    def running(kinds: Iterable[str]) -> list[str]:
        wanted = set(kinds)
        return [model for model in model_ids if kinds_of[model] is None or kinds_of[model] & wanted]  # type: ignore[operator]

    if model_ids:
        for path, item in schema["paths"].items():
            for op in item.values():
                for parameter in op.get("parameters", []) if isinstance(op, dict) else []:
                    if parameter.get("name") == "model" and parameter.get("in") == "path":
                        parameter["schema"] = model_enum(running(PATH_MODEL_KINDS.get(path, KINDS)) or model_ids)
        for body, kinds in BODY_KINDS.items():
            if body in components and "model" in components[body].get("properties", {}):
                ids = running(kinds) or model_ids
                components[body]["properties"]["model"] = {"anyOf": [model_enum(ids), {"type": "null"}]}
        if "JobCreate" in components and "model" in components["JobCreate"].get("properties", {}):
            components["JobCreate"]["properties"]["model"] = model_enum(model_ids)
    if names:
        for item in schema["paths"].values():
            for op in item.values():
                for parameter in op.get("parameters", []) if isinstance(op, dict) else []:
                    if parameter.get("name") == "machine" and parameter.get("in") == "path":
                        parameter["schema"] = {"type": "string", "enum": names}
        bodies = {
            ref.rsplit("/", 1)[-1]
            for item in schema["paths"].values()
            for op in item.values()
            if isinstance(op, dict)
            for media in op.get("requestBody", {}).get("content", {}).values()
            if isinstance(ref := media.get("schema", {}).get("$ref"), str)
        }
        for name in sorted(bodies):  # every request body's target: JobCreate, JobRequeue, the OpenAI and TGI ones
            component = components.get(name)
            target = component.get("properties", {}).get("target") if isinstance(component, dict) else None
            if target is None:
                continue
            machine = {"type": "string", "enum": [*names, "auto"], "description": target.get("description", "")}
            if "default" in target:
                machine["default"] = target["default"]
            nullable = "anyOf" in target and {"type": "null"} in target["anyOf"]
            component["properties"]["target"] = {"anyOf": [machine, {"type": "null"}]} if nullable else machine
    if "ImageGeneration" in components and "size" in components["ImageGeneration"].get("properties", {}):
        components["ImageGeneration"]["properties"]["size"] = size_schema(broadest(limits or {}))
    stated_limits(components, broadest(limits or {}))
    integer_bounds(components)
    if "JobCreate" in components:
        create = components["JobCreate"]
        create["properties"].pop("params", None)
        base = {
            key: create["properties"][key] for key in ("model", "target", "webhook_url") if key in create["properties"]
        }
        variants = []
        for variant in kind_params(broadest(limits or {})):
            kind = variant["properties"]["kind"]["const"]
            ids = running([kind]) if model_ids else []
            if model_ids and not ids:
                continue  # no registered model runs this kind: any such body is refused
            adapters = variant["properties"]["params"]["properties"].get("adapters")
            if adapters is not None and model_ids:  # the registered adapters (none: no entry at all)
                registered = [model for model in model_ids if ADAPTER_KIND in (kinds_of[model] or ())]
                if registered:
                    adapters["items"]["properties"]["id"] = model_enum(registered, "a registered adapter")
                else:
                    adapters["maxItems"] = 0
            expander = variant["properties"]["params"]["properties"].get("expand_prompt")
            if expander is not None and model_ids and running(["text"]):  # the text models that can expand
                expander["anyOf"][0] = {
                    **model_enum(running(["text"]), "a registered text model"),
                    "description": expander["anyOf"][0].get("description", ""),
                }
            variant["properties"] = {**base, **({"model": model_enum(ids)} if ids else {}), **variant["properties"]}
            variants.append(variant)
        components["JobCreate"] = {
            "title": "JobCreate",
            "description": create.get("description", ""),
            "oneOf": variants or kind_params(broadest(limits or {})),
        }
    components["Error"] = ERROR_BODY
    components["OpenAIError"] = OPENAI_ERROR_BODY
    components["TGIError"] = TGI_ERROR_BODY
    operation_ids = {
        op.get("operationId") for item in schema["paths"].values() for op in item.values() if isinstance(op, dict)
    }
    for path, item in schema["paths"].items():
        for method, op in item.items():
            if not isinstance(op, dict):
                continue
            statuses = set(ROUTE_STATUSES.get((method, path), ()))
            parameters = op.get("parameters", [])
            if "requestBody" in op:
                statuses |= {400, 413, 422}
            if parameters:
                statuses.add(422)
            if op.get("security"):
                statuses.add(401)
            if any(parameter.get("in") == "path" for parameter in parameters):
                statuses.add(404)
            if (method, path) not in OPEN_ROUTES:
                statuses.add(503)
            body = "OpenAIError" if path.startswith(OPENAI_PREFIXES) else "TGIError" if is_tgi_route(path) else "Error"
            error_schema: dict[str, Any] = {"$ref": f"#/components/schemas/{body}"}
            if path in EITHER_ERROR_PATHS:
                error_schema = {"anyOf": [error_schema, {"$ref": "#/components/schemas/TGIError"}]}
            responses = op.setdefault("responses", {})
            if path in STREAM_ROUTES and "200" in responses:  # `stream: true` answers events
                responses["200"].setdefault("content", {})["text/event-stream"] = {"schema": SSE_EVENT}
            for answer in responses.values():  # a stream's schema describes one event (OpenAPI 3.1)
                stream = answer.get("content", {}).get("text/event-stream") if isinstance(answer, dict) else None
                if stream is not None and stream.get("schema", {}).get("type") == "string":
                    stream["schema"] = SSE_EVENT
            for status in sorted(statuses):
                responses[str(status)] = {
                    "description": DESCRIPTIONS[status],
                    "content": {"application/json": {"schema": error_schema}},
                }
            if (method, path) == ("post", "/v1/jobs"):
                responses["200"] = {
                    "description": "?dry_run=true: the decision, every machine with the filter that "
                    "excluded it or its expected-finish breakdown (seconds), and under `memory` the "
                    "figures that decided (weights, working, warm, committed, usable: bytes, and "
                    "`text` in MiB/GiB); "
                    "nothing is enqueued",
                    "content": {"application/json": {"schema": {"type": "object"}}},
                }
                links = {name: link for name, link in job_links().items() if link["operationId"] in operation_ids}
                responses.setdefault("202", {"description": "accepted"})["links"] = links
    components.pop("HTTPValidationError", None)
    components.pop("ValidationError", None)
    text = json.dumps(schema).replace("#/components/schemas/HTTPValidationError", "#/components/schemas/Error")
    return json.loads(text)


def part_of(schema: dict[str, Any], *, internal: bool) -> dict[str, Any]:
    """The OpenAPI document of the internal routes (``internal``) or of all the others, with
    only the component schemas and security schemes its operations reference."""
    paths = {path: item for path, item in schema["paths"].items() if path.startswith(INTERNAL_PREFIX) == internal}
    components = schema.get("components", {})
    defined = components.get("schemas", {})
    wanted: set[str] = set()
    pending: list[Any] = [paths]
    while pending:
        refs = set(re.findall(r'"\$ref": "#/components/schemas/([^"]+)"', json.dumps(pending.pop()))) - wanted
        wanted |= refs
        pending.extend(defined[name] for name in refs if name in defined)
    used_schemes = {
        name
        for item in paths.values()
        for op in item.values()
        if isinstance(op, dict)
        for requirement in op.get("security", [])
        for name in requirement
    }
    kept = {
        "schemas": {name: defined[name] for name in sorted(wanted) if name in defined},
        "securitySchemes": {
            name: scheme for name, scheme in components.get("securitySchemes", {}).items() if name in used_schemes
        },
    }
    return {**schema, "paths": paths, "components": {key: value for key, value in kept.items() if value}}


def path_pattern(template: str) -> re.Pattern[str]:
    """A regular expression matching the concrete paths of an OpenAPI path template."""
    parts = re.split(r"(\{[^}]+\})", template)
    regex = "".join(
        ("(.+)" if part.endswith(":path}") else "([^/]+)") if part.startswith("{") else re.escape(part)
        for part in parts
    )
    return re.compile(f"^{regex}$")
