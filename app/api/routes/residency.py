"""Residency commitments (R16) and remembered OOMs (R21) over the public API."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from pydantic import ConfigDict, Field

from app.api.routes.deps import Context
from app.api.strict_json import StrictJsonRoute
from app.context import ServerContext
from app.core.errors import NotFound
from app.core.request_body import RequestBody
from app.fleet.residency import commit_residency

router = APIRouter(prefix="/v1", route_class=StrictJsonRoute)


class CommitmentsUpdate(RequestBody):
    model_config = ConfigDict(extra="forbid")  # a misspelt field is refused (422 naming it), not ignored

    models: list[str] = Field(default_factory=list, description="model ids to keep resident (empty: none)")


def _check_machine(ctx: ServerContext, machine: str) -> None:
    if machine not in ctx.fleet.machines:
        raise NotFound(
            f"machine {machine!r} is not in the fleet ({', '.join(sorted(ctx.fleet.machines))})",
            reason="unknown_machine",
        )


@router.get("/machines/{machine}/residency")
def get_commitments(machine: str, ctx: Context) -> dict[str, Any]:
    """The machine's residency commitments (its protected set) and its warm models."""
    _check_machine(ctx, machine)
    view = ctx.machines.view(machine)
    return {"machine": machine, "models": sorted(view.commitments), "warm_models": list(view.warm_models)}


@router.put("/machines/{machine}/residency")
def set_commitments(machine: str, body: CommitmentsUpdate, ctx: Context) -> dict[str, Any]:
    """Replace the machine's residency commitments. 409 ``machine_busy`` while it has work
    queued or running (R16); 404 for an unknown machine or model; 422 ``commitment_too_large``
    when the models cannot stay resident beside their largest job. Checked and written under
    the fleet lock, so no job is placed there in between (R14)."""
    kept = commit_residency(
        ctx.lock, ctx.machines, ctx.residency, ctx.registry, machine, body.models, costs=ctx.dispatcher.costs
    )
    return {"machine": machine, "models": sorted(kept)}


@router.get("/ooms")
def list_ooms(ctx: Context, machine: str | None = None) -> list[dict[str, Any]]:
    """Remembered OOMs (R21), of every machine or one."""
    machines = [machine] if machine else sorted(ctx.fleet.machines)
    return [r.public() for m in machines for r in ctx.residency.ooms(m)]


@router.delete("/ooms")
def clear_ooms(ctx: Context, machine: str, model: str | None = None, kind: str | None = None) -> dict[str, Any]:
    """Forget remembered OOMs of ``machine`` (optionally of one model and/or kind)."""
    _check_machine(ctx, machine)
    return {"machine": machine, "cleared": ctx.residency.clear_ooms(machine, model, kind)}
