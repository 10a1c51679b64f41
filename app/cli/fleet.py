"""Fleet operations: ``homefleet sync``, ``status``, ``deadletter``, ``flower``, ``drain``, ``reconcile``."""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator
from typing import Annotated

import typer
from rich.table import Column, Table

from app.cli.common import console, errors, print_table, require_machine, server_settings
from app.core.errors import Rejected

fleet_cli = typer.Typer()  # its commands are added to the top level (app/cli/main.py)


@fleet_cli.command()
def sync(
    machine: Annotated[str, typer.Argument(help="the machine to copy to")],
    model: Annotated[list[str] | None, typer.Argument(help="model ids; default: every model it supports")] = None,
    wait: Annotated[bool, typer.Option(help="follow the copy with a progress bar until it ends")] = True,
) -> None:
    """Copy model files from the server to MACHINE (R6): the worker pulls, verifies, renames.
    Refused (exit 2) while the machine has work queued or running. Exit 1 if the sync fails."""
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    from app.context import build_checked_context
    from app.core.protocol import SYNC_FILE_DONE
    from app.jobs.sync import SYNC_ENDED

    ctx = build_checked_context(server_settings())
    try:
        syncs = ctx.syncs()
        record = syncs.start(machine, model or [])
        with _following(record["id"], machine):  # from here on, Ctrl-C stops following, not the sync
            console.print(
                f"sync {record['id']} to [bold]{machine}[/]: {record['files_total']} files, "
                f"{record['bytes_total']} bytes of {', '.join(record['models']) or 'no models'}"
            )
            if not wait:
                return
            columns = (
                TextColumn("{task.description}"),
                BarColumn(bar_width=20),
                DownloadColumn(),
                TransferSpeedColumn(),
                TimeRemainingColumn(),
            )
            # the figures' columns take ~56 characters; the machine, the files' count and the current
            # file share the rest (80 columns: the file's name is cut from the left)
            room = max(16, console.width - 56)
            with Progress(*columns, console=console) as progress:
                # The bar counts the bytes downloaded: those found in place (a file present with its
                # digest, a partial copy resumed) leave its total, so its rate is the transfer's.
                bar = progress.add_task(machine, total=max(record["bytes_total"], 1))
                while record["state"] not in SYNC_ENDED:
                    time.sleep(0.2)
                    record = syncs.get(record["id"])
                    kept = record["bytes_kept"]
                    text = f"{machine} {record['files_done']}/{record['files_total']} {record['file']}"
                    progress.update(
                        bar,
                        total=record["bytes_total"] - kept,  # 0 when every byte was there: the bar is full
                        completed=record["bytes_done"] - kept,
                        description=text if len(text) <= room else "…" + text[-(room - 1) :],
                    )
            if record["bytes_kept"]:
                console.print(f"{record['bytes_kept']} bytes were already on {machine}: not downloaded")
    finally:
        ctx.close()
    for result in record["results"]:
        if result["status"] == "replaced":
            console.print(f"[yellow]replaced[/] {result['model_id']}/{result['path']}: {result['message']}")
        elif result["status"] not in SYNC_FILE_DONE:
            console.print(f"[red]{result['status']}[/] {result['model_id']}/{result['path']}: {result['message']}")
    colour = "green" if record["state"] == "succeeded" else "red"
    console.print(
        f"sync {record['id']} [{colour}]{record['state']}[/]; {machine} verifies: "
        f"{', '.join(record['verified']) or 'none'}" + (f"; {record['message']}" if record["message"] else "")
    )
    raise typer.Exit(0 if record["state"] == "succeeded" else 1)


@contextlib.contextmanager
def _following(sync_id: str, machine: str) -> Iterator[None]:
    """Following a sync's progress: Ctrl-C stops following, not the sync (the worker copies on),
    and says so and where to follow it again; exit 130, as for any interrupt."""
    try:
        yield
    except KeyboardInterrupt:
        console.print(
            f"stopped following sync {sync_id}: it goes on on {machine} (GET /v1/syncs/{sync_id} "
            "follows it; the machine takes no job until it ends)"
        )
        raise typer.Exit(130) from None


def models_cell(verified: list[str], warm: list[str]) -> str:
    """A machine's models in ``homefleet status``: each verified one on a line of its own, ``*``
    after those loaded (warm); one still loaded but no longer verified is being withdrawn (R4),
    said so; ``-`` for none."""
    lines = [f"{model}*" if model in warm else model for model in verified]
    lines += [f"{model} (withdrawn)" for model in warm if model not in verified]
    return "\n".join(lines) or "-"


