"""Size limits on request bodies, by route (R22: refuse before anything is stored or enqueued).

Every JSON body is read whole before a route sees it (FastAPI parses it into a model), and a
refused submission keeps its params in the journal (R19): without a limit one request with a
20 MB prompt cost 20 MB of memory, 40 MB of journal and WAL, and a 20 MB job record. Every
body counts, whatever its ``Content-Type`` says: FastAPI reads a body it cannot parse whole
too, and before the API key is checked. The upload routes (``/v1/files``,
``/v1/images/edits``, a worker's result) get their own limit: their files' limits
(``max_input_bytes``, the families' ``max_upload_bytes``, ``max_result_bytes``) plus room for
the multipart framing and form fields; every other route gets ``max_request_bytes``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.core.errors import HomefleetError

MULTIPART_ROOM = 1024 * 1024  # bytes an upload's body may carry beyond its files: framing, form fields


class RequestTooLarge(HomefleetError):
    """Raised when a request body is larger than its route's limit (413)."""

    status_code = 413
    default_reason = "request_too_large"


@dataclass(frozen=True)
class RouteLimit:
    """Bodies of requests whose path matches ``path`` may have ``max_bytes``; ``setting`` names
    where that figure comes from, for the message."""

    path: re.Pattern[str]
    max_bytes: int
    setting: str


class BodyLimit:
    """ASGI middleware: a request body over its route's limit (the first of ``routes`` whose
    pattern matches its path, else ``max_bytes``) is answered 413 (``request_too_large``,
    rendered by ``render(path, error)``) from its ``Content-Length`` alone, or as soon as the
    bytes read pass the limit (chunked bodies); the route never runs. A body within the limit
    is handed on as read."""

    def __init__(self, app: ASGIApp, max_bytes: int, routes: Sequence[RouteLimit],
                 render: Callable[[str, HomefleetError], Response]) -> None:
        self.app, self.routes, self.render = app, routes, render
        self.default = RouteLimit(re.compile(".*"), max_bytes, "max_request_bytes")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        limit = next((route for route in self.routes if route.path.fullmatch(scope["path"])), self.default)
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > limit.max_bytes:
            await self._refuse(scope, receive, send, limit, f"{int(declared)} bytes")
            return
        read: list[Message] = []
        size = 0
        while True:
            message = await receive()
            read.append(message)
            if message["type"] != "http.request":
                break
            size += len(message.get("body", b""))
            if size > limit.max_bytes:
                await self._refuse(scope, receive, send, limit, f"more than {limit.max_bytes} bytes")
                return
            if not message.get("more_body", False):
                break

        async def replay() -> Message:
            return read.pop(0) if read else await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, limit: RouteLimit, got: str) -> None:
        error = RequestTooLarge(f"the request body must be at most {limit.max_bytes} bytes ({limit.setting}), "
                                f"got {got}")
        await self.render(scope["path"], error)(scope, receive, send)
