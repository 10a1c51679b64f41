"""``homefleet residency …`` (R16) and ``homefleet oom …`` (R21): server-side commands.

Domain errors (409 ``machine_busy``, unknown machine or model) are printed by ``app.cli.main.main``.
"""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from app.cli.common import console, print_table, require_machine
from app.core.config import Settings
from app.core.errors import Rejected
from app.core.kinds import KINDS

residency_cli = typer.Typer(help="Residency commitments: models a machine keeps loaded (R16).", no_args_is_help=True)
oom_cli = typer.Typer(help="Remembered out-of-memory failures (R21).", no_args_is_help=True)


@residency_cli.command("set")
def residency_set(
    machine: Annotated[str, typer.Argument(help="the machine")],
    models: Annotated[list[str] | None, typer.Argument(help="model ids to keep resident (none: clear)")] = None,
) -> None:
    """Commit MACHINE to keep MODELs resident (its protected set). Refused while it has work
    queued or running (R16): drain it first. Workers apply it at start and at each job."""
    from app.context import build_checked_context
    from app.fleet.residency import commit_residency

    ctx = build_checked_context(Settings())
    try:
        kept = commit_residency(
            ctx.lock, ctx.machines, ctx.residency, ctx.registry, machine, models or [], costs=ctx.dispatcher.costs
        )
        console.print(f"{machine}: keeps {', '.join(sorted(kept)) or 'nothing'} resident")
    finally:
        ctx.close()


@residency_cli.command("show")
def residency_show() -> None:
    """Every machine's residency commitments and warm models."""
    from app.context import build_checked_context

    ctx = build_checked_context(Settings())
    try:
        table = Table("machine", "committed (protected)", "warm models")
        for name, view in ctx.machines.views().items():
            table.add_row(name, ", ".join(sorted(view.commitments)) or "-", ", ".join(view.warm_models) or "-")
        print_table(table)
    finally:
        ctx.close()


@oom_cli.command("list")
def oom_list(machine: Annotated[str | None, typer.Option(help="only this machine")] = None) -> None:
    """Remembered OOMs: jobs of this size or larger are refused there (Auto skips it)."""
    from app.context import build_checked_context

    ctx = build_checked_context(Settings())
    try:
        table = Table("machine", "model", "kind", "size (px x frames x batch)", "job")
        for name in [machine] if machine else sorted(ctx.fleet.machines):
            for record in ctx.residency.ooms(name):
                table.add_row(name, record.model_id, record.kind, str(record.size), record.job_id)
        print_table(table)
    finally:
        ctx.close()


@oom_cli.command("clear")
def oom_clear(
    machine: Annotated[str, typer.Argument(help="the machine")],
    model: Annotated[str | None, typer.Option(help="only this model")] = None,
    kind: Annotated[str | None, typer.Option(help="only this kind")] = None,
) -> None:
    """Forget MACHINE's remembered OOMs (all, or of one model and/or kind)."""
    from app.context import build_checked_context

    ctx = build_checked_context(Settings())
    try:
        require_machine(machine, ctx.fleet.machines)
        if kind is not None and kind not in KINDS:  # a typo would clear nothing and say so as success
            raise Rejected(f"kind {kind!r} is unknown; kinds: {', '.join(KINDS)}", reason="unknown_kind")
        if model is not None:
            ctx.registry.get(model)  # NotFound unknown_model (a retired model's record stays: its OOMs too)
        console.print(f"{machine}: {ctx.residency.clear_ooms(machine, model, kind)} remembered OOMs cleared")
    finally:
        ctx.close()