@fleet_cli.command()
def status(
    as_json: Annotated[
        bool, typer.Option("--json", help="print JSON: the machines grouped by host, and the dead letters' count")
    ] = False,
) -> None:
    """Machines: online, state (draining, syncing: nothing new is placed there), verified
    models (``*``: warm), queued (LLEN of the machine's queue list, under HOMEFLEET_BROKER_KEY_PREFIX),
    running (from the journal) and expected drain time (seconds, from learned timings). The
    devices of a host (``box:0``, ``box:1``) are listed under its line. ``--json``:
    ``{"hosts": [{"host", "machines": [row, ...]}, ...], "dead_letters": n}``, each row as in
    ``GET /v1/machines``' status (app/fleet/status.py)."""
    import json

    from app.context import build_checked_context
    from app.core.connections import redacted_url
    from app.fleet.queues import DeadLetters
    from app.fleet.status import by_host

    ctx = build_checked_context(server_settings())  # running counts come from the journal: the server's
    try:
        hosts = by_host(ctx.status())
        dead = DeadLetters(ctx.redis, ctx.keys.dead_letters()).count()
        if as_json:
            print(json.dumps({"hosts": hosts, "dead_letters": dead}, indent=2))
            return
        rows = [row for host in hosts for row in host["machines"]]
        longest = max((len(model) + 1 for row in rows for model in row["verified_models"]), default=1)
        table = Table(  # names are never cut: a machine's stays on one line, a model's too up to 40 characters
            Column("machine", no_wrap=True),
            "online",
            "state",
            Column("models (*: warm)", overflow="fold", min_width=min(longest, 40)),
            "queued",
            "running",
            "drain_s",
        )
        for host in hosts:
            devices = [row for row in host["machines"] if row["device"] is not None]
            if devices:  # a host line, its devices under it
                table.add_row(
                    f"[bold]{host['host']}[/]",
                    f"{sum(row['online'] for row in devices)}/{len(devices)}",
                    f"{len(devices)} devices",
                    "",
                    str(sum(row["queued"] for row in devices)),
                    str(sum(row["running"] for row in devices)),
                    "",
                )
            for row in host["machines"]:
                table.add_row(
                    f"  {row['name']}" if devices else row["name"],
                    "yes" if row["online"] else "no",
                    row["state"],
                    models_cell(row["verified_models"], row["warm_models"]),
                    str(row["queued"]),
                    str(row["running"]),
                    f"{row['drain_s']:.1f}",
                )
        print_table(table)
        console.print(
            f"dead letters: {dead}"
            + (" (undecodable queue messages; `homefleet deadletter` lists them)" if dead else "")
        )
        if ctx.redis.get(ctx.keys.journal()) is None:  # app/fleet/pairing.py: every server records its journal
            errors.print(  # a warning: stdout keeps the table
                f"note: the Redis at {redacted_url(ctx.settings.redis_url)} (key prefix {ctx.keys.prefix!r}) "
                "records no journal: no server has run with it; is HOMEFLEET_REDIS_URL (and HOMEFLEET_KEY_PREFIX) "
                "the server's?",
                highlight=False,
            )
    finally:
        ctx.close()


@fleet_cli.command()
def deadletter(
    clear: Annotated[bool, typer.Option("--clear", help="remove them after listing")] = False,
    limit: Annotated[int, typer.Option(help="list at most this many, newest first")] = 100,
) -> None:
    """Messages workers moved aside because they could not be decoded (not JSON, a body that is
    not base64…): queue, time, error and the raw message. ``--clear`` removes them."""
    import datetime

    from app.context import build_checked_context
    from app.fleet.queues import DeadLetters

    ctx = build_checked_context(server_settings())
    try:
        letters = DeadLetters(ctx.redis, ctx.keys.dead_letters())
        entries = letters.list(limit)
        table = Table("queue", "at (UTC)", "error", "raw")
        for entry in entries:
            at = entry.get("at")
            when = (
                datetime.datetime.fromtimestamp(at, datetime.UTC).isoformat(timespec="seconds")
                if isinstance(at, int | float)
                else "-"
            )
            raw = str(entry.get("raw"))
            table.add_row(
                str(entry.get("queue") or "-"),
                when,
                str(entry.get("error")),
                raw if len(raw) <= 200 else f"{raw[:200]}… ({len(raw)} characters)",
            )
        print_table(table)
        console.print(f"{letters.count()} dead letters" + (f", newest {len(entries)} shown" if entries else ""))
        if clear:
            console.print(f"cleared {letters.clear()} dead letters")
    finally:
        ctx.close()


