"""Constrained text output (docs/api.md, "Constrained output"), one home for the server's check and the worker's
decoding: a text job's ``grammar`` param (TGI's shape) is compiled with llguidance against the
model's own tokenizer.

``grammar`` is ``{"type": "json", "value": <JSON schema, an object or its JSON text>}`` or
``{"type": "regex", "value": <regular expression, Rust regex syntax>}``. OpenAI's
``response_format`` becomes one (:func:`from_response_format`).

Why llguidance (docs/api.md, "Constrained output"): it computes the allowed-token mask for
each step in Rust in tens of microseconds without precomputing an automaton over the whole
vocabulary (outlines' cost on a new schema), takes both JSON schemas and regular expressions
(and Lark grammars) in one matcher, is offered for the same job by vLLM, SGLang and llama.cpp,
ships abi3 wheels with no GPU dependency, and builds its tokenizer straight from a fast
Hugging Face tokenizer (``llguidance.hf``).

The server compiles a constraint before any device (:func:`check`, a 422 when it fails); the
worker keeps each compiled matcher per (tokenizer, constraint) (:func:`matcher`, LRU) and
decodes with a fresh copy of it.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

GRAMMAR_TYPES = ("json", "regex")
MAX_GRAMMAR_CHARS = 64 * 1024
"""The longest constraint (its JSON text) a job may carry."""
CACHED_MATCHERS = 64
JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False}
"""llguidance's JSON options: compact JSON (``,`` and ``:``, no whitespace between tokens), so
a model cannot spend its ``max_new_tokens`` on whitespace; a schema's own ``x-guidance`` wins."""


def grammar_of(constraint: Any) -> str:
    """The llguidance grammar of a ``grammar`` param (module docstring).

    Raises:
        ValueError: not ``{"type": "json" | "regex", "value": ...}``, a value of the wrong
            type, a schema that is not JSON, or a constraint over :data:`MAX_GRAMMAR_CHARS`.
    """
    from llguidance import LLMatcher

    if not isinstance(constraint, Mapping) or set(constraint) != {"type", "value"}:
        raise ValueError('must be {"type": "json" | "regex", "value": ...}')
    kind, value = constraint["type"], constraint["value"]
    if kind not in GRAMMAR_TYPES:
        raise ValueError(f"type must be one of {', '.join(GRAMMAR_TYPES)}, got {kind!r}")
    if len(json.dumps(value)) > MAX_GRAMMAR_CHARS:
        raise ValueError(f"value must be at most {MAX_GRAMMAR_CHARS} characters of JSON")
    if kind == "regex":
        if not isinstance(value, str) or not value:
            raise ValueError("a regex value must be a non-empty string")
        return str(LLMatcher.grammar_from_regex(value))
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as error:
            raise ValueError(f"a json value must be a JSON schema, got text that is not JSON: {error}") from error
    if not isinstance(value, dict | bool):
        raise ValueError(f"a json value must be a JSON schema (an object), got {type(value).__name__}")
    schema = value if isinstance(value, dict) else json.dumps(value)  # true / false: the same grammar as text
    return str(LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS))


class FormatRefused(ValueError):
    """A ``response_format`` or ``grammar`` Homefleet cannot honour: ``field`` names the part at
    fault relative to it (``""``, ``.type``, ``.json_schema.schema``, ``.strictness``...)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


RESPONSE_FORMAT_KEYS = {
    "text": {"type"},
    "json_object": {"type", "value"},
    "json": {"type", "value"},
    "regex": {"type", "value"},
    "json_schema": {"type", "json_schema", "value", "schema"},
}
"""The keys each ``response_format`` type may carry; any other is refused, never dropped."""
SCHEMA_SPEC_KEYS = {"name", "schema", "strict", "description"}
"""OpenAI's ``json_schema`` object (``strict`` is always honoured: the constraint is enforced)."""
SCHEMA_SPEC_TYPES: dict[str, type] = {"name": str, "description": str, "strict": bool}
"""The type of each of its keys but ``schema`` (the API description states the same)."""


