"""The fleet at a glance (``homefleet status``, ``GET /v1/machines``): per machine, online,
whether new jobs may be placed there (draining: ``homefleet drain``; syncing: a sync holds its
reservation, R6), verified and warm models, ``queued`` = LLEN of its exact queue list (``Keys.queue_list``,
under the broker key prefix), ``running`` = its running jobs in the journal, ``backlog`` =
their sum (R8), and the expected seconds until its queue drains (routing.finish.drain with
the learned timings; a running job's remaining seconds from its reported steps where it has
reported some, app/fleet/running.py). Each row names its ``host`` and ``device`` (the devices of a
host declared with ``devices`` are machines ``<host>:<index>``; a single-device machine is
its own host, device None); :func:`by_host` groups the rows."""

from __future__ import annotations

import time
from typing import Any, cast

from app.core.states import ACTIVE, JobState
from app.fleet.costs import FleetCosts
from app.fleet.machines import MachineStates
from app.fleet.running import step_report
from app.journal.jobs import Journal
from routing.finish import drain


def fleet_status(machines: MachineStates, journal: Journal, costs: FleetCosts) -> list[dict[str, Any]]:
    """One row per machine of the fleet config, in its order. Changes nothing: the drain
    estimate counts the reservations of live jobs only (those of ended jobs are left to
    reconciliation, which takes the fleet lock and checks the journal's pairing first)."""
    estimator = costs.estimator()
    config = machines.fleet.machines
    reservations = machines.reservations
    rows = []
    for name, view in machines.views().items():
        raw = cast("dict[str, str]", machines.redis.hgetall(machines.keys.reservations(name)))  # decoded
        states = journal.states_of(raw)  # one query per batch of ids, not one per reservation
        live = {job_id: record for job_id, record in raw.items() if states.get(job_id) in ACTIVE}
        running = journal.count_in(JobState.running, name)
        reservations.items_from(name, live)  # parsed first: which of them run
        started = reservations.running(name)
        now_s = time.time()
        replies = machines.read_many([("PROGRESS", machines.keys.progress(job_id)) for job_id in started])
        progress = {job_id: step_report(reply, now_s) for job_id, reply in zip(started, replies, strict=True)}
        drain_s, _ = drain(
            name,
            warm_models=view.warm_models,
            queue=reservations.items_from(name, live, now_s, progress),
            protected=view.commitments,
            costs=estimator,
        )
        queued = machines.queued_in_redis(name)
        rows.append(
            {
                "name": name,
                "host": config[name].host_name,
                "device": config[name].device,
                "online": view.online,
                "draining": view.draining,
                "syncing": view.syncing,
                "state": placing_state(view.draining, view.syncing),
                "verified_models": sorted(view.verified_models),
                "warm_models": list(view.warm_models),
                "queued": queued,
                "running": running,
                "backlog": queued + running,
                "drain_s": round(drain_s, 3),
            }
        )
    return rows


def placing_state(draining: bool, syncing: bool) -> str:
    """Why nothing new is placed on a machine: ``"draining"`` (``homefleet drain``; pinned jobs
    get 503 machine_draining), ``"syncing"`` (a sync copies model files to it; pinned jobs get
    machine_syncing), both joined by ``+``, or ``"-"`` when jobs are placed there as usual."""
    return "+".join(name for name, on in (("draining", draining), ("syncing", syncing)) if on) or "-"


def by_host(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``rows`` of :func:`fleet_status` grouped by host, in fleet order: ``[{"host": "box",
    "machines": [row of box:0, row of box:1]}, {"host": "server", "machines": [row]}, ...]``."""
    hosts: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        hosts.setdefault(row["host"], []).append(row)
    return [{"host": host, "machines": members} for host, members in hosts.items()]
