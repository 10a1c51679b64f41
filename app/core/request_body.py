"""The base of every JSON request body the server validates (R22): a boolean or a string is no
number. Pydantic's lax mode reads ``false`` as ``0.0`` for a ``float`` field, ``true`` as ``1``
and ``"2"`` as ``2`` for an ``int`` one, so a body the OpenAPI schema calls invalid
(``"guidance_scale": false``, ``"n": "2"``) would run, where the same value as a job param
(``POST /v1/jobs``) is refused; here it is a 422 naming the field. Strict mode everywhere would
refuse too much (enums and literals from JSON strings), so only numbers are made strict.
"""

from __future__ import annotations

import functools
import types
import typing
from typing import Any

from pydantic import BaseModel, ValidationInfo, field_validator


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
