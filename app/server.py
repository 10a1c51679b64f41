"""``create_app(settings)``: the FastAPI application, with domain errors mapped once."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from app.config import Settings
from app.context import ServerContext, build_context
from app.errors import HomefleetError
from app.reconcile import ReconcileLoop, Reconciler
from app.routes import internal, public, residency, sync


def create_app(settings: Settings, ctx: ServerContext | None = None) -> FastAPI:
    """Build the API. The context (journal, Redis, Celery…) is created here unless given."""
    context = ctx or build_context(settings)

    reconcile = ReconcileLoop(Reconciler(context), settings.reconcile_interval_s)

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        reconcile.start()  # at server start, then periodically (R19)
        yield
        reconcile.stop()
        context.close()

    api = FastAPI(title="Homefleet", version="0.1.0", lifespan=lifespan)
    api.state.ctx = context

    @api.exception_handler(HomefleetError)
    async def domain_error(_request: Request, error: HomefleetError) -> JSONResponse:
        return JSONResponse(status_code=error.status_code, content={"error": {"reason": error.reason, "message": error.message}})

    @api.get("/health")
    def health() -> dict[str, object]:
        context.redis.ping()
        online = [name for name, view in context.machines.views().items() if view.online]
        return {"status": "ok", "machines_online": online}

    api.include_router(public.router)
    api.include_router(internal.router)
    api.include_router(sync.public_router)
    api.include_router(sync.internal_router)
    api.include_router(residency.router)
    return api
