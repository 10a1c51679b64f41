"""``create_app(settings)``: the FastAPI application, with domain errors mapped once."""

from __future__ import annotations

import copy
import logging
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from anyio import to_thread
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi_offline import FastAPIOffline
from kombu.exceptions import OperationalError as BrokerDown
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError
from sqlalchemy.exc import OperationalError
from starlette.exceptions import HTTPException as StarletteHTTPException

from app.api.auth import INTERNAL_PREFIX, Authenticate, check_api_keys, require_api_key
from app.api.body_limit import MULTIPART_ROOM, BodyLimit, RouteLimit
from app.api.fleet_reload import FleetReloader
from app.api.middleware import HeaderOnPaths, MethodTable, PathMethods, RequestDuration
from app.api.openai_errors import (
    OPENAI_UNSERVED,
    is_openai_route,
    is_tgi_route,
    openai_error,
    openai_validation_error,
    tgi_error,
    tgi_validation_error,
)
from app.api.openapi import documented, part_of, path_pattern
from app.api.routes import (
    events,
    hf,
    images,
    internal,
    page,
    public,
    residency,
    serving,
    sync,
    text,
    tgi,
)
from app.api.routes.deps import WorkerMachine
from app.api.schemas import JobPublic
from app.api.strict_json import printable
from app.context import ServerContext, build_context
from app.core.config import Settings
from app.core.connections import redacted_url
from app.core.errors import HomefleetError, ServiceDown, StorageFull
from app.db.engine import disk_full
from app.db.leadership import Leadership
from app.db.tables import Job
from app.fleet import live
from app.jobs.reconcile import ReconcileLoop
from app.store.files import DISK_FULL

VERSION = "0.1.0"
HTTP_REASONS = {400: "invalid_body", 404: "not_found", 405: "method_not_allowed", 413: "too_large"}
HTTP_METHODS = {"get", "put", "post", "delete", "patch", "head", "trace"}
#: GET routes outside the OpenAPI document (its own page and files, the docs, the internal one)
UNDOCUMENTED_GET = (
    "/openapi.json",
    "/docs",
    "/docs/oauth2-redirect",
    "/redoc",
    "/internal/openapi.json",
    "/static-offline-docs/{file:path}",
    "/",
    "/page/{name}",
    "/favicon.ico",
)
DOCS_PAGES = ("/docs", "/redoc", "/docs/oauth2-redirect")
#: The docs pages load only what this server serves: their scripts (inline and fastapi-offline's
#: assets), Redoc's workers (blob:), images from here or data: URLs, requests to this API.
DOCS_CSP = (
    "default-src 'self'; script-src 'self' 'unsafe-inline' blob:; style-src 'self' 'unsafe-inline'; "
    "img-src 'self' data: blob:; font-src 'self' data:; worker-src 'self' blob:; connect-src 'self'"
)
DESCRIPTION = (
    "Homefleet's public API: jobs (submit, follow, cancel, fetch results), inputs, machines, models, "
    "residency, syncs, the OpenAI-compatible Images API and the Hugging Face routes (docs/api.md). "
    "Every route but /health and /metrics needs an API key: press Authorize and give it as the bearer token. "
    "The workers' routes are documented apart (/internal/openapi.json, for a machine token)."
)

log = logging.getLogger(__name__)


