"""Placement rules R9–R11: the default target, explicit targets (there or nowhere), and
Auto's filters with a simple rank (fewest jobs ahead, then name).

Everything here is pure: it takes :class:`MachineView` snapshots and a :class:`JobRequest`
and returns a :class:`Placement` or raises a domain error. No machine is ever chosen that
the request did not allow: an explicit target is never rerouted (R10).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from app.errors import MachineUnavailable, Rejected
from app.fleet import SERVER

AUTO = "auto"


@dataclass(frozen=True)
class MachineView:
    """What placement knows of one machine at the moment of the decision."""

    name: str
    online: bool  # a live heartbeat
    families: frozenset[str]  # model families it supports (fleet config)
    verified_models: frozenset[str]  # models whose files it verified against the manifest (R4)
    backlog: int = 0  # jobs queued on it + the one running
    syncing: bool = False  # a sync holds its reservation: model files are being copied to it (R6)


@dataclass(frozen=True)
class JobRequest:
    model_id: str
    family: str
    kind: str
    target: str = SERVER  # a machine name, or "auto" (R11: opt-in)


@dataclass(frozen=True)
class Placement:
    machine: str
    excluded: dict[str, str] = field(default_factory=dict)  # machine -> reason (Auto only)


def exclusion(job: JobRequest, machine: MachineView) -> tuple[str, str] | None:
    """The first filter that excludes ``machine`` for ``job`` as (reason, message), or None.

    Order: online, not syncing (R6), family supported, model verified there (R11).
    """
    if not machine.online:
        return "machine_unavailable", f"machine {machine.name!r} is offline (no live heartbeat)"
    if machine.syncing:
        return (
            "machine_syncing",
            f"machine {machine.name!r} is receiving model files (a sync holds it); nothing is placed there until "
            f"the sync ends",
        )
    if job.family not in machine.families:
        supported = ", ".join(sorted(machine.families)) or "none"
        return (
            "family_not_supported",
            f"machine {machine.name!r} does not support family {job.family!r} of model {job.model_id!r}; "
            f"it supports: {supported}",
        )
    if job.model_id not in machine.verified_models:
        return (
            "model_not_verified",
            f"model {job.model_id!r} is not verified on machine {machine.name!r}; "
            f"run `homefleet sync {machine.name} {job.model_id}` first",
        )
    return None


def place(job: JobRequest, machines: Mapping[str, MachineView]) -> Placement:
    """Choose the machine for ``job``.

    Raises:
        Rejected: unknown machine (reason ``unknown_machine``), or a filter excludes the
            explicit target, or Auto finds no machine (reason ``no_machine``).
        MachineUnavailable: the explicit target is offline (R10: never rerouted).
    """
    target = job.target or SERVER
    if target != AUTO:
        machine = machines.get(target)
        if machine is None:
            known = ", ".join(sorted(machines))
            raise Rejected(f"target {target!r} is not a machine of this fleet; machines: {known}", reason="unknown_machine")
        refusal = exclusion(job, machine)
        if refusal is not None:
            reason, message = refusal
            if reason == "machine_unavailable":
                raise MachineUnavailable(message)
            raise Rejected(message, reason=reason)
        return Placement(machine=target)

    excluded: dict[str, str] = {}
    candidates = []
    for machine in machines.values():
        refusal = exclusion(job, machine)
        if refusal is None:
            candidates.append(machine)
        else:
            excluded[machine.name] = refusal[0]
    if not candidates:
        detail = ", ".join(f"{name}: {reason}" for name, reason in sorted(excluded.items()))
        raise Rejected(f"no machine can run model {job.model_id!r} ({detail})", reason="no_machine")
    best = min(candidates, key=lambda m: (m.backlog, m.name))
    return Placement(machine=best.name, excluded=excluded)
