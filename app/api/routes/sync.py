"""Sync routes (R6): start and follow a sync (public), and the worker's side of it (internal:
claim, progress, finish, and the authenticated model file endpoint with HTTP Range).

The design of a sync is in ``app/jobs/sync.py``.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends
from fastapi.responses import FileResponse, Response
from pydantic import ConfigDict, Field

from app.api.routes.deps import Context, WorkerMachine, get_context, stored_file
from app.api.strict_json import StrictJsonRoute
from app.context import ServerContext
from app.core.errors import NotFound
from app.core.protocol import SyncFinish, SyncGrant, SyncProgress
from app.core.request_body import RequestBody
from app.jobs.sync import Syncs

public_router = APIRouter(prefix="/v1", route_class=StrictJsonRoute)
internal_router = APIRouter(prefix="/internal/v1", route_class=StrictJsonRoute)


async def get_syncs(ctx: Annotated[ServerContext, Depends(get_context)]) -> Syncs:  # builds, never blocks
    return ctx.syncs()


SyncService = Annotated[Syncs, Depends(get_syncs)]


class SyncCreate(RequestBody):
    """``POST /v1/machines/{machine}/sync``. No models: every registered model the machine supports."""

    model_config = ConfigDict(extra="forbid")  # a misspelt field is refused (422 naming it), not ignored

    models: list[str] = Field(default_factory=list, max_length=256, description="model ids to copy")


@public_router.post("/machines/{machine}/sync", status_code=202)
def start_sync(machine: str, body: SyncCreate, syncs: SyncService) -> dict[str, Any]:
    """Reserve the machine and ask its worker to pull the models. 409 ``machine_busy`` while it
    has work queued or running, 409 ``machine_syncing`` during another sync, 503 when offline."""
    return syncs.start(machine, body.models)


@public_router.get("/syncs/{sync_id}")
def get_sync(sync_id: str, syncs: SyncService) -> dict[str, Any]:
    """State and progress of a sync: bytes and files done of the total, the current file, results."""
    return syncs.get(sync_id)


@internal_router.post("/syncs/{sync_id}/claim", response_model=SyncGrant)
def claim_sync(sync_id: str, syncs: SyncService, machine: WorkerMachine) -> SyncGrant:
    return syncs.claim(sync_id, machine.name)


@internal_router.post("/syncs/{sync_id}/progress", status_code=204)
def sync_progress(sync_id: str, body: SyncProgress, syncs: SyncService, machine: WorkerMachine) -> None:
    syncs.progress(sync_id, machine.name, body.files_done, body.bytes_done, body.file, body.bytes_kept)


@internal_router.post("/syncs/{sync_id}/finish")
def finish_sync(sync_id: str, body: SyncFinish, syncs: SyncService, machine: WorkerMachine) -> dict[str, Any]:
    return syncs.finish(sync_id, machine.name, body)


@internal_router.get("/models/{model_id}/files/{path:path}", response_class=FileResponse)
def model_file(model_id: str, path: str, ctx: Context, machine: WorkerMachine) -> Response:
    """One file of a registered model, for a worker's sync (R6). Only paths in the model's
    manifest are served (no other file of the server can be named). Supports ``Range``
    (206) so an interrupted copy resumes; ``X-Content-Digest`` carries the manifest digest."""
    manifest = ctx.registry.manifest(model_id)
    entry = next((f for f in manifest.files if f.path == path), None)
    if entry is None:
        raise NotFound(f"model {model_id!r} has no file {path!r} in its manifest", reason="file_not_found")
    return stored_file(
        ctx.registry.folder(model_id) / entry.path,
        "application/octet-stream",
        entry.path.rsplit("/", 1)[-1],
        entry.digest,
    )
