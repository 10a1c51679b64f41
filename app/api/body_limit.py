"""Size limits on request bodies, by route (R22: refuse before anything is stored or enqueued).

Every JSON body is read whole before a route sees it (FastAPI parses it into a model), and a
refused submission keeps its params in the journal (R19): without a limit one request with a
20 MB prompt cost 20 MB of memory, 40 MB of journal and WAL, and a 20 MB job record. Every
body counts, whatever its ``Content-Type`` says: FastAPI reads a body it cannot parse whole
too. The key or token is checked before this limit, from the headers alone
(app/api/auth.py ``Authenticate``). The body is counted as it streams by, never held here: an
upload goes on to FastAPI's multipart parser, which spools files past 1 MiB to disk. The upload routes (``/v1/files``,
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
    rendered by ``render(path, error)``) from its ``Content-Length`` alone, before the route
    runs; or, for a chunked body, as soon as the bytes read pass the limit: the route's read
    then raises :class:`RequestTooLarge` and whatever the route would answer is dropped. The
    body is counted as it is read, never buffered here."""

    def __init__(
        self,
        app: ASGIApp,
        max_bytes: int,
        routes: Sequence[RouteLimit],
        render: Callable[[str, HomefleetError], Response],
    ) -> None:
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
        size = 0
        refused = started = False

        async def counted() -> Message:
            nonlocal size, refused
            message = await receive()
            if message["type"] == "http.request":
                size += len(message.get("body", b""))
                if size > limit.max_bytes:
                    error = self._error(limit, f"more than {limit.max_bytes} bytes")
                    if not started and not refused:
                        refused = True
                        await self.render(scope["path"], error)(scope, receive, send)
                    raise error
            return message

        async def unless_refused(message: Message) -> None:
            nonlocal started
            if refused:
                return  # the 413 went out; the route's own answer to the aborted read is dropped
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted, unless_refused)
        except Exception:
            if not refused:
                raise

    @staticmethod
    def _error(limit: RouteLimit, got: str) -> RequestTooLarge:
        return RequestTooLarge(f"the request body must be at most {limit.max_bytes} bytes ({limit.setting}), got {got}")

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, limit: RouteLimit, got: str) -> None:
        await self.render(scope["path"], self._error(limit, got))(scope, receive, send)
