"""Shared route dependencies: the server context and the worker's identity.

They are ``async def`` because none of them blocks: FastAPI runs a plain ``def`` dependency in
its thread pool, one hand-over per dependency and request (the thread hops were most
of a request's time in the API, docs/benchmarks.md "Submission latency"). A dependency or route
that waits on the journal, Redis or a file stays a plain ``def``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from fastapi import Depends, Header, Request
from fastapi.responses import FileResponse
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


def stored_file(path: str | Path, media_type: str, filename: str, digest: str | None = None) -> FileResponse:
    """A stored file as the API serves it: its stored media type,
    ``X-Content-Type-Options: nosniff`` (a browser never second-guesses it),
    ``Content-Disposition: attachment; filename=…`` (it is downloaded, never rendered in the
    API's origin) and, when known, ``X-Content-Digest``."""
    headers = {"X-Content-Type-Options": "nosniff"}
    if digest is not None:
        headers["X-Content-Digest"] = digest
    return FileResponse(
        path, media_type=media_type, filename=filename, headers=headers, content_disposition_type="attachment"
    )
