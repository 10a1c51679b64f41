"""Request bodies as strict JSON: what Python's ``json`` module accepts beyond RFC 8259
is refused before a route, a tokenizer or the journal sees it.

Python's parser takes ``NaN``, ``Infinity`` and ``-Infinity``, turns ``1e999`` into ``inf``
and keeps a lone UTF-16 surrogate (``"\\ud800"``) as a ``str`` that cannot be encoded as
UTF-8. None of these can be stored, tokenized or answered back (``JSONResponse`` refuses
non-finite floats; SQLite and Redis refuse surrogates). :class:`StrictJsonRoute` parses every
JSON body once, before FastAPI does, and refuses such a value with 422 ``invalid_request``
naming its field (``body.params.prompt``). :func:`printable` makes any value safe to echo in
an error body, so the validation-error handler itself never fails.
"""

from __future__ import annotations

import email.message
import json
import math
from collections.abc import Callable, Coroutine, Iterator
from typing import Any

from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from starlette.requests import Request
from starlette.responses import Response

Location = tuple[str | int, ...]


def unencodable(text: str) -> bool:
    """Whether ``text`` holds a character UTF-8 cannot encode (a lone surrogate)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def faults(value: object, location: Location = ()) -> Iterator[tuple[Location, str, object]]:
    """Every non-finite number and unencodable string (keys included) in a parsed JSON value:
    ``(location, message, value)``, depth first."""
    if isinstance(value, float) and not math.isfinite(value):
        yield location, "NaN, Infinity and numbers out of range (1e999) are not valid JSON numbers", value
    elif isinstance(value, str) and unencodable(value):
        yield location, "the string holds a lone UTF-16 surrogate; it is not valid UTF-8 text", value
    elif isinstance(value, dict):
        for key, item in value.items():
            if isinstance(key, str) and unencodable(key):
                yield (
                    (*location, printable(key)),
                    "the key holds a lone UTF-16 surrogate; it is not valid UTF-8 text",
                    key,
                )
            yield from faults(item, (*location, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from faults(item, (*location, index))


def printable(value: object) -> Any:
    """``value`` with every non-finite float as its ``repr`` (``"nan"``) and every unencodable
    string backslash-escaped (``"\\\\ud800"``): always serializable by ``JSONResponse``."""
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    if isinstance(value, str):
        return value.encode("utf-8", "backslashreplace").decode("utf-8") if unencodable(value) else value
    if isinstance(value, dict):
        return {printable(key): printable(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [printable(item) for item in value]
    return value


def strict_loads(body: bytes) -> Any:
    """Parse ``body`` as RFC 8259 JSON.

    Raises:
        RequestValidationError: not JSON, not UTF-8, or holding a non-finite number or a
            lone surrogate; each error's ``loc`` is ``("body", *path)`` of the value at fault.
    """
    try:
        value = json.loads(body)
    except (ValueError, RecursionError) as error:  # JSONDecodeError, UnicodeDecodeError
        # The whole body is at fault: its loc names no field (the message gives the character)
        raise RequestValidationError(
            [
                {
                    "type": "json_invalid",
                    "loc": ("body",),
                    "msg": f"invalid JSON: {error}"[:300],
                    "input": {},
                }
            ]
        ) from error
    errors = [
        {"type": "json_invalid", "loc": ("body", *location), "msg": message, "input": printable(bad)}
        for location, message, bad in faults(value)
    ]
    if errors:
        raise RequestValidationError(errors)
    return value


def is_json(request: Request) -> bool:
    """Whether FastAPI would parse this request's body as JSON (``application/json`` or
    ``application/*+json``)."""
    content_type = request.headers.get("content-type")
    if not content_type:
        return False
    message = email.message.Message()
    message["content-type"] = content_type
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (subtype == "json" or subtype.endswith("+json"))


class StrictJsonRequest(Request):
    """A request whose ``json()`` is :func:`strict_loads` (parsed once, then cached)."""

    async def json(self) -> Any:
        if not hasattr(self, "_strict_json"):
            self._strict_json = strict_loads(await self.body())
        return self._strict_json


class StrictJsonRoute(APIRoute):
    """An API route whose JSON body is checked by :func:`strict_loads` before FastAPI validates
    it: the route class of every router (``APIRouter(route_class=StrictJsonRoute)``)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        has_body = self.body_field is not None

        async def strict_handler(request: Request) -> Response:
            strict = StrictJsonRequest(request.scope, request.receive)
            if has_body and is_json(strict) and await strict.body():
                await strict.json()  # raises RequestValidationError, answered by create_app's handler
            return await handler(strict)

        return strict_handler