def create_app(settings: Settings, ctx: ServerContext | None = None) -> FastAPI:
    """Build the API. The context (journal, Redis, Celery…) is created here unless given.

    Raises:
        OpenApiRefused: no API key configured and ``allow_open_api`` not set (app/api/auth.py).
    """
    check_api_keys(settings)
    context = ctx or build_context(settings)

    def refusing(error: HomefleetError | None) -> None:
        context.dispatcher.refusing = error  # the Redis runs with another journal: place nothing (app/fleet/pairing.py)

    # one leader among servers sharing the journal (docs/operations.md, "A standby server"); always, alone
    leadership = Leadership(context.engine, settings.leader_poll_s, settings.leader_election)
    reconcile = ReconcileLoop(
        context.reconciler(), settings.reconcile_interval_s, on_refusal=refusing, leads=leadership.leads
    )
    webhooks = context.webhook_loop(job_record, leads=leadership.leads)  # resumes pending deliveries
    # the fleet file is followed while running: edits and SIGHUP reload it (app/api/fleet_reload.py)
    reloader = FleetReloader(context, settings.fleet_file, settings.fleet_watch_s) if settings.fleet_file else None

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        leadership.start()
        reconcile.start()  # at server start, then periodically (R19)
        webhooks.start()
        if reloader is not None:
            reloader.start()
        else:  # the CLI then knows that a command without a fleet file acts on this server's fleet
            try:
                live.report_loaded(context.redis, context.keys, "", "embedded")
            except RedisError as error:
                log.warning("could not record that this server runs the embedded default fleet: %s", error)
        yield
        if reloader is not None:
            reloader.stop()
        webhooks.stop()
        reconcile.stop()
        leadership.stop()
        context.close()

    # /docs and /redoc from the assets fastapi-offline ships (no CDN: they work without internet).
    api = FastAPIOffline(
        title="Homefleet",
        version=VERSION,
        description=DESCRIPTION,
        lifespan=lifespan,
        swagger_ui_parameters={"persistAuthorization": True},
    )
    api.state.ctx = context
    api.state.leadership = leadership
    api.state.settings = settings

    @api.exception_handler(HomefleetError)
    async def domain_error(request: Request, error: HomefleetError) -> JSONResponse:
        return error_response(request.url.path, error)

    @api.exception_handler(RedisConnectionError)
    @api.exception_handler(RedisTimeoutError)
    @api.exception_handler(BrokerDown)  # a publish that failed after its retries (a Sentinel failover)
    @api.exception_handler(OperationalError)
    async def service_down(request: Request, error: Exception) -> JSONResponse:
        journal = isinstance(error, OperationalError)
        what = "the journal's database" if journal else f"Redis at {redacted_url(settings.redis_url)}"
        log.error("%s %s: %s does not answer: %s", request.method, request.url.path, what, error)
        said = f"does not answer ({type(error).__name__ if journal else error})"
        if journal and disk_full(error):  # it answers, but cannot write: say so, not "down"
            said = (
                f"({redacted_url(settings.journal_url)}) cannot write: the disk or quota that holds it is full "
                f"({str(getattr(error, 'orig', error)).strip()}); free some space there"
            )
        return await domain_error(
            request,
            ServiceDown(
                f"{what} {said}; retry later",
                reason="journal_down" if journal else "redis_down",
                retry_after_s=settings.retry_after_s,
            ),
        )

    @api.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        """Starlette's own refusals (a body that cannot be parsed: 400; no such route: 404) in
        the common error body. FastAPI answers 400 "There was an error parsing the body" when
        spooling a multipart body fails; a full disk under it is a 507 naming it, logged."""
        cause = error.__cause__
        while cause is not None and not isinstance(cause, OSError):
            cause = cause.__cause__ or cause.__context__
        if isinstance(cause, OSError) and cause.errno in DISK_FULL:
            message = (
                f"the request body could not be spooled to a temporary file ({cause.strerror}); "
                "the server's disk is full: retry later"
            )
            log.error("%s %s: storage full: %s", request.method, request.url.path, message)
            return error_response(request.url.path, StorageFull(message))
        reason = HTTP_REASONS.get(error.status_code, "http_error")
        detail = str(error.detail)
        if error.status_code == 404 and request.url.path.startswith(OPENAI_UNSERVED):  # as OpenAI words it
            detail = (
                f"Invalid URL ({request.method} {request.url.path}): this server answers OpenAI's "
                "/v1/chat/completions, /v1/completions, /v1/images/generations, /v1/images/edits and /v1/models"
            )
        refusal = HomefleetError(detail, reason=reason)
        refusal.status_code = error.status_code
        answer = error_response(request.url.path, refusal)
        answer.headers.update(error.headers or {})
        return answer

    @api.exception_handler(RequestValidationError)
    async def validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
        path = request.url.path
        hf_model = hf.MODEL_PATH.match(path) is not None  # a text model's answers in TGI's shape
        if is_tgi_route(path) or (hf_model and await to_thread.run_sync(hf.answers_as_tgi, context, path)):
            return tgi_validation_error(error)
        if is_openai_route(path):
            return openai_validation_error(error)
        details = jsonable(printable(error.errors()))  # NaN or a surrogate echoed back safely
        first = details[0] if details else {}
        located = [str(part) for part in first.get("loc", ())]
        field = ".".join(located)
        message = f"`{field}`: {first.get('msg', 'invalid')}" if first else "invalid request"
        for detail in details:  # the offending value is named in the message; echo a huge one abridged
            if len(repr(detail.get("input"))) > 1024:
                detail["input"] = f"{repr(detail['input'])[:200]}… (abridged)"
        # the field at fault, as domain errors name it (``params.steps``): where it sits left out
        param = ".".join(part for part in located if part not in ("body", "query", "header", "path")) or None
        body: dict[str, Any] = {"reason": "invalid_request", "message": message}
        if param is not None:
            body["param"] = param
        return JSONResponse(status_code=422, content={"error": body, "detail": details})

    def observe(method: str, route: str, status: str, seconds: float) -> None:
        context.metrics.request_s.labels(method=method, route=route, status=status).observe(seconds)

    # Middleware: the last added is the outermost (pure ASGI, app/api/middleware.py).
    api.add_middleware(RequestDuration, observe=observe)
    # the docs pages: the browser sends nothing elsewhere (Redoc's footer logo is a CDN URL)
    api.add_middleware(HeaderOnPaths, paths=DOCS_PAGES, name="Content-Security-Policy", value=DOCS_CSP)
    uploads = upload_limits(settings)
    api.add_middleware(BodyLimit, max_bytes=settings.max_request_bytes, routes=uploads, render=error_response)
    # outermost: the key or token is checked before anything reads the body
    api.add_middleware(
        Authenticate, ctx=context, settings=settings, uploads=[route.path for route in uploads], render=error_response
    )

    keyed = [Depends(require_api_key)]
    api.include_router(serving.router)
    api.include_router(page.router)  # the fleet page: no data in it, no key
    api.include_router(public.router, dependencies=keyed)
    api.include_router(events.router, dependencies=keyed)
    api.include_router(images.router, dependencies=keyed)
    api.include_router(hf.router, dependencies=keyed)
    api.include_router(text.router, dependencies=keyed)
    api.include_router(tgi.router, dependencies=keyed)
    api.include_router(internal.router)
    api.include_router(sync.public_router, dependencies=keyed)
    api.include_router(sync.internal_router)
    api.include_router(residency.router, dependencies=keyed)
    document_internal_apart(api, context, settings)
    return api


