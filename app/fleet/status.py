"""The fleet at a glance (``homefleet status``, ``GET /v1/machines``): per machine, online,
whether new jobs may be placed there (draining: ``homefleet drain``; syncing: a sync holds its
reservation, R6), verified and warm models, backlog = LLEN of its exact queue key + running
jobs (R8), and the expected seconds until its queue drains (routing.finish.drain with the
learned timings)."""

from __future__ import annotations

from typing import Any

from app.context import ServerContext
from app.journal.jobs import ENDED, JobState
from routing.finish import drain

ENDED_OR_UNKNOWN = ENDED | {None}


def fleet_status(ctx: ServerContext) -> list[dict[str, Any]]:
    """One row per machine of the fleet config, in its order. Changes nothing: the drain
    estimate counts the reservations of live jobs only (those of ended jobs are left to
    reconciliation, which takes the fleet lock and checks the journal's pairing first)."""
    estimator = ctx.dispatcher.costs.estimator()
    reservations = ctx.machines.reservations
    rows = []
    for name, view in ctx.machines.views().items():
        running = len(ctx.journal.list(states=[JobState.running], machine=name))
        raw = ctx.redis.hgetall(ctx.keys.reservations(name))
        live = {job_id: record for job_id, record in raw.items() if ctx.journal.state_of(job_id) not in ENDED_OR_UNKNOWN}
        drain_s, _ = drain(name, warm_models=view.warm_models, queue=reservations.items_from(name, live),
                           protected=view.commitments, costs=estimator)
        rows.append({
            "name": name, "online": view.online, "draining": view.draining, "syncing": view.syncing,
            "state": placing_state(view.draining, view.syncing), "verified_models": sorted(view.verified_models),
            "warm_models": list(view.warm_models), "queued": ctx.machines.queued_in_redis(name), "running": running,
            "backlog": ctx.machines.queued_in_redis(name) + running, "drain_s": round(drain_s, 3),
        })
    return rows


def placing_state(draining: bool, syncing: bool) -> str:
    """Why nothing new is placed on a machine: ``"draining"`` (``homefleet drain``; pinned jobs
    get 503 machine_draining), ``"syncing"`` (a sync copies model files to it; pinned jobs get
    machine_syncing), both joined by ``+``, or ``"-"`` when jobs are placed there as usual."""
    return "+".join(name for name, on in (("draining", draining), ("syncing", syncing)) if on) or "-"