@fleet_cli.command()
def flower(
    port: int = 5555,
    address: str = "127.0.0.1",
    basic_auth: Annotated[
        str | None,
        typer.Option(
            envvar="FLOWER_BASIC_AUTH",
            help="user:password for the dashboard and API; better set FLOWER_BASIC_AUTH "
            "(a command line is visible to every user of the host)",
        ),
    ] = None,
) -> None:
    """Run Flower against the fleet's broker (workers must run with -E, which `homefleet worker` does),
    with its broker key prefix (HOMEFLEET_BROKER_KEY_PREFIX). Redis is asked first: Flower itself
    would retry a broker that does not answer forever, printing the same warning (redis_down)."""
    import os

    from app.cli.listening import refuse_taken_port
    from app.core.connections import create_redis
    from app.core.errors import ConfigError

    if basic_auth is not None and not all(":" in pair.strip()[1:-1] for pair in basic_auth.split(",")):
        raise ConfigError(  # Flower would start and let no one in; the value itself is never shown
            "--basic-auth (FLOWER_BASIC_AUTH) must be user:password, several comma-separated",
            reason="invalid_settings",
        )
    refuse_taken_port(address, port, "Flower's address", "--port (or --address)")
    client = create_redis(server_settings())
    try:
        client.ping()
    finally:
        client.close()
    argv = [sys.executable, "-m", "celery", "-A", "app.celery", "flower", f"--port={port}", f"--address={address}"]
    env = dict(os.environ)
    if basic_auth:  # Flower reads it from its environment: never put in its command line
        env["FLOWER_BASIC_AUTH"] = basic_auth
    elif env.get("FLOWER_UNAUTHENTICATED_API", "").lower() not in ("1", "true", "yes"):
        errors.print(
            f"warning: no --basic-auth (FLOWER_BASIC_AUTH): Flower's dashboard at {address}:{port} is open to "
            "whoever reaches it, and its REST API, which its Revoke and Terminate buttons call, answers 401; "
            "set FLOWER_BASIC_AUTH=user:password to use them",
            soft_wrap=True,
            highlight=False,
        )
    sys.stderr.flush()  # what was said before Flower replaces this process
    os.execve(sys.executable, argv, env)


@fleet_cli.command()
def drain(
    machine: Annotated[str, typer.Argument(help="the machine to drain")],
    undo: Annotated[bool, typer.Option("--undo", help="resume placing jobs on it")] = False,
    wait: Annotated[bool, typer.Option(help="wait until its backlog is empty")] = True,
    timeout_s: Annotated[float, typer.Option(help="how long to wait, seconds", min=0)] = 3600.0,
) -> None:
    """Stop placing new jobs on MACHINE (pinned jobs get 503 machine_draining, Auto skips it),
    then wait with a progress bar until its queued and running jobs are done."""
    from rich.progress import Progress

    from app.context import build_checked_context

    ctx = build_checked_context(server_settings())
    try:
        require_machine(machine, ctx.fleet.machines)
        if undo:
            ctx.drains.undo([machine])
            console.print(f"{machine}: placing jobs again")
            return
        ctx.drains.drain([machine])
        backlog = ctx.machines.view(machine).backlog
        console.print(f"{machine}: draining; {backlog} jobs queued or running")
        if not wait:
            return
        deadline = time.monotonic() + timeout_s
        with Progress(console=console) as progress:
            bar = progress.add_task(f"draining {machine}", total=max(backlog, 1))
            while (left := ctx.machines.view(machine).backlog) and time.monotonic() < deadline:
                progress.update(bar, completed=max(backlog, 1) - min(left, backlog))
                time.sleep(1)
            if not left:
                progress.update(bar, completed=max(backlog, 1))
        if left:
            console.print(f"{machine}: {left} jobs still there after {timeout_s} s; it stays drained")
            raise typer.Exit(1)
        console.print(f"{machine}: drained")
    finally:
        ctx.close()


@fleet_cli.command()
def purge(
    machine: Annotated[str, typer.Argument(help="the machine whose queued jobs to remove")],
    yes: Annotated[bool, typer.Option("--yes", "-y", help="do not ask")] = False,
) -> None:
    """Remove every queued job of MACHINE: each ends `cancelled` (reason `purged`), journal first,
    then its message leaves the queue. The job it runs now is left alone. Asks first on a
    terminal; elsewhere (a script) it needs --yes. (`celery purge` has the
    same outcome, reported by reconciliation after HOMEFLEET_LOST_GRACE_S.)"""
    from app.context import build_checked_context

    ctx = build_checked_context(server_settings())
    try:
        require_machine(machine, ctx.fleet.machines)
        ctx.redis.ping()  # a Redis that does not answer is said before the question, not after (redis_down)
        if not yes and not sys.stdin.isatty():  # a script: one line naming the flag, not click's "Aborted!"
            raise Rejected(
                f"purge asks before it cancels every queued job of {machine}, and stdin is no terminal: "
                f"add --yes (homefleet purge {machine} --yes)",
                reason="confirmation_needed",
            )
        if not yes:
            typer.confirm(f"cancel every queued job of {machine}?", abort=True)
        purged = ctx.dispatcher.purge(machine)
        console.print(f"{machine}: purged {len(purged)} queued jobs" + "".join(f"\n  {job.id}" for job in purged))
    finally:
        ctx.close()


@fleet_cli.command()
def reconcile() -> None:
    """One reconciliation pass now (the API also runs one at start and periodically, R19)."""
    from app.context import build_checked_context

    ctx = build_checked_context(server_settings())
    try:
        console.print(str(ctx.reconciler(server=False).run_once()))
    finally:
        ctx.close()
