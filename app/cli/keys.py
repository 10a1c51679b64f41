"""``homefleet keys``: each API key's use of the fleet and its quota."""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich.table import Column, Table

from app.cli.common import console, print_table, server_settings

keys_cli = typer.Typer()  # its command is added to the top level (app/cli/main.py)


def _limit(value: float | None) -> str:
    return "-" if value is None else f"{value:g}"


@keys_cli.command()
def keys(
    as_json: Annotated[bool, typer.Option("--json", help="print the rows as a JSON list instead of a table")] = False,
) -> None:
    """API keys (by id: a quota's name from HOMEFLEET_API_KEY_QUOTAS, else key:<12 hex> of the
    key's digest; never the key): jobs queued and running, GPU-seconds (load + run) of its jobs
    that ended in the last hour, and its limits (max_queued_jobs, max_gpu_seconds_per_hour;
    '-': none), and whether it has a webhook secret (HOMEFLEET_WEBHOOK_SECRETS is keyed by
    these ids). Key ids the journal holds jobs of that no configured key has are listed with
    0 keys. Reads the journal, which must be at the newest revision (never migrates it)."""
    from app.context import build_checked_context

    settings = server_settings()
    ctx = build_checked_context(settings)  # checks the revision; migrates nothing
    try:
        rows = ctx.dispatcher.quotas.by_key()
    finally:
        ctx.close()
    if as_json:
        print(
            json.dumps(
                [{**row.as_dict(), "webhook_secret": row.key_id in settings.webhook_secrets} for row in rows], indent=2
            )
        )
        return
    table = Table(
        Column("key", no_wrap=True),  # the id HOMEFLEET_WEBHOOK_SECRETS and quotas are keyed by: never cut
        "keys",
        "queued",
        "running",
        "GPU seconds last hour",
        "max queued jobs",  # HOMEFLEET_QUOTAS' max_queued_jobs and max_gpu_seconds_per_hour, worded to wrap
        "max GPU seconds per hour",
        "webhook secret",
    )
    for row in rows:
        quota = row.quota
        table.add_row(
            row.key_id,
            str(row.keys),
            str(row.queued),
            str(row.running),
            f"{row.gpu_s_last_hour:.1f}",
            _limit(quota.max_queued_jobs if quota else None),
            _limit(quota.max_gpu_seconds_per_hour if quota else None),
            "yes" if row.key_id in settings.webhook_secrets else "no",
        )
    print_table(table)
    if not rows:
        console.print("no API key configured (HOMEFLEET_API_KEYS) and no job of one in the journal")
