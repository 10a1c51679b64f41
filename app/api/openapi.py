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
from app.core.kinds import KINDS, MAX_SEED, OUTPUT_SIZE_FIELDS
from app.core.limits import MAX_MODEL_ID, FamilyLimits
from app.jobs.validation import MAX_ADAPTER_SCALE

ERROR_BODY: dict[str, Any] = {
    "title": "Error", "type": "object", "required": ["error"],
    "description": "Every Homefleet error: a machine-readable reason and a message naming the field, the value and "
                   "the limit (docs/api.md, Errors).",
    "properties": {
        "error": {"type": "object", "required": ["reason", "message"], "properties": {
            "reason": {"type": "string", "description": "e.g. invalid_width, unknown_model, queue_full, quota_queued"},
            "message": {"type": "string"},
            "job_id": {"type": "string", "description": "the journaled `rejected` job of a refused submission"},
        }},
        "detail": {"type": "array", "description": "validation details (422 invalid_request)", "items": {}},
    },
}
OPENAI_ERROR_BODY: dict[str, Any] = {
    "title": "OpenAIError", "type": "object", "required": ["error"],
    "description": "OpenAI's error shape, on the OpenAI and Hugging Face routes.",
    "properties": {"error": {"type": "object", "required": ["message", "type", "code"], "properties": {
        "message": {"type": "string"},
        "type": {"type": "string"},
        "param": {"type": ["string", "null"]},
        "code": {"type": "string", "description": "Homefleet's reason"},
        "job_ids": {"type": "array", "items": {"type": "string"},
                    "description": "the jobs this request submitted, on errors after a submission (R20, C10)"},
    }}},
}
TGI_ERROR_BODY: dict[str, Any] = {
    "title": "TGIError", "type": "object", "required": ["error", "error_type"],
    "description": "text-generation-inference's error shape, on TGI's routes (POST /, /generate, /generate_stream).",
    "properties": {
        "error": {"type": "string"},
        "error_type": {"type": "string", "description": "validation, overloaded, generation, incomplete_generation…"},
        "reason": {"type": "string", "description": "Homefleet's reason"},
        "job_ids": {"type": "array", "items": {"type": "string"},
                    "description": "the jobs this request submitted, on errors after a submission (R20, C10)"},
    },
}
DESCRIPTIONS = {
    400: "the body could not be parsed", 401: "no key, or not one of this server's", 403: "another machine's job",
    404: "no such job, machine, model, sync or file", 409: "the state forbids it (e.g. the job has ended, the "
    "machine is busy, the image job is still pending: job_pending)", 413: "the body is over its limit",
    422: "a value is refused: the message names the field, the value and the limit (R22)",
    429: "the machine's or the fleet's queue is full, or the API key is at its quota (quota_queued, "
    "quota_gpu_seconds; Retry-After, R23)", 500: "a job of an image request "
    "failed, or the server failed after submitting it (x-should-retry: false, job_ids)",
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
    ("post", "/"): (404, 409, 429, 500, 503),  # TGI's routes (app/api/routes/tgi.py)
    ("post", "/generate"): (404, 409, 429, 500, 503),
    ("post", "/generate_stream"): (404, 409, 429, 500, 503),
    ("post", "/hf/models/{model}"): (409, 429, 500, 503),
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
    numbers = {name: max(getattr(family, name) for family in families)
               for name, info in FamilyLimits.model_fields.items() if info.annotation is int}
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
        "prompt": {**text, "pattern": r"\S"}, "negative_prompt": text, "width": side, "height": side,
        "steps": {"type": "integer", "minimum": 1, "maximum": limits.max_steps},
        "frames": {"type": "integer", "minimum": 1, "maximum": limits.max_frames},
        "seed": {"type": "integer", "minimum": 0, "maximum": MAX_SEED},
        "n": {"type": "integer", "minimum": 1, "maximum": limits.max_batch,
              "description": "images in one job (image i: seed + i); at most the family's max_batch"},
        "image": {"type": "string", "pattern": r"^blake3:[0-9a-f]{64}$",
                  "description": "the id of a file uploaded with POST /v1/files"},
        "chat": {"type": "boolean", "description": "the prompt is chat-templated already"},
        "expand_prompt": {"type": "string", "minLength": 1, "maxLength": MAX_MODEL_ID,
                          "description": "a text model that expands the prompt first, as its own job"},
        "expanded_by": {"type": "string", "description": "set by the server: the expansion's text job"},
        "grammar": {"anyOf": [{"type": "null"}, {
            "type": "object", "required": ["type", "value"], "additionalProperties": False,
            "description": "the output's constraint (llguidance): a JSON schema or a regular expression",
            "properties": {"type": {"type": "string", "enum": ["json", "regex"]},
                           "value": {"anyOf": [{"type": "object"}, {"type": "string"}]}}}]},
        "adapters": {"type": "array", "maxItems": limits.max_adapters,
                     "description": "LoRA adapters for this job: registered adapters of the model's family, "
                                    "each id once; at most the family's max_adapters",
                     "items": {"type": "object", "required": ["id"], "additionalProperties": False, "properties": {
                         "id": {"type": "string", "minLength": 1, "maxLength": MAX_MODEL_ID},
                         "scale": {"type": "number", "minimum": -MAX_ADAPTER_SCALE, "maximum": MAX_ADAPTER_SCALE,
                                   "description": "the adapter's weight (default 1; 0: the model as it is)"}}}},
        "mask": {"type": "string", "pattern": r"^blake3:[0-9a-f]{64}$",
                 "description": "inpaint: the id of an uploaded mask of the image's size (white: repaint)"},
    }
    variants = []
    for name, spec in KINDS.items():
        properties: dict[str, Any] = {}
        for param in spec.accepted:
            if param in known:
                properties[param] = known[param]
            elif param in OUTPUT_SIZE_FIELDS:
                properties[param] = {"type": "integer", "description": "set by the server from the input image"}
        for number in spec.numbers:
            bound: dict[str, Any] = {"type": "integer" if number.integer else "number"}
            properties[number.name] = {**bound, "minimum": number.low, "maximum": number.high}
        if spec.formats:
            properties["format"] = {"type": "string", "enum": list(spec.formats)}
        required = [param for param in ("prompt", *spec.inputs) if param in properties and
                    (param != "prompt" or spec.prompt_required)]
        for param in NULL_IS_ABSENT:  # the server reads null as absent for these (app/jobs/validation.py)
            if param in properties and param not in required:
                properties[param] = {"anyOf": [properties[param], {"type": "null"}]}
        params: dict[str, Any] = {"type": "object", "properties": properties, "additionalProperties": False}
        if required:
            params["required"] = required
        variants.append({"type": "object", "title": f"JobCreate ({name})", "additionalProperties": False,
                         "required": ["model", "kind", "params"] if required else ["model", "kind"],
                         "properties": {"kind": {"type": "string", "const": name}, "params": params}})
    return variants


