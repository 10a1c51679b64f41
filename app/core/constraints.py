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


def from_response_format(response_format: Any) -> dict[str, Any] | None:
    """The ``grammar`` of OpenAI's ``response_format``: ``{"type": "json_schema", "json_schema":
    {"schema": ...}}`` and ``{"type": "json_object"}`` (any JSON object); ``{"type": "text"}``
    and None: no constraint.

    Raises:
        ValueError: another type, or a ``json_schema`` without its ``schema``.
    """
    if response_format is None:
        return None
    if not isinstance(response_format, Mapping):
        raise ValueError('must be {"type": "text" | "json_object" | "json_schema", ...}')
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json", "value": {"type": "object"}}
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, Mapping) or not isinstance(spec.get("schema"), dict):
            raise ValueError('json_schema must be {"name": ..., "schema": {<JSON schema>}}')
        return {"type": "json", "value": dict(spec["schema"])}
    raise ValueError(f"type must be text, json_object or json_schema, got {kind!r}")


def vocab_size(tokenizer: Any, model_vocab: int | None = None) -> int:
    """Columns of the mask: the model's ``vocab_size`` (its logits) when known, else the tokenizer's."""
    return int(model_vocab or len(tokenizer))


@functools.lru_cache(maxsize=16)
def ll_tokenizer(tokenizer: Any, n_vocab: int) -> Any:
    """llguidance's tokenizer of a fast Hugging Face tokenizer (about a second: cached per tokenizer)."""
    import llguidance.hf

    return llguidance.hf.from_tokenizer(tokenizer, n_vocab=n_vocab)


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


def matcher(constraint: Mapping[str, Any], tokenizer: Any, n_vocab: int) -> Any:
    """A fresh ``llguidance.LLMatcher`` of ``constraint``: a copy of the one compiled for this
    (tokenizer, constraint), compiled on first use and kept (LRU, :data:`CACHED_MATCHERS`).

    Raises:
        ValueError: the constraint does not compile.
    """
    return _compiled(tokenizer, n_vocab, json.dumps(constraint, sort_keys=True)).deep_copy()


@functools.lru_cache(maxsize=CACHED_MATCHERS)
def _compiled(tokenizer: Any, n_vocab: int, constraint_json: str) -> Any:
    from llguidance import LLMatcher

    compiled = LLMatcher(ll_tokenizer(tokenizer, n_vocab), grammar_of(json.loads(constraint_json)), log_level=0)
    if compiled.is_error():
        raise ValueError(f"does not compile: {compiled.get_error()}")
    return compiled


def compile_cache_info() -> Any:
    """``functools`` cache statistics of the compiled matchers (hits, misses, currsize)."""
    return _compiled.cache_info()
