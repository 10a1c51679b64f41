"""The API's small request middlewares, written as pure ASGI, for submission latency
(docs/benchmarks.md, "Submission latency").

Starlette's ``@app.middleware("http")`` (``BaseHTTPMiddleware``) runs the rest of the app in a
task of its own and copies every response through a memory stream; three such layers cost
every request, a worker's claim included, more than the route itself on a 2-core host
(docs/benchmarks.md, "Submission latency"). These classes do the same work on the ASGI
messages directly. Their order is set in app/api/server.py ``create_app``.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Collection

from starlette.datastructures import MutableHeaders
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.core.errors import HomefleetError

#: ``(path pattern, methods)`` pairs: every method each path of the API takes
MethodTable = list[tuple[re.Pattern[str], set[str]]]


class RequestDuration:
    """Report each HTTP request's duration: ``observe(method, route, status, seconds)``, with
    ``route`` the path template the router matched (``/v1/jobs/{job_id}``) or ``"unmatched"``,
    and ``status`` the answer's status code as text (``"500"`` when the app raised)."""

    def __init__(self, app: ASGIApp, observe: Callable[[str, str, str, float], None]) -> None:
        self.app, self.observe = app, observe

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start_s, status = time.perf_counter(), 500

        async def send_noting_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_noting_status)
        finally:  # the router put the matched route in the scope
            route = getattr(scope.get("route"), "path", "unmatched")
            self.observe(scope["method"], route, str(status), time.perf_counter() - start_s)


class HeaderOnPaths:
    """Add the header ``name: value`` to the answers of requests for ``paths`` (exact paths)."""

    def __init__(self, app: ASGIApp, paths: Collection[str], name: str, value: str) -> None:
        self.app, self.paths, self.name, self.value = app, frozenset(paths), name, value

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in self.paths:
            await self.app(scope, receive, send)
            return

        async def send_with_header(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message)[self.name] = self.value
            await send(message)

        await self.app(scope, receive, send_with_header)


async def head_of_get(app: ASGIApp, scope: Scope, receive: Receive, send: Send) -> None:
    """Answer a ``HEAD`` request with ``app``'s ``GET`` answer's start (status, headers) and an
    empty body; a streamed answer (server-sent events) is told the client left once it started."""
    started = False

    async def headers_only(message: Message) -> None:
        nonlocal started
        if message["type"] == "http.response.start":
            started = True
            await send(message)
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        elif not started:
            await send(message)

    async def until_started() -> Message:
        if started:
            return {"type": "http.disconnect"}
        return await receive()

    await app({**scope, "method": "GET"}, until_started, headers_only)


class PathMethods:
    """``OPTIONS`` on a path of the API: 204 with ``Allow`` listing every method of the path
    (all its routes, and ``HEAD`` wherever ``GET`` is); ``HEAD`` where the path takes ``GET``:
    the ``GET`` answer's status and headers without its body (RFC 9110 9.3.2; uptime probes
    and ``curl -I`` use it); any other method the path does not take: 405
    ``method_not_allowed`` with the same ``Allow``, its body rendered by ``render(path,
    error)``. Paths the table does not know go on to the app (its 404). ``table()`` is called at
    the first request (the routes' document is complete by then) and kept."""

    def __init__(
        self, app: ASGIApp, table: Callable[[], MethodTable], render: Callable[[str, HomefleetError], Response]
    ) -> None:
        self.app, self.table, self.render = app, table, render
        self.allowed: MethodTable | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.allowed is None:
            self.allowed = self.table()
        path, method = scope["path"], scope["method"]
        matched = [methods for pattern, methods in self.allowed if pattern.match(path)]
        if matched:
            methods = set().union(*matched) | {"OPTIONS"}
            if "GET" in methods:
                methods.add("HEAD")
            allow = ", ".join(sorted(methods))
            if method == "OPTIONS":
                await Response(status_code=204, headers={"Allow": allow})(scope, receive, send)
                return
            if method == "HEAD" and "HEAD" not in set().union(*matched):
                await head_of_get(self.app, scope, receive, send)
                return
            if method not in methods:
                error = HomefleetError(
                    f"{method} is not a method of {path}; it takes {allow}", reason="method_not_allowed"
                )
                error.status_code = 405
                answer = self.render(path, error)
                answer.headers["Allow"] = allow
                await answer(scope, receive, send)
                return
        await self.app(scope, receive, send)