def document_internal_apart(api: FastAPI, context: ServerContext, settings: Settings) -> None:
    """The public OpenAPI document (``/openapi.json``, ``/docs``, ``/redoc``) leaves the internal
    routes (``/internal/...``: machine tokens, not API keys) out; they have their own,
    ``GET /internal/openapi.json``, for a machine token."""
    whole = api.openapi  # FastAPI's: the document of every route
    parts: dict[tuple[bool, tuple[tuple[str, tuple[str, ...]], ...]], dict[str, Any]] = {}

    def part(internal: bool) -> dict[str, Any]:
        # the document follows the registry: each model with the kinds it runs
        models = tuple(sorted((record.id, tuple(record.kinds)) for record in context.registry.list()))
        if (internal, models) not in parts:
            parts.clear()
            parts[(internal, models)] = part_of(
                documented(copy.deepcopy(whole()), context.fleet.machines, settings.limits, dict(models)),
                internal=internal,
            )
        return parts[(internal, models)]

    def method_table() -> MethodTable:
        """Every method of every path: the document's, and GET of the undocumented pages."""
        table: dict[str, set[str]] = {path: {"GET"} for path in UNDOCUMENTED_GET}
        for path, item in whole()["paths"].items():
            table.setdefault(path, set()).update(method.upper() for method in item if method in HTTP_METHODS)
        return [(path_pattern(path), methods) for path, methods in table.items()]

    # outermost: OPTIONS and 405 answer before the key is asked for
    api.add_middleware(PathMethods, table=method_table, render=error_response)

    def public_openapi() -> dict[str, Any]:
        return part(internal=False)

    @api.get(f"{INTERNAL_PREFIX}openapi.json", include_in_schema=False)
    def internal_openapi(_machine: WorkerMachine) -> dict[str, Any]:
        """The internal API's OpenAPI document (workers' routes, docs/api.md "Internal API")."""
        document = part(internal=True)
        info = {
            **document["info"],
            "title": "Homefleet internal API",
            "description": "Worker-only routes: each request carries its machine's token (MachineToken). "
            "Not for clients.",
        }
        return {**document, "info": info}

    api.openapi = public_openapi  # type: ignore[method-assign]


