"""``GET /v1/jobs/{id}/events``: a job's life as Server-Sent Events (sse-starlette).

Events (``data`` is JSON):
- ``state``: ``{"state", "machine", "reason", "message"}`` at the start and on every change
  (the journal is the source).
- ``progress``: ``{"step", "total"}`` on every new step while running (Redis progress hash).
- ``end``: once the job has ended: the job as ``GET /v1/jobs/{id}`` returns it, with
  ``result_url`` when it succeeded; then the stream closes. A job that has already ended
  gets its ``state`` and ``end`` events at once, in that order, and no ``progress`` (its
  last report is past).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from anyio import to_thread
from fastapi import APIRouter
from sse_starlette.sse import EventSourceResponse

from app.api.routes.deps import Context
from app.api.schemas import JobPublic
from app.api.strict_json import StrictJsonRoute
from app.context import ServerContext
from app.core.states import ENDED
from app.jobs.progress import Progress

router = APIRouter(prefix="/v1", route_class=StrictJsonRoute)

PING_S = 15  # keep-alive comment interval (seconds)


@router.get("/jobs/{job_id}/events", response_class=EventSourceResponse)
async def job_events(job_id: str, ctx: Context) -> EventSourceResponse:
    """Stream a job's state changes, per-step progress and final result URL. 404 for an unknown id."""
    await to_thread.run_sync(ctx.journal.get, job_id)  # NotFound before the stream starts
    return EventSourceResponse(_events(ctx, job_id), ping=PING_S)


async def _events(ctx: ServerContext, job_id: str) -> AsyncIterator[dict[str, Any]]:
    last_step = None
    # woken by the job's changes (app/jobs/waiting.py); a job ended before the first read
    # shows no past progress: its stream is its state, then its end (docs/api.md "Events")
    async for change in ctx.waiting.follow(job_id, past_progress=False):
        if isinstance(change, Progress):
            if (shown := change.public()) is not None and shown["step"] != last_step:
                last_step = shown["step"]
                yield {"event": "progress", "data": json.dumps(shown)}
            continue
        job = change
        yield {
            "event": "state",
            "data": json.dumps(
                {"state": job.state, "machine": job.machine, "reason": job.reason, "message": job.message}
            ),
        }
        if job.state in ENDED:
            body = JobPublic.from_job(job).model_dump(mode="json")
            body["result_url"] = body["result"]["url"] if body.get("result") else None
            yield {"event": "end", "data": json.dumps(body)}
            return
