"""A size limit on request bodies other than uploads (R22: refuse before anything is stored or
enqueued).

Every JSON body is read whole before a route sees it (FastAPI parses it into a model), and a
refused submission keeps its params in the journal (R19): without a limit one request with a
20 MB prompt cost 20 MB of memory, 40 MB of journal and WAL, and a 20 MB job record. Uploads
(``multipart/form-data``: ``/v1/files``, ``/v1/images/edits``, a worker's result) have their
own limits (``max_input_bytes``, ``max_result_bytes``) and pass through. Any other body counts,
whatever its ``Content-Type`` says (FastAPI parses a body without one as JSON).
"""

from __future__ import annotations

from collections.abc import Callable

from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.errors import HomefleetError


class RequestTooLarge(HomefleetError):
    """Raised when a JSON request body is larger than ``max_request_bytes`` (413)."""

    status_code = 413
    default_reason = "request_too_large"


class BodyLimit:
    """ASGI middleware: a request whose body (not an upload) is over ``max_bytes`` is answered 413
    (``request_too_large``, rendered by ``render(path, error)``) from its ``Content-Length``
    alone, or as soon as the bytes read pass the limit (chunked bodies); the route never runs.
    Other requests pass through untouched; a body within the limit is handed on as read."""

    def __init__(self, app: ASGIApp, max_bytes: int, render: Callable[[str, HomefleetError], Response]) -> None:
        self.app, self.max_bytes, self.render = app, max_bytes, render

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or _upload(scope):
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            await self._refuse(scope, receive, send, f"{int(declared)} bytes")
            return
        read: list[Message] = []
        size = 0
        while True:
            message = await receive()
            read.append(message)
            if message["type"] != "http.request":
                break
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                await self._refuse(scope, receive, send, f"more than {self.max_bytes} bytes")
                return
            if not message.get("more_body", False):
                break

        async def replay() -> Message:
            return read.pop(0) if read else await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, got: str) -> None:
        error = RequestTooLarge(f"the request body must be at most {self.max_bytes} bytes (max_request_bytes), "
                                f"got {got}")
        await self.render(scope["path"], error)(scope, receive, send)


def _upload(scope: Scope) -> bool:
    content_type = dict(scope["headers"]).get(b"content-type", b"").split(b";")[0].strip().lower()
    return content_type == b"multipart/form-data"