def upload_limits(settings: Settings) -> list[RouteLimit]:
    """The body limits of the upload routes (app/api/body_limit.py): their files' limits in bytes
    plus ``MULTIPART_ROOM``. An edit carries an image and maybe a mask."""
    upload = max([settings.max_input_bytes, *(limits.max_upload_bytes for limits in settings.limits.values())])
    return [
        RouteLimit(re.compile(r"/v1/files"), settings.max_input_bytes + MULTIPART_ROOM, "max_input_bytes + 1 MiB"),
        RouteLimit(
            re.compile(r"/v1/images/edits"), 2 * upload + MULTIPART_ROOM, "2 x the largest upload limit + 1 MiB"
        ),
        RouteLimit(
            re.compile(r"/internal/v1/jobs/[^/]+/result"),
            settings.max_result_bytes + MULTIPART_ROOM,
            "max_result_bytes + 1 MiB",
        ),
    ]


def job_record(job: Job) -> bytes:
    """A job's record as ``GET /v1/jobs/{id}`` answers it for an ended job: the body of its
    webhook."""
    return JobPublic.from_job(job).model_dump_json().encode()


def error_response(path: str, error: HomefleetError) -> JSONResponse:
    """The answer to a domain error on ``path``: ``{"error": {"reason", "message"[, "param"][, "job_id"]}}``
    (``param``: the request field at fault where the error names one, e.g. ``params.adapters[0].id``)
    with the error's status, or OpenAI's shape on the OpenAI routes, TGI's on TGI's; ``Retry-After`` (seconds)
    when the error carries one, and on every 429 and 503 (they are temporary: without one of its
    own, the setting's default ``retry_after_s``)."""
    headers = {}
    retry_after_s = getattr(error, "retry_after_s", None)
    if retry_after_s is None and error.status_code in (429, 503):
        retry_after_s = Settings.model_fields["retry_after_s"].default
    if retry_after_s is not None:
        headers["Retry-After"] = str(retry_after_s)
    if is_openai_route(path):
        return openai_error(error, headers)
    if is_tgi_route(path):
        return tgi_error(error, headers)
    body: dict[str, Any] = {"reason": error.reason, "message": error.message}
    if error.param is not None:
        body["param"] = error.param
    if error.job_id is not None:  # GET /v1/jobs/{id} shows the refusal as journaled
        body["job_id"] = error.job_id
    job_ids = getattr(error, "job_ids", None)  # JobPending: jobs that run; a resend makes no new one (R20)
    if job_ids is not None:
        body["job_ids"] = list(job_ids)
        headers["x-should-retry"] = "false"
    return JSONResponse(status_code=error.status_code, content={"error": body}, headers=headers)


def jsonable(details: object) -> Any:
    from fastapi.encoders import jsonable_encoder

    return jsonable_encoder(details)
