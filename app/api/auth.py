"""Who may call: API keys on the public routes (``Authorization: Bearer <key>``), machine tokens
on the internal routes, checked before any body is read.

Keys come from ``Settings.api_keys``. With no key configured the server refuses to start
unless ``allow_open_api`` is set, and then says at start-up that the public routes are open
(:func:`check_api_keys`). ``/health`` and ``/metrics`` stay open for probes and scrapers;
the internal routes use per-machine tokens instead (:func:`machine_of`).

:class:`Authenticate` is a pure ASGI middleware, outside the body limit and the routes: an
unauthenticated request, a worker naming another machine, or a worker acting on a job of
another machine is answered 401/403 from its headers and path alone; its body is never read
or spooled (before, FastAPI parsed, and spooled, a whole multipart upload before its route's
dependencies checked the key). It also bounds the uploads in progress
(``max_concurrent_uploads``): one more is answered 429 ``uploads_busy``, unread. The routes
keep their dependencies (:func:`require_api_key`, ``get_worker_machine``), which apply the
same checks again.
"""

from __future__ import annotations

import hmac
import logging
import re
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Annotated

from anyio import to_thread
from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.datastructures import Headers, QueryParams
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.api.openai_errors import is_tgi_route
from app.api.result_urls import signature_grants
from app.core.config import Settings
from app.core.errors import Forbidden, HomefleetError, Overloaded, Unauthorized

if TYPE_CHECKING:
    from app.context import ServerContext
    from app.fleet.config import Fleet, Machine

log = logging.getLogger(__name__)


class OpenApiRefused(HomefleetError):
    """Raised at start-up when no API key is configured and ``allow_open_api`` is not set."""

    default_reason = "no_api_keys"


def check_api_keys(settings: Settings) -> None:
    """Fail at start-up without keys unless open access was asked for explicitly.

    Raises:
        OpenApiRefused: ``api_keys`` is empty and ``allow_open_api`` is false.
    """
    if settings.api_keys:
        return
    if not settings.allow_open_api:
        raise OpenApiRefused(
            "no API key configured: set HOMEFLEET_API_KEYS='[\"<key>\"]' (a JSON list), or "
            "HOMEFLEET_ALLOW_OPEN_API=true to serve the public routes without a key"
        )
    log.warning(
        "no API key configured and allow_open_api is set: the public routes are OPEN to anyone who can reach them"
    )


def bearer_token(authorization: str) -> str | None:
    scheme, _, token = authorization.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


#: The public routes' security scheme in the OpenAPI document (Swagger's "Authorize" button).
#: ``auto_error=False``: a missing key is refused by :func:`check_api_key` as a domain error.
API_KEY_SCHEME = HTTPBearer(
    scheme_name="ApiKey",
    auto_error=False,
    description="an API key of this server (HOMEFLEET_API_KEYS): `Authorization: Bearer <key>`",
)


async def require_api_key(
    request: Request,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(API_KEY_SCHEME)] = None,
) -> None:
    """Dependency of every public route: :func:`check_api_key` (the :class:`Authenticate`
    middleware has applied it already, before the body was read), unless the request is a signed
    result URL's (:func:`signed`). ``async``: it never blocks,
    so FastAPI runs it on the event loop, not in its thread pool (app/api/routes/deps.py)."""
    authorization = f"Bearer {credentials.credentials}" if credentials is not None else ""
    check_key_or_signature(
        request.app.state.settings, authorization, request.method, request.url.path, request.query_params
    )


def check_key_or_signature(settings: Settings, authorization: str, method: str, path: str, query: QueryParams) -> None:
    """:func:`check_api_key`, but for a ``GET``/``HEAD`` without ``Authorization`` whose query
    carries a result URL's signature (app/api/result_urls.py ``signature_grants``): that
    signature stands in for the key. A request that carries a key is judged by its key alone.

    Raises:
        Unauthorized: as :func:`check_api_key`; or a signature that is expired or invalid
            (``result_url_expired``, ``invalid_signature``).
    """
    if (
        settings.api_keys
        and not authorization
        and method in ("GET", "HEAD")
        and signature_grants(settings, path, query)
    ):
        return
    check_api_key(settings, authorization)


def check_api_key(settings: Settings, authorization: str) -> None:
    """Check an ``Authorization`` header against the configured API keys (timing-safe).

    Raises:
        Unauthorized: no ``Authorization: Bearer <key>`` header, or a key not configured.
    """
    if not settings.api_keys:
        return  # open only when allow_open_api was set (check_api_keys at start-up)
    token = bearer_token(authorization)
    if token is None:
        raise Unauthorized("public routes need 'Authorization: Bearer <API key>'", reason="missing_api_key")
    if not any(hmac.compare_digest(token.encode(), key.encode()) for key in settings.api_keys):
        raise Unauthorized("the API key is not one of this server's keys", reason="invalid_api_key")


ApiKey = Depends(require_api_key)


def api_key_id_of(settings: Settings, authorization: str) -> str | None:
    """The id a submission carrying ``authorization`` is journaled under and its quota is found
    by: ``Settings.api_key_id`` of its bearer key, never the key itself; None when no
    key is configured (the routes are open) or none was sent. The key was checked already
    (:class:`Authenticate`)."""
    token = bearer_token(authorization)
    return settings.api_key_id(token) if token is not None and settings.api_keys else None


def request_key_id(request: Request) -> str | None:
    """:func:`api_key_id_of` the request's ``Authorization`` header."""
    return api_key_id_of(request.app.state.settings, request.headers.get("authorization", ""))


