"""``homefleet timings …``: the learned timings Auto prices machines by (R13), server side.

Domain errors (unknown machine, model or kind) are printed by ``app.cli.main.main``.
"""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from app.cli.common import console, print_table, require_machine
from app.core.config import Settings
from app.core.errors import Rejected
from app.core.kinds import KINDS
from routing.timings import ADAPTER_KIND, TEXT_KIND

timings_cli = typer.Typer(help="Learned timings: what Auto expects each machine to take (R13).", no_args_is_help=True)


@timings_cli.command("list")
def timings_list(
    machine: Annotated[str | None, typer.Option(help="only this machine")] = None,
    retired: Annotated[bool, typer.Option("--retired", help="also retired models' timings, marked so")] = False,
) -> None:
    """Learned timings per machine, model and kind: cold load seconds and the loads measured;
    seconds per step at 1024x1024 (text: per new token) and the runs measured; a thumbnail's
    step (under 256x256); large misses in a row (more than 2.5x off the estimate: + slower, -
    faster; two the same way replace the figure). A (machine, model, kind) not listed is
    priced by the fleet file's guesses. A retired model's timings price nothing (its id is
    never used again, R1): listed only with ``--retired``."""
    from app.context import build_checked_context

    ctx = build_checked_context(Settings())
    try:
        if machine is not None:
            require_machine(machine, ctx.fleet.machines)
        table = Table(
            "machine", "model", "kind", "load s (loads)", "step s (runs)", "thumbnail step s", "misses (+slow -fast)"
        )
        in_service = {record.id for record in ctx.registry.list()}
        hidden = 0
        for (name, model_id, kind), timing in sorted(ctx.timings.load().items()):
            if machine is not None and name != machine:
                continue
            if model_id not in in_service and not retired:
                hidden += 1
                continue
            per = "token" if kind == TEXT_KIND else "step"
            table.add_row(
                name,
                model_id if model_id in in_service else f"{model_id} (retired)",
                kind,
                f"{timing.load_s:.3g} ({timing.load_samples})",
                "-" if kind == ADAPTER_KIND else f"{timing.step_s:.3g} per {per} ({timing.samples})",
                f"{timing.small_step_s:.3g}" if timing.small_step_s else "-",
                f"{timing.misses:+d}" if timing.misses else "0",
            )
        of = f" of {machine}" if machine else ""
        kept = f" ({hidden} of retired models: --retired lists them)" if hidden else ""
        if not table.row_count:
            console.print(
                f"no learned timings{of} of models in service yet{kept}: priced by the fleet file's guesses "
                "until jobs are measured"
            )
            return
        print_table(table)
        if hidden:
            console.print(f"{hidden} learned timings{of} of retired models not listed (--retired lists them)")
    finally:
        ctx.close()


@timings_cli.command("forget")
def timings_forget(
    machine: Annotated[str, typer.Argument(help="the machine")],
    model: Annotated[str | None, typer.Option(help="only this model")] = None,
    kind: Annotated[str | None, typer.Option(help="only this kind")] = None,
) -> None:
    """Forget MACHINE's learned timings (all, or of one model and/or kind): it is priced by the
    fleet file's guesses until its next runs are measured. After a repair (a GPU that had fallen
    back to its CPU), Auto sends no job to a machine it learned to be slow, so it would not see
    the repair by itself."""
    from app.context import build_checked_context

    ctx = build_checked_context(Settings())
    try:
        require_machine(machine, ctx.fleet.machines)
        kinds = (*KINDS, ADAPTER_KIND)
        if kind is not None and kind not in kinds:  # a typo would forget nothing, as success
            raise Rejected(f"kind {kind!r} is unknown; kinds: {', '.join(kinds)}", reason="unknown_kind")
        if model is not None:
            ctx.registry.get(model)  # NotFound unknown_model (a retired model's record stays: its timings too)
        forgotten = ctx.timings.forget(machine, model, kind)
        if not forgotten:
            which = " ".join(f"{name} {value}" for name, value in (("model", model), ("kind", kind)) if value)
            console.print(
                f"{machine}: no learned timing{f' of {which}' if which else ''} to forget "
                "(homefleet timings list shows what was learned)"
            )
            return
        console.print(
            f"{machine}: {forgotten} learned timings forgotten; priced by the fleet file's guesses until measured again"
        )
    finally:
        ctx.close()