def _schema_of(value: Any, field: str) -> dict[str, Any] | bool:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as error:
            raise FormatRefused(field, f"must be a JSON schema, got text that is not JSON: {error}") from error
    if not isinstance(value, dict | bool):
        raise FormatRefused(field, f"must be a JSON schema (an object), got {type(value).__name__}")
    return value


def _schema_spec(spec: Any, field: str) -> dict[str, Any] | bool:
    """The schema of OpenAI's ``{"name", "schema", "strict"?, "description"?}`` at ``field``."""
    if not isinstance(spec, Mapping) or "schema" not in spec:
        raise FormatRefused(field, 'must be {"name": ..., "schema": {<JSON schema>}}')
    extra = sorted(set(spec) - SCHEMA_SPEC_KEYS)
    if extra:
        raise FormatRefused(f"{field}.{extra[0]}", f"is not supported (takes {', '.join(sorted(SCHEMA_SPEC_KEYS))})")
    for key, kind in SCHEMA_SPEC_TYPES.items():
        if key in spec and not isinstance(spec[key], kind):
            raise FormatRefused(f"{field}.{key}", f"must be a {kind.__name__}, got {type(spec[key]).__name__}")
    return _schema_of(spec["schema"], f"{field}.schema")


def from_response_format(response_format: Any) -> dict[str, Any] | None:
    """The ``grammar`` of a chat or completion's ``response_format``, in every form the clients
    send, or None for no constraint (``{"type": "text"}``, None):

    - OpenAI: ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"?}}``;
      ``{"type": "json_object"}`` (any JSON object);
    - TGI / ``huggingface_hub``: ``{"type": "json", "value": <schema>}``,
      ``{"type": "json_object", "value": <schema>}`` (what ``InferenceClient.chat_completion``
      rewrites OpenAI's ``json_schema`` to), ``{"type": "json_schema", "value": {"name",
      "schema"}}``, ``{"type": "regex", "value": "<regex>"}``;
    - ``{"type": "json_schema", "schema": <schema>}`` (the flattened form some providers take).

    A schema may be given as its JSON text. Nothing is dropped: a key a type does not take is
    refused, naming it.

    Raises:
        FormatRefused: another type, a missing or malformed schema or regex, or an unknown key;
            ``field`` names it (e.g. ``.json_schema.schema``).
    """
    if response_format is None:
        return None
    if not isinstance(response_format, Mapping):
        raise FormatRefused("", f'must be an object {{"type": {" | ".join(RESPONSE_FORMAT_KEYS)}, ...}}')
    kind = response_format.get("type")
    if not isinstance(kind, str) or kind not in RESPONSE_FORMAT_KEYS:  # a dict or list is unhashable: 422, not 500
        raise FormatRefused(".type", f"must be one of {', '.join(RESPONSE_FORMAT_KEYS)}, got {kind!r}")
    extra = sorted(set(response_format) - RESPONSE_FORMAT_KEYS[kind])
    if extra:
        raise FormatRefused(
            f".{extra[0]}",
            f"is not taken with type {kind!r} (it takes {', '.join(sorted(RESPONSE_FORMAT_KEYS[kind]))})",
        )
    if kind == "text":
        return None
    if kind == "regex":
        value = response_format.get("value")
        if not isinstance(value, str) or not value:
            raise FormatRefused(".value", "a regex value must be a non-empty string")
        return {"type": "regex", "value": value}
    if kind == "json_schema":
        given = [key for key in ("json_schema", "value", "schema") if key in response_format]
        if len(given) != 1:
            raise FormatRefused(
                ".json_schema",
                'must be given once: {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}',
            )
        key = given[0]
        if key == "schema":
            return {"type": "json", "value": _schema_of(response_format["schema"], ".schema")}
        return {"type": "json", "value": _schema_spec(response_format[key], f".{key}")}
    if "value" not in response_format:
        if kind == "json":
            raise FormatRefused(".value", 'type "json" takes its JSON schema as value')
        return {"type": "json", "value": {"type": "object"}}  # json_object alone: any JSON object
    return {"type": "json", "value": _schema_of(response_format["value"], ".value")}