def machine_of(fleet: Fleet, authorization: str, claimed: str | None) -> Machine:
    """The machine whose token ``authorization`` carries (``Bearer <token>``); a worker also
    names its machine (``X-Homefleet-Machine``, ``claimed``), which must be the token's. The
    devices of one host share its token: the token is then the host's, and the
    worker names which device's machine it is (``box:0``); without a name it is refused.

    Raises:
        Unauthorized: no bearer token, one that belongs to no machine, another machine's
            token than the one the worker names (its jobs would all be refused at claim), or a
            host's token without the device's name; a valid token naming a machine that is not in
            the fleet (reason ``unknown_machine``).
    """
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not token:
        raise Unauthorized("internal routes need 'Authorization: Bearer <machine token>'")
    machines = {machine.name: machine for machine in fleet.machines_for_token(token.strip())}
    if not machines:
        raise Unauthorized("the token belongs to no machine of this fleet")
    if claimed is None:
        if len(machines) > 1:
            host = next(iter(machines.values())).host_name
            raise Unauthorized(
                f"the token is host {host!r}'s, shared by its devices {', '.join(machines)}: name the "
                "device's machine in the X-Homefleet-Machine header (homefleet worker --machine)"
            )
        return next(iter(machines.values()))
    if claimed not in machines:
        if claimed not in fleet.machines:
            raise Unauthorized(
                f"the worker names machine {claimed!r}, which is not in this fleet "
                f"({', '.join(sorted(fleet.machines))}); fix --machine (HOMEFLEET_MACHINE) or add it to the "
                "fleet file",
                reason="unknown_machine",
            )
        owner = ", ".join(machines)
        raise Unauthorized(
            f"the worker says it is machine {claimed!r}, but its token belongs to machine "
            f"{owner!r}; give each worker its own machine's token"
        )
    return machines[claimed]


INTERNAL_PREFIX = "/internal/"
#: ``homefleet worker join``: the one internal path that carries a join token, not a machine token
JOIN_PATH = "/internal/v1/join"
PUBLIC_PREFIXES = ("/v1/", "/hf")
_INTERNAL_JOB = re.compile(r"/internal/v1/jobs/([^/]+)/[^/]+")


class Authenticate:
    """ASGI middleware: authenticate a request from its headers and path before anything reads
    its body (module docstring). Public paths (``/v1/``, ``/hf``) need an API key
    (:func:`check_api_key`); internal ones (``/internal/``) a machine token (:func:`machine_of`),
    and a job path (``/internal/v1/jobs/{id}/…``) a job placed on that machine. An upload path
    (one of ``uploads``) beyond ``max_concurrent_uploads`` whose bodies are being read is
    answered 429 ``uploads_busy`` with ``Retry-After``. Refusals are rendered by ``render(path, error)``."""

    def __init__(
        self,
        app: ASGIApp,
        ctx: ServerContext,
        settings: Settings,
        uploads: Sequence[re.Pattern[str]],
        render: Callable[[str, HomefleetError], Response],
    ) -> None:
        self.app, self.ctx, self.settings, self.uploads, self.render = app, ctx, settings, uploads, render
        self.uploading = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        upload = scope["method"] == "POST" and any(pattern.fullmatch(path) for pattern in self.uploads)
        try:
            await self.authenticate(path, Headers(scope=scope), scope["method"], QueryParams(scope["query_string"]))
            if upload and self.uploading >= self.settings.max_concurrent_uploads:
                raise Overloaded(
                    f"{self.uploading} uploads are in progress, the most this server takes at once "
                    f"(max_concurrent_uploads = {self.settings.max_concurrent_uploads}); retry later",
                    reason="uploads_busy",
                    retry_after_s=self.settings.retry_after_s,
                )
        except HomefleetError as error:
            await self.render(path, error)(scope, receive, send)  # answered unread
            return
        if not upload:
            await self.app(scope, receive, send)
            return
        self.uploading += 1  # until its body has been read (not while its route waits, e.g. for a job)
        counted = True

        def done() -> None:
            nonlocal counted
            if counted:
                counted = False
                self.uploading -= 1

        async def reading() -> Message:
            message = await receive()
            if message["type"] != "http.request" or not message.get("more_body", False):
                done()
            return message

        try:
            await self.app(scope, reading, send)
        finally:
            done()

    async def authenticate(
        self, path: str, headers: Headers, method: str = "GET", query: QueryParams | None = None
    ) -> None:
        """Raises Unauthorized, Forbidden or NotFound for a request that may not go on. TGI's
        routes need an API key too (``POST /``, ``/generate``, ``/generate_stream``; ``GET /`` is
        the fleet page). A signed result URL (``query``'s ``signature``) needs none (:func:`signed`)."""
        if path == JOIN_PATH:
            return  # a new host has no machine token yet: the route checks its join token
        if path.startswith(INTERNAL_PREFIX):
            machine = machine_of(self.ctx.fleet, headers.get("authorization", ""), headers.get("x-homefleet-machine"))
            job = _INTERNAL_JOB.fullmatch(path)
            if job is not None:
                placed_on = await to_thread.run_sync(self._machine_of_job, job.group(1))
                if placed_on != machine.name:
                    raise Forbidden(f"job {job.group(1)} is placed on {placed_on!r}, not on {machine.name!r}")
        elif path.startswith(PUBLIC_PREFIXES) or (is_tgi_route(path) and (path != "/" or method == "POST")):
            check_key_or_signature(
                self.settings, headers.get("authorization", ""), method, path, query or QueryParams()
            )

    def _machine_of_job(self, job_id: str) -> str | None:
        return self.ctx.journal.get(job_id).machine  # NotFound for an unknown job
