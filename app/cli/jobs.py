"""``homefleet jobs``: the journal's jobs (``list``) and an operator's hand on single jobs
(``requeue``)."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Column, Table

from app.cli.common import console, print_table, server_settings
from app.core.errors import Rejected
from app.core.kinds import CHAT_SHOWN_PARAM, MAX_SEED
from app.core.states import JobState

jobs_cli = typer.Typer(help="The journal's jobs: list them, run one again.", no_args_is_help=True)

SHORT_ID = 8
"""Characters of a job id shown, as the fleet page and ``homefleet demo`` show them; ``jobs
requeue`` takes them (a unique prefix)."""
PROMPT_SHOWN = 40
"""Characters of a prompt shown in a row; longer ones end with an ellipsis."""


@jobs_cli.command("list")
def list_jobs(
    state: Annotated[
        list[str] | None, typer.Option(help="only jobs in this state (repeat for several): " + ", ".join(JobState))
    ] = None,
    machine: Annotated[str | None, typer.Option(help="only jobs placed on this machine")] = None,
    limit: Annotated[int, typer.Option(min=1, max=10_000, help="the newest this many")] = 20,
    full_ids: Annotated[bool, typer.Option("--full-ids", help="whole job ids, not their first characters")] = False,
) -> None:
    """The newest jobs in the journal, newest first: id (its first characters; ``jobs requeue``
    takes them), state (with the reason of one that did not succeed), model, kind, machine,
    when it was submitted (UTC) and its prompt (a chat's last user message), cut short."""
    from app.context import build_checked_context

    states = None
    if state:
        unknown = [name for name in state if name not in JobState.__members__]
        if unknown:
            raise Rejected(
                f"--state {unknown[0]!r} is no job state; states: {', '.join(JobState)}", reason="unknown_state"
            )
        states = [JobState(name) for name in state]
    ctx = build_checked_context(server_settings())
    try:
        if machine is not None:
            from app.cli.common import require_machine

            require_machine(machine, ctx.fleet.machines)
        jobs = ctx.journal.page(states, machine, limit=limit, newest_first=True)
    finally:
        ctx.close()
    if not jobs:
        console.print("no jobs" + (" in that state" if state else "") + (f" on {machine}" if machine else ""))
        return
    table = Table(
        Column("id", no_wrap=True),
        "state",
        "model",
        "kind",
        "machine",
        "submitted (UTC)",
        Column("prompt", overflow="fold"),
    )
    for job in jobs:
        prompt = str(job.params.get(CHAT_SHOWN_PARAM) or job.params.get("prompt") or "")
        prompt = " ".join(prompt.split())
        if len(prompt) > PROMPT_SHOWN:
            prompt = prompt[: PROMPT_SHOWN - 1] + "…"
        ended = f" ({job.reason})" if job.reason and job.state != JobState.succeeded else ""
        table.add_row(
            job.id if full_ids else job.id[:SHORT_ID],
            f"{job.state}{ended}",
            job.model_id,
            job.kind,
            job.machine or "-",
            f"{job.created_at:%Y-%m-%d %H:%M:%S}",
            escape(prompt),
        )
    print_table(table)


@jobs_cli.command("requeue")
def requeue(
    job_id: Annotated[str, typer.Argument(help="the job to run again (any state), or its id's first characters")],
    seed: Annotated[int | None, typer.Option(help="this seed instead of the job's (0 to 2**63-1)")] = None,
    new_seed: Annotated[bool, typer.Option("--new-seed", help="a new seed drawn instead of the job's")] = False,
    target: Annotated[str | None, typer.Option(help="a machine name or 'auto' instead of the job's target")] = None,
) -> None:
    """Submit a new job with JOB_ID's model, kind, params and target (``POST /v1/jobs/{id}/requeue``):
    the same seed unless --seed or --new-seed says otherwise, linked to JOB_ID (``requeued_from``),
    under the key that submitted JOB_ID. Every check of a submission applies; a refusal exits 2
    with its reason (``job_not_found`` for an unknown id)."""
    from app.context import build_checked_context
    from app.jobs.dispatch import UNSET

    if seed is not None and new_seed:  # one line, exit 2, as every refusal (not typer's usage box)
        raise Rejected("give --seed or --new-seed, not both", reason="conflicting_options")
    if seed is not None and not 0 <= seed <= MAX_SEED:  # the API's range for params.seed, said the same way
        raise Rejected(f"--seed must be an integer from 0 to {MAX_SEED}, got {seed}", reason="invalid_option")
    ctx = build_checked_context(server_settings())
    try:
        job_id = ctx.journal.full_id(job_id)  # the short ids `homefleet demo` and the page print too
        old = ctx.journal.get(job_id)
        chosen = None if new_seed else (seed if seed is not None else UNSET)
        submission = ctx.dispatcher.requeue(job_id, chosen, target, api_key_id=old.api_key_id)
        job = submission.job
        console.print(
            f"job {job_id} requeued as {job.id}: {job.state} on {job.machine} (position "
            f"{submission.position}, seed {job.params.get('seed')})",
            highlight=False,
        )
    finally:
        ctx.close()