def from_tgi_grammar(grammar: Any) -> dict[str, Any] | None:
    """The ``grammar`` param of TGI's ``parameters.grammar``: ``{"type": "json" | "regex",
    "value"}`` as it is, and ``{"type": "json_schema", "value": {"name", "schema"}}`` (TGI's
    third form) as a json one; None for None.

    Raises:
        FormatRefused: as :func:`from_response_format` (``text`` and ``json_object`` are not TGI's).
    """
    if grammar is None:
        return None
    if isinstance(grammar, Mapping) and grammar.get("type") not in ("json", "regex", "json_schema"):
        raise FormatRefused(".type", f"must be one of json, regex, json_schema, got {grammar.get('type')!r}")
    if isinstance(grammar, Mapping) and grammar.get("type") in ("json", "regex"):
        return dict(grammar)  # checked with the job's params (:func:`check`), as POST /v1/jobs' grammar
    return from_response_format(grammar)


def vocab_size(tokenizer: Any, model_vocab: int | None = None) -> int:
    """Columns of the mask: the model's ``vocab_size`` (its logits) when known, else the tokenizer's."""
    return int(model_vocab or len(tokenizer))


@functools.lru_cache(maxsize=16)
def ll_tokenizer(tokenizer: Any, n_vocab: int, eos: tuple[int, ...] = ()) -> Any:
    """llguidance's tokenizer of a fast Hugging Face tokenizer (about a second: cached per
    tokenizer and ``eos``). ``eos``: the ids that end the model's turn
    (:func:`app.core.textgen.end_token_ids`), each of which the mask allows once the constraint
    is complete; empty: the tokenizer's EOS only."""
    import llguidance.hf

    return llguidance.hf.from_tokenizer(tokenizer, n_vocab=n_vocab, eos_token=list(eos) or None)


def check(constraint: Any, tokenizer: Any, n_vocab: int) -> str:
    """Compile ``constraint`` for ``tokenizer`` as the worker will; returns its grammar.

    Raises:
        ValueError: the constraint is malformed or does not compile (llguidance's message).
    """
    from llguidance import LLMatcher

    grammar = grammar_of(constraint)
    failed, messages = LLMatcher.validate_grammar_with_warnings(grammar, ll_tokenizer(tokenizer, n_vocab))
    if failed:
        raise ValueError(f"does not compile: {messages[0] if messages else 'invalid grammar'}")
    return grammar


def matcher(constraint: Mapping[str, Any], tokenizer: Any, n_vocab: int, eos: tuple[int, ...] = ()) -> Any:
    """A fresh ``llguidance.LLMatcher`` of ``constraint``: a copy of the one compiled for this
    (tokenizer, end ids ``eos`` as :func:`ll_tokenizer` takes them, constraint), compiled on
    first use and kept (LRU, :data:`CACHED_MATCHERS`).

    Raises:
        ValueError: the constraint does not compile.
    """
    return _compiled(tokenizer, n_vocab, json.dumps(constraint, sort_keys=True), tuple(eos)).deep_copy()


@functools.lru_cache(maxsize=CACHED_MATCHERS)
def _compiled(tokenizer: Any, n_vocab: int, constraint_json: str, eos: tuple[int, ...] = ()) -> Any:
    from llguidance import LLMatcher

    compiled = LLMatcher(ll_tokenizer(tokenizer, n_vocab, eos), grammar_of(json.loads(constraint_json)), log_level=0)
    if compiled.is_error():
        raise ValueError(f"does not compile: {compiled.get_error()}")
    return compiled


def compile_cache_info() -> Any:
    """``functools`` cache statistics of the compiled matchers (hits, misses, currsize)."""
    return _compiled.cache_info()
