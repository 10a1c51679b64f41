"""``homefleet jobs``: an operator's hand on single jobs (``requeue``)."""

from __future__ import annotations

from typing import Annotated

import typer

from app.cli.common import console, server_settings
from app.core.errors import Rejected

jobs_cli = typer.Typer(help="Single jobs: run one again.", no_args_is_help=True)


@jobs_cli.command("requeue")
def requeue(
    job_id: Annotated[str, typer.Argument(help="the job to run again (any state), or its id's first characters")],
    seed: Annotated[int | None, typer.Option(min=0, max=2**63 - 1, help="this seed instead of the job's")] = None,
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
