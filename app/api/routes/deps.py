"""Shared route dependencies: the server context and the worker's identity."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Header, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from app.context import ServerContext
from app.core.errors import Forbidden, Unauthorized
from app.db.tables import Job
from app.fleet.config import Machine


def get_context(request: Request) -> ServerContext:
    return request.app.state.ctx  # type: ignore[no-any-return]


Context = Annotated[ServerContext, Depends(get_context)]


#: The internal routes' security scheme (their own OpenAPI document, ``/internal/openapi.json``).
MACHINE_TOKEN_SCHEME = HTTPBearer(scheme_name="MachineToken", auto_error=False,
                                  description="the token of one machine of the fleet file: `Authorization: Bearer <token>`")


def get_worker_machine(
    ctx: Context,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(MACHINE_TOKEN_SCHEME)] = None,
    x_homefleet_machine: Annotated[str | None, Header(max_length=128)] = None,
) -> Machine:
    """The machine whose token the request carries (``Authorization: Bearer <token>``). A
    worker also names its machine (``X-Homefleet-Machine``); it must be the token's.

    Raises:
        Unauthorized: no bearer token, one that belongs to no machine, or another machine's
            token than the one the worker names (its jobs would all be refused at claim).
    """
    token = credentials.credentials.strip() if credentials is not None else ""
    if not token:
        raise Unauthorized("internal routes need 'Authorization: Bearer <machine token>'")
    machine = ctx.fleet.machine_for_token(token)
    if machine is None:
        raise Unauthorized("the token belongs to no machine of this fleet")
    if x_homefleet_machine is not None and x_homefleet_machine != machine.name:
        if x_homefleet_machine not in ctx.fleet.machines:
            raise Unauthorized(f"the worker names machine {x_homefleet_machine!r}, which is not in this fleet "
                               f"({', '.join(sorted(ctx.fleet.machines))}); fix --machine or add it to the fleet file")
        raise Unauthorized(f"the worker says it is machine {x_homefleet_machine!r}, but its token belongs to machine "
                           f"{machine.name!r}; give each worker its own machine's token")
    return machine


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