def documented(schema: dict[str, Any], machines: Iterable[str] = (),
               limits: Mapping[str, FamilyLimits] | None = None, models: Iterable[str] = ()) -> dict[str, Any]:
    """``schema`` with every operation's error statuses and links added (module docstring), the
    fleet's machine names as the values a machine parameter takes, the registered model ids
    as the values a model field takes (when there is one), and each kind's params."""
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    names = sorted(machines)
    model_ids = sorted(models)
    if model_ids:
        model_enum = {"type": "string", "enum": model_ids, "description": "a registered model id (GET /v1/models)"}
        for item in schema["paths"].values():
            for op in item.values():
                for parameter in op.get("parameters", []) if isinstance(op, dict) else []:
                    if parameter.get("name") == "model" and parameter.get("in") == "path":
                        parameter["schema"] = model_enum
        for body in ("JobCreate", "ImageGeneration", "Body_edit_images_v1_images_edits_post"):
            if body in components and "model" in components[body].get("properties", {}):
                optional = body != "JobCreate"
                components[body]["properties"]["model"] = (
                    {"anyOf": [model_enum, {"type": "null"}]} if optional else model_enum)
    if names:
        for item in schema["paths"].values():
            for op in item.values():
                for parameter in op.get("parameters", []) if isinstance(op, dict) else []:
                    if parameter.get("name") == "machine" and parameter.get("in") == "path":
                        parameter["schema"] = {"type": "string", "enum": names}
        for body in ("JobCreate", "ImageGeneration"):
            if body in components and "target" in components[body]["properties"]:
                target = components[body]["properties"]["target"]
                components[body]["properties"]["target"] = {
                    "type": "string", "enum": [*names, "auto"], "default": target.get("default"),
                    "description": target.get("description", "")}
    if "JobCreate" in components:
        create = components["JobCreate"]
        create["properties"].pop("params", None)
        base = {key: create["properties"][key] for key in ("model", "target", "webhook_url")
                if key in create["properties"]}
        variants = kind_params(broadest(limits or {}))
        for variant in variants:
            variant["properties"] = {**base, **variant["properties"]}
        components["JobCreate"] = {"title": "JobCreate", "description": create.get("description", ""),
                                   "oneOf": variants}
    components["Error"] = ERROR_BODY
    components["OpenAIError"] = OPENAI_ERROR_BODY
    components["TGIError"] = TGI_ERROR_BODY
    operation_ids = {op.get("operationId") for item in schema["paths"].values() for op in item.values()
                     if isinstance(op, dict)}
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
            responses = op.setdefault("responses", {})
            for status in sorted(statuses):
                responses[str(status)] = {"description": DESCRIPTIONS[status], "content": {
                    "application/json": {"schema": {"$ref": f"#/components/schemas/{body}"}}}}
            if (method, path) == ("post", "/v1/jobs"):
                responses["200"] = {"description": "?dry_run=true: the decision, every machine with the filter that "
                                    "excluded it or its expected-finish breakdown (seconds), and under `memory` the "
                                    "figures that decided (weights, working, warm, committed, usable: bytes, and "
                                    "`text` in MiB/GiB); "
                                    "nothing is enqueued",
                                    "content": {"application/json": {"schema": {"type": "object"}}}}
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
    used_schemes = {name for item in paths.values() for op in item.values() if isinstance(op, dict)
                    for requirement in op.get("security", []) for name in requirement}
    kept = {"schemas": {name: defined[name] for name in sorted(wanted) if name in defined},
            "securitySchemes": {name: scheme for name, scheme in components.get("securitySchemes", {}).items()
                                if name in used_schemes}}
    return {**schema, "paths": paths, "components": {key: value for key, value in kept.items() if value}}


def path_pattern(template: str) -> re.Pattern[str]:
    """A regular expression matching the concrete paths of an OpenAPI path template."""
    parts = re.split(r"(\{[^}]+\})", template)
    regex = "".join(("(.+)" if part.endswith(":path}") else "([^/]+)") if part.startswith("{") else re.escape(part)
                    for part in parts)
    return re.compile(f"^{regex}$")
