"""The base of every JSON request body the server validates (R22): a boolean or a string is no
number. Pydantic's lax mode reads ``false`` as ``0.0`` for a ``float`` field, ``true`` as ``1``
and ``"2"`` as ``2`` for an ``int`` one, so a body the OpenAPI schema calls invalid
(``"guidance_scale": false``, ``"n": "2"``) would run, where the same value as a job param
(``POST /v1/jobs``) is refused; here it is a 422 naming the field. Strict mode everywhere would
refuse too much (enums and literals from JSON strings), so only numbers are made strict.
"""

from __future__ import annotations

import functools
import json
import types
import typing
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from pydantic import BaseModel, ValidationInfo, field_validator

from app.core.errors import Rejected


def _is_number(annotation: Any) -> bool:
    """An int or float annotation (``int | None``, ``Annotated[float, ...]`` included) that
    does not also allow a boolean."""

    def flat(tp: Any) -> set[Any]:
        origin = typing.get_origin(tp)
        if origin is typing.Annotated:
            return flat(typing.get_args(tp)[0])
        if origin in (typing.Union, types.UnionType):
            return set().union(*(flat(arg) for arg in typing.get_args(tp)))
        return {tp}

    members = flat(annotation)
    return bool(members & {int, float}) and bool not in members


def _is_boolean(annotation: Any) -> bool:
    """A bool annotation (``bool | None`` included) that allows no other type but None."""
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _is_boolean(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        members = set(typing.get_args(annotation)) - {type(None)}
        return members == {bool}
    return annotation is bool


class RequestBody(BaseModel):
    """A request body model: fields typed ``int`` or ``float`` refuse ``true``, ``false`` and
    strings, and fields typed ``bool`` refuse anything but ``true`` and ``false`` (lax mode reads
    ``0``, ``1``, ``"yes"`` as booleans: a body the schema calls invalid would run)."""

    @classmethod
    @functools.cache
    def _number_fields(cls) -> frozenset[str]:
        return frozenset(name for name, info in cls.model_fields.items() if _is_number(info.annotation))

    @classmethod
    @functools.cache
    def _boolean_fields(cls) -> frozenset[str]:
        return frozenset(name for name, info in cls.model_fields.items() if _is_boolean(info.annotation))

    @field_validator("*", mode="before")
    @classmethod
    def _no_boolean_for_a_number(cls, value: Any, info: ValidationInfo) -> Any:
        if isinstance(value, bool | str) and info.field_name in cls._number_fields():
            raise ValueError(f"must be a number, not a {'boolean' if isinstance(value, bool) else 'string'}")
        if value is not None and not isinstance(value, bool) and info.field_name in cls._boolean_fields():
            raise ValueError("must be true or false")
        return value


def refuse_unknown(unknown: Sequence[str], takes: Iterable[str], where: str, prefix: str = "") -> None:
    """Refuse the fields of a request that ``where`` does not take, instead of ignoring them (R22):
    a misspelt field (``max_tokenz``, ``stepz``, a top-level ``paramters``) would otherwise run with
    the defaults. The one home of that refusal for the routes whose bodies carry extras (the OpenAI,
    TGI and Hugging Face routes; ``POST /v1/jobs`` refuses its own through its schema and
    ``app/jobs/validation.py`` ``check_known_params``). The message starts as OpenAI's
    (``Unrecognized request argument supplied: `NAME```) and lists what ``where`` takes.

    Raises:
        Rejected: reason ``unknown_param`` when ``unknown`` is not empty; ``param`` names the
            first (with ``prefix``, e.g. ``parameters.``).
    """
    if not unknown:
        return
    named = ", ".join(f"`{prefix}{name}`" for name in unknown)
    raise Rejected(
        f"Unrecognized request argument supplied: {named} (the fields of {where}: {', '.join(takes)})",
        reason="unknown_param",
        param=f"{prefix}{unknown[0]}",
    )


ANY_VALUE = object()
"""In a field's neutral values (:func:`is_neutral`): every value is neutral, for a field that
labels a request without changing its answer (OpenAI's ``user``, ``metadata``)."""


def is_neutral(value: Any, neutral: Iterable[Any]) -> bool:
    """Whether ``value`` (as parsed from JSON) is null or one of ``neutral``, compared as JSON (so
    ``false`` is not ``0`` and ``0`` is not ``0.0``: list each form a neutral value takes), or
    ``neutral`` holds :data:`ANY_VALUE`."""
    neutral = tuple(neutral)
    if value is None or any(each is ANY_VALUE for each in neutral):
        return True
    shown = json.dumps(value, sort_keys=True)
    return any(shown == json.dumps(each, sort_keys=True) for each in neutral)


def refuse_unsupported(
    extras: Mapping[str, Any],
    unsupported: Mapping[str, tuple[Any, ...]],
    takes: Iterable[str],
    where: str,
    prefix: str = "",
) -> None:
    """Refuse a request's extra fields (``extras``, pydantic's ``model_extra``): a field of
    ``unsupported`` (one the API Homefleet follows has, and Homefleet does not run) unless it holds
    a value that changes nothing (null, or one of its neutral values), naming it; any other field
    through :func:`refuse_unknown`.

    Raises:
        Rejected: reason ``unknown_param``, ``param`` the field (with ``prefix``).
    """
    for name, value in extras.items():
        if name in unsupported and not is_neutral(value, unsupported[name]):
            neutral = " or ".join(["null", *(json.dumps(each) for each in unsupported[name] if each is not None)])
            raise Rejected(
                f"`{prefix}{name}` is not supported by Homefleet (in {where}); it is accepted only as {neutral} "
                "(no effect)",
                reason="unknown_param",
                param=f"{prefix}{name}",
            )
    refuse_unknown([name for name in extras if name not in unsupported], takes, where, prefix)
