"""Shared route dependencies: the server context and the worker's identity.

They are ``async def`` because none of them blocks: FastAPI runs a plain ``def`` dependency in
its thread pool, one hand-over per dependency and request (the thread hops were most
of a request's time in the API, docs/benchmarks.md "Submission latency"). A dependency or route
that waits on the journal, Redis or a file stays a plain ``def``."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

from fastapi import Depends, Header, Request
from fastapi.responses import FileResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from app.api.auth import machine_of
from app.context import ServerContext
from app.core.errors import Conflict, Forbidden, NotFound
from app.core.states import JobState
from app.db.tables import Job
from app.fleet.config import Machine
from app.store.media import EXTENSIONS


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


@dataclass(frozen=True)
class ResultFile:
    """One stored result of succeeded job ``job_id``: where it is, its media type, digest and the
    file name a download gives it (``<job id>[-<index>].<ext>``)."""

    job_id: str
    path: Path
    media_type: str
    digest: str
    filename: str

    def read_bytes(self) -> bytes:
        """The file's bytes.

        Raises:
            NotFound: ``result_missing`` when it vanished since :func:`result_file` found it.
        """
        try:
            return self.path.read_bytes()
        except FileNotFoundError as error:
            raise NotFound(_missing(self.path, self.digest, self.job_id), reason="result_missing") from error


def _missing(path: Path, digest: str, job_id: str) -> str:
    return (
        f"job {job_id} succeeded, but its result{' ' + digest if digest else ''} is no longer in the server's "
        "data folder "
        f"({path} is missing: deleted, or the folder restored from an older backup); put the file back "
        f"from a backup, or run the job again (`homefleet jobs requeue {job_id}`, POST /v1/jobs/{job_id}/requeue)"
    )


def result_file(job: Job, index: int = 0) -> ResultFile:
    """Result ``index`` of ``job`` (image i of n; 0: the first, or the only one), checked on disk:
    the one home of what ``GET /v1/jobs/{id}/result`` and the routes that answer with a result's
    bytes (OpenAI's ``b64_json``, Hugging Face's image, a text answer) refuse.

    Raises:
        Conflict: 409 ``no_result``, naming the job's state, while it has not succeeded.
        NotFound: ``result_not_found`` past its last image; ``result_missing`` when the journal
            has the result but its file is gone from the data folder (deleted, or a folder
            restored from an older backup): the message names the file and the fixes.
    """
    if job.state != JobState.succeeded or not job.result_path:
        raise Conflict(f"job {job.id} is {job.state}; a result exists only once it has succeeded", reason="no_result")
    if index:
        rows = job.results or []
        if index >= len(rows):
            raise NotFound(
                f"job {job.id} has {max(1, len(rows))} results (index 0 to {max(1, len(rows)) - 1}), not index {index}",
                reason="result_not_found",
            )
        row = rows[index]
        path, media_type, digest = row["path"], row.get("media_type"), row.get("digest")
        name = f"{job.id}-{index}"
    else:
        path, media_type, digest, name = job.result_path, job.result_media_type, job.result_digest, job.id
    media_type = media_type or "application/octet-stream"
    found = ResultFile(job.id, Path(path), media_type, digest or "", f"{name}.{EXTENSIONS.get(media_type, 'bin')}")
    if not found.path.is_file():
        raise NotFound(_missing(found.path, found.digest, job.id), reason="result_missing")
    return found
