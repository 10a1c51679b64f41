"""Readiness, description and metrics of the server (R24): ``/health``, ``/info``, ``/metrics``."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from redis.exceptions import RedisError
from sqlalchemy import text
from sqlalchemy.exc import SQLAlchemyError

from app.api.auth import require_api_key
from app.api.routes.deps import Context
from app.api.strict_json import StrictJsonRoute
from app.core.connections import redacted_url

router = APIRouter(route_class=StrictJsonRoute)


@router.get("/health", response_model=None)
def health(ctx: Context, request: Request) -> JSONResponse:
    """Readiness: 200 only when Redis and the journal answer and at least one machine is
    online; otherwise 503 with ``reason`` (``redis_down``, ``journal_down``, ``journal_mismatch``,
    ``no_machine_online``) and a message. Open (no API key), for probes. With standby servers
    (``leader_election``), ``leads`` says whether this one leads (docs/operations.md, "A standby
    server")."""
    checks: dict[str, Any] = {}
    leadership = getattr(request.app.state, "leadership", None)
    if ctx.settings.leader_election and leadership is not None:
        checks["leads"] = leadership.leads()
    try:
        ctx.redis.ping()
        checks["redis"] = "ok"
    except RedisError as error:
        return _unready(
            "redis_down", f"Redis at {redacted_url(ctx.settings.redis_url)} does not answer: {error}", checks
        )
    try:
        with ctx.engine.connect() as connection:
            connection.execute(text("SELECT 1"))
        checks["journal"] = "ok"
    except SQLAlchemyError as error:
        return _unready("journal_down", f"the journal does not answer: {error}", checks)
    if (refusing := ctx.dispatcher.refusing) is not None:  # the Redis runs with another journal (app/fleet/pairing.py)
        return _unready(refusing.reason, refusing.message, checks)
    online = sorted(name for name, view in ctx.machines.views().items() if view.online)
    checks["machines_online"] = online
    if not online:
        return _unready(
            "no_machine_online", "no machine has a live heartbeat; start a worker (`homefleet worker`)", checks
        )
    return JSONResponse({"status": "ok", **checks})


def _unready(reason: str, message: str, checks: dict[str, Any]) -> JSONResponse:
    return JSONResponse(
        status_code=503, content={"status": "unavailable", **checks, "error": {"reason": reason, "message": message}}
    )


@router.get("/info", dependencies=[Depends(require_api_key)])
def info(ctx: Context) -> dict[str, Any]:
    """Version, machines (online, families, verified models), models, limits (R22, R23)."""
    from importlib.metadata import version

    views = ctx.machines.views()
    settings = ctx.settings
    return {
        "version": version("homefleet"),
        "machines": [
            {
                "name": name,
                "backend": ctx.fleet.machines[name].backend,
                "online": view.online,
                "families": sorted(view.families),
                "verified_models": sorted(view.verified_models),
                "backlog": view.backlog,
            }
            for name, view in views.items()
        ],
        "models": [
            {"id": m.id, "family": m.family, "kinds": m.kinds, "total_bytes": m.total_bytes}
            for m in ctx.registry.list()
        ],
        "limits": {
            "families": {family: limits.model_dump() for family, limits in settings.limits.items()},
            "max_queued_per_machine": settings.max_queued_per_machine,
            "max_pending_total": settings.max_pending_total,
        },
    }


@router.get("/metrics", response_class=Response)
def metrics(ctx: Context) -> Response:
    """Prometheus text exposition (app/metrics.py lists the metrics). Open, for scrapers."""
    return Response(ctx.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")
