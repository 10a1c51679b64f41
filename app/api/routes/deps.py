"""Shared route dependencies: the server context and the worker's identity.

They are ``async def`` because none of them blocks: FastAPI runs a plain ``def`` dependency in
its thread pool, one hand-over per dependency and request (the thread hops were most
of a request's time in the API, docs/benchmarks.md "Submission latency"). A dependency or route
that waits on the journal, Redis or a file stays a plain ``def``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from fastapi import Depends, Header, Request
from fastapi.responses import FileResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from app.api.auth import machine_of
from app.context import ServerContext
from app.core.errors import Forbidden
from app.db.tables import Job
from app.fleet.config import Machine


async def get_context(request: Request) -> ServerContext:
    return request.app.state.ctx


Context = Annotated[ServerContext, Depends(get_context)]


#: The internal routes' security scheme (their own OpenAPI document, ``/internal/openapi.json``).
MACHINE_TOKEN_SCHEME = HTTPBearer(
    scheme_name="MachineToken",
    auto_error=False,
    description="the token of one machine of the fleet file: `Authorization: Bearer <token>`",
)


async def get_worker_machine(
    ctx: Context,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(MACHINE_TOKEN_SCHEME)] = None,
    x_homefleet_machine: Annotated[str | None, Header(max_length=128)] = None,
) -> Machine:
    """The machine whose token the request carries (``Authorization: Bearer <token>``), naming
    itself in ``X-Homefleet-Machine`` (app/api/auth.py ``machine_of``, which the middleware
    applied before the body was read).

    Raises:
        Unauthorized: see ``machine_of``.
    """
    authorization = f"Bearer {credentials.credentials}" if credentials is not None else ""
    return machine_of(ctx.fleet, authorization, x_homefleet_machine)


WorkerMachine = Annotated[Machine, Depends(get_worker_machine)]


def job_of_machine(ctx: ServerContext, job_id: str, machine: Machine) -> Job:
    """The job, if it was placed on ``machine``.

    Raises:
        NotFound: no such job.
        Forbidden: the job belongs to another machine.
    """
    job = ctx.journal.get(job_id)
    if job.machine != machine.name:
        raise Forbidden(f"job {job_id} is placed on {job.machine!r}, not on {machine.name!r}")
    return job


IMMUTABLE = "private, max-age=31536000, immutable"
"""``Cache-Control`` of a file served by its content digest: its bytes never change (R2), and it
is behind an API key (``private``: no shared cache keeps it)."""


def stored_file(
    path: str | Path, media_type: str, filename: str, digest: str | None = None, request: Request | None = None
) -> Response:
    """A stored file as the API serves it: its stored media type,
    ``X-Content-Type-Options: nosniff`` (a browser never second-guesses it),
    ``Content-Disposition: attachment; filename=…`` (it is downloaded, never rendered in the
    API's origin) and, when known, ``X-Content-Digest``, the digest as its ``ETag`` and
    ``Cache-Control`` :data:`IMMUTABLE`: a ``request`` whose ``If-None-Match`` names that ETag
    (or ``*``) is answered 304 with no body (RFC 9110, 13.1.2), as a browser or a client's cache
    asks again for a result it holds."""
    headers = {"X-Content-Type-Options": "nosniff"}
    if digest:
        etag = f'"{digest}"'
        headers.update({"X-Content-Digest": digest, "ETag": etag, "Cache-Control": IMMUTABLE})
        asked = request.headers.get("if-none-match", "") if request is not None else ""
        if asked.strip() == "*" or etag in {tag.strip().removeprefix("W/") for tag in asked.split(",")}:
            return Response(status_code=304, headers={k: v for k, v in headers.items() if k != "X-Content-Digest"})
    return FileResponse(
        path, media_type=media_type, filename=filename, headers=headers, content_disposition_type="attachment"
    )
