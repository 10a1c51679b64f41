"""``homefleet machines add|remove|rotate-token|list``: the fleet's machines, changed in the
running server without a restart (docs/operations.md, "Add a machine").

Run on the server's host, with the server's settings (``HOMEFLEET_FLEET_FILE``,
``HOMEFLEET_REDIS_URL``, ``HOMEFLEET_DATA_DIR``), like every other fleet command: they reach the
running server through its Redis and journal, not over HTTP. The fleet file stays the one home
of the machines (app/fleet/live.py rewrites it atomically); the running server reloads it
(app/api/fleet_reload.py) and reports in Redis what it did, which these commands wait for.
"""

from __future__ import annotations

import ipaddress
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated
from urllib.parse import urlsplit

import typer
from pydantic import ValidationError
from rich.markup import escape
from rich.table import Table

from app.cli.common import console, errors, print_table, require_machine, server_settings
from app.core.errors import ConfigError, Conflict, Rejected
from app.core.families import FAMILIES
from app.fleet.config import Backend

if TYPE_CHECKING:
    from app.context import ServerContext

machines_cli = typer.Typer(
    help="Add, remove and list the fleet's machines in the running server (no restart).", no_args_is_help=True
)

#: how long a command waits for the running server to reload the fleet file, seconds
RELOAD_WAIT_S = 30.0


def _fleet_file(ctx: ServerContext) -> Path:
    path = ctx.settings.fleet_file
    if path is None:
        raise ConfigError(
            "HOMEFLEET_FLEET_FILE is not set: the embedded default fleet cannot be changed; copy it "
            'to a file and point HOMEFLEET_FLEET_FILE there (docs/operations.md, "The fleet file")'
        )
    return path


def _server_url(ctx: ServerContext, given: str | None) -> str:
    """The server's URL for a join command: ``given`` (``--server-url``), else the server's
    own address (``Settings.base_url``: ``HOMEFLEET_PUBLIC_BASE_URL``, else
    ``http://HOMEFLEET_API_HOST:HOMEFLEET_API_PORT``)."""
    return given.rstrip("/") if given else ctx.settings.base_url


def _on_loopback(url: str) -> bool:
    """Whether ``url``'s host is this host's loopback address (``localhost``, 127.0.0.0/8, ::1)."""
    host = urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _join_command(
    ctx: ServerContext, server_url: str | None, token: str, models_dir: str | None = None, warn: bool = True
) -> None:
    """Print the join command (stdout: one line to copy; with ``--models-dir models_dir`` when
    given), and warn on stderr when what it hands the new host, the server's URL or the Redis its
    worker gets (``HOMEFLEET_WORKER_REDIS_URL``, else the server's ``HOMEFLEET_REDIS_URL``), names
    this host's loopback address: a worker on another host reaches neither (docs/operations.md,
    "Add a machine"); ``warn`` False: no warning (one already said it for the same URLs)."""
    url = _server_url(ctx, server_url)
    print(f"homefleet worker join {url} {token}" + (f" --models-dir {models_dir}" if models_dir else ""))
    broker = ctx.settings.worker_redis_url or ctx.settings.redis_url
    local = [what for what, on in (("the server's URL", _on_loopback(url)), ("its Redis", _on_loopback(broker))) if on]
    if local and warn:
        errors.print(
            f"[yellow]warning:[/] {' and '.join(local)} name this host's loopback address: only a worker on this host "
            "can use them. For another host give --server-url http://<this host>:PORT (or set "
            "HOMEFLEET_PUBLIC_BASE_URL) with the API listening there (HOMEFLEET_API_HOST=0.0.0.0), and a Redis it "
            "reaches (HOMEFLEET_WORKER_REDIS_URL)",
            soft_wrap=True,
        )


def _write_and_wait(ctx: ServerContext, path: Path, old: str, new: str, wait_s: float) -> None:
    """Write ``new`` and wait until the running server took it. A refusal puts ``old`` back.

    Raises:
        Conflict: the server refused the file (reason ``fleet_refused``, its reason quoted).
    """
    from app.fleet import live

    live.write_atomically(path, new)
    digest = live.text_digest(new)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        report = live.loaded_report(ctx.redis, ctx.keys)
        if report and report["digest"] == digest:
            if report["state"] == "loaded":
                console.print(f"the running server (pid {report['pid']}) reloaded {path}")
                return
            live.write_atomically(path, old)
            raise Conflict(
                f"the running server refused the change and keeps its fleet: {report['reason']}", reason="fleet_refused"
            )
        time.sleep(0.2)
    errors.print(  # a warning: stdout keeps what a script reads (the join command)
        f"[yellow]no running server reloaded {path} within {wait_s:.0f} s[/]: a server loads it at start, "
        "or send it SIGHUP"
    )


@machines_cli.command("add")
def add(
    name: Annotated[str, typer.Argument(help="the new machine's name (a host name: lowercase letters, digits, '-')")],
    backend: Annotated[Backend, typer.Option(help="its device")] = Backend.cpu,
    memory: Annotated[float, typer.Option(help="memory for jobs, GB (10^9 bytes)", min=0.001)] = 8.0,
    families: Annotated[
        list[str] | None,
        typer.Option(
            help="model families it runs (repeat the option, or sd1,sdxl); default: every family of the fleet"
        ),
    ] = None,
    speed: Annotated[
        float, typer.Option(help="diffusion speed relative to the server (R13's first guess)", min=0.001)
    ] = 1.0,
    server_url: Annotated[
        str | None,
        typer.Option(
            help="the server's URL as the new host reaches it; default HOMEFLEET_PUBLIC_BASE_URL, else "
            "http://HOMEFLEET_API_HOST:HOMEFLEET_API_PORT"
        ),
    ] = None,
    expires_s: Annotated[
        float | None,
        typer.Option(help="the join token's lifetime, seconds (default HOMEFLEET_JOIN_TOKEN_TTL_S, 900)", min=1),
    ] = None,
    wait_s: Annotated[float, typer.Option(help="how long to wait for the running server to reload")] = RELOAD_WAIT_S,
) -> None:
    """Register machine NAME in the fleet file and the running server (no restart), and print
    the one-time join command to run on the new host: ``homefleet worker join SERVER_URL
    JOIN_TOKEN``. The join token is single use and expires; it is not the machine's token,
    which the server hands over at the join and never appears on a command line."""
    from app.context import build_checked_context
    from app.fleet import live

    ctx = build_checked_context(server_settings())
    try:
        path = _fleet_file(ctx)
        with live.editing(path):
            old = path.read_text()
            fleet = live.parse(old, path)
            if name in fleet.hosts():
                raise Conflict(
                    f"machine {name!r} is in the fleet already; `homefleet machines rotate-token {name}` prints a "
                    "new join command",
                    reason="machine_exists",
                )
            given = sorted({f.strip() for item in families or [] for f in item.split(",") if f.strip()})
            unknown = [f for f in given if f not in FAMILIES]
            if unknown:  # a machine of no known family would be placed nothing, silently
                raise Rejected(
                    f"--families: {', '.join(map(repr, unknown))} is no model family; families: {', '.join(FAMILIES)}",
                    reason="unknown_family",
                    param="families",
                )
            chosen = given or sorted(fleet.family_names)
            entry = live.new_machine_entry(name, backend, int(memory * 1e9), chosen, speed)
            try:
                new = live.edit(old, lambda entries: entries.append(entry))
            except ValidationError as error:  # the fleet file's own rule, in its words, one line
                problem = error.errors()[0]
                raise Rejected(
                    str(problem["msg"]).removeprefix("Value error, "), reason="invalid_machine", param="name"
                ) from error
            except ValueError as error:
                raise typer.BadParameter(str(error), param_hint="NAME") from error
            _write_and_wait(ctx, path, old, new, wait_s)
        token = live.JoinTokens(ctx.redis, ctx.keys, ctx.settings.join_token_ttl_s).issue(
            name, entry["token"], expires_s
        )
        ttl = expires_s or ctx.settings.join_token_ttl_s
        console.print(
            f"machine [bold]{name}[/] added ({backend}, {entry['memory_bytes']} bytes, families "
            f"{', '.join(chosen)}). On the new host, within {ttl:.0f} s (single use):"
        )
        _join_command(ctx, server_url, token)
    finally:
        ctx.close()


@machines_cli.command("rotate-token")
def rotate_token(
    name: Annotated[str, typer.Argument(help="the machine (a host's entry name)")],
    server_url: Annotated[str | None, typer.Option(help="the server's URL as the host reaches it")] = None,
    expires_s: Annotated[float | None, typer.Option(help="the join token's lifetime, seconds", min=1)] = None,
    wait_s: Annotated[float, typer.Option(help="how long to wait for the running server to reload")] = RELOAD_WAIT_S,
) -> None:
    """Give machine NAME a new token (the old one is refused once the server reloaded) and
    print a new join command: on the host, stop the worker and run it; the worker joins again and
    writes the new token to its token file. A job running there is interrupted at once (reason
    ``token_rotated``): its worker can report nothing more, and stops at its next call to the
    server (exit 78); queued jobs stay queued for the worker started with the new token."""
    import secrets

    from app.context import build_checked_context
    from app.core.states import JobState
    from app.fleet import live

    ctx = build_checked_context(server_settings())
    try:
        path = _fleet_file(ctx)
        token = secrets.token_urlsafe(32)

        def change(entries: list) -> None:
            for entry in entries:
                if entry.get("name") == name:
                    entry["token"] = token

        with live.editing(path):
            old = path.read_text()
            hosts = live.parse(old, path).hosts()
            require_machine(name, hosts, f"the fleet file {path}")
            _write_and_wait(ctx, path, old, live.edit(old, change), wait_s)
        running = [
            job.id
            for machine in hosts[name]
            for job in ctx.journal.list(states=[JobState.running], machine=machine.name)
        ]
        for job_id in running:  # its worker's reports are refused from now on: nothing of it can arrive
            try:
                ctx.endings.interrupt(
                    job_id,
                    [JobState.running],
                    reason="token_rotated",
                    message=f"machine {name}'s token was rotated while the job ran (`homefleet machines "
                    f"rotate-token`): its worker can report nothing of it; requeue it if you want it (`homefleet jobs "
                    f"requeue {job_id}`, R19)",
                    announce=True,
                )
            except Conflict:
                continue  # it ended meanwhile
            console.print(f"job {job_id}: interrupted (token_rotated)")
        joins = live.JoinTokens(ctx.redis, ctx.keys, ctx.settings.join_token_ttl_s)
        if hosts[name][0].device is None:
            console.print(
                f"machine [bold]{name}[/] has a new token. On its host, stop the worker, then run this in the folder "
                "it joined in, or add --models-dir with its models folder (the join writes the new token beside it; "
                "elsewhere the worker starts on an empty models folder) (single use):"
            )
            _join_command(ctx, server_url, joins.issue(name, token, expires_s))
            return
        # a host's devices (docs/operations.md, "Several devices on one host"): one worker each, each its own
        # machine, model folder and worker folder; the host's entry name is no machine a worker could run as
        console.print(
            f"host [bold]{name}[/] has a new token. On its host, stop its devices' workers, then run one join per "
            "device (each single use, each in its own folder):"
        )
        for index, machine in enumerate(hosts[name]):
            folder = f"homefleet-worker-{machine.name.replace(':', '-')}/models"
            join = joins.issue(machine.name, token, expires_s)
            _join_command(ctx, server_url, join, models_dir=folder, warn=index == len(hosts[name]) - 1)
    finally:
        ctx.close()


@machines_cli.command("remove")
def remove(
    name: Annotated[str, typer.Argument(help="the machine (a host's entry name: all its devices)")],
    force: Annotated[
        bool,
        typer.Option(
            "--force", help="cancel its queued jobs and interrupt its running ones instead of waiting for them"
        ),
    ] = False,
    wait: Annotated[bool, typer.Option(help="wait until its jobs are done; --no-wait refuses while it has any")] = True,
    timeout_s: Annotated[float, typer.Option(help="how long to wait for its jobs, seconds", min=0)] = 3600.0,
    wait_s: Annotated[float, typer.Option(help="how long to wait for the running server to reload")] = RELOAD_WAIT_S,
) -> None:
    """Drain machine NAME (nothing new is placed on it), wait until its queued and running jobs
    are done (or with --force end them), then remove it from the fleet file and the running
    server. Exit 1 when jobs are still there; exit 2 when the server refuses."""
    from app.context import build_checked_context
    from app.core.states import JobState
    from app.fleet import live
    from routing.placement import SERVER

    ctx = build_checked_context(server_settings())
    try:
        path = _fleet_file(ctx)
        old = path.read_text()
        hosts = live.parse(old, path).hosts()
        require_machine(name, hosts, f"the fleet file {path}")
        if name == SERVER:
            raise typer.BadParameter("the server's own machine stays in the fleet (R9)", param_hint="NAME")
        members = [m.name for m in hosts[name]]
        ctx.drains.drain(members)

        def backlog() -> int:
            return sum(ctx.machines.view(machine).backlog for machine in members)

        if force:
            jobs = [
                job
                for machine in members
                for job in ctx.journal.list(states=[JobState.queued, JobState.running], machine=machine)
            ]
            for job in jobs:
                if job.state == JobState.queued:
                    ctx.dispatcher.cancel(job.id, reason="machine_removed", message=f"machine {name} was removed")
                else:
                    ctx.endings.interrupt(
                        job.id,
                        [JobState.running],
                        reason="machine_removed",
                        message=f"machine {name} was removed",
                        announce=True,
                    )
        deadline = time.monotonic() + (timeout_s if wait else 0)
        left = backlog()
        if left:
            console.print(f"{name}: draining; {left} jobs queued or running")
        while left and time.monotonic() < deadline:
            time.sleep(1)
            left = backlog()
        if left:
            console.print(
                f"{name}: {left} jobs queued or running; it stays drained, not removed "
                "(wait longer, or --force ends them)"
            )
            raise typer.Exit(1)

        def change(entries: list) -> None:
            for index in reversed(range(len(entries))):
                if entries[index].get("name") == name:
                    del entries[index]

        with live.editing(path):
            old = path.read_text()
            _write_and_wait(ctx, path, old, live.edit(old, change), wait_s)
        ctx.drains.undo(members)
        console.print(f"machine [bold]{name}[/] removed; stop its worker (it is refused from now on)")
    finally:
        ctx.close()


@machines_cli.command("list")
def list_machines() -> None:
    """The fleet file's machines: backend, memory, families, whether its worker is online, and
    its state (draining, syncing)."""
    from app.context import build_checked_context

    ctx = build_checked_context(server_settings())
    try:
        from app.fleet import live

        path = _fleet_file(ctx)
        fleet = live.parse(path.read_text(), path)
        rows = {row["name"]: row for row in ctx.status()}
        table = Table("machine", "backend", "memory GB", "families", "online", "state")
        for name, machine in fleet.machines.items():
            row = rows.get(name)
            table.add_row(
                name,
                str(machine.backend),
                f"{machine.memory_bytes / 1e9:.1f}",
                escape(", ".join(sorted(machine.families))),
                "-" if row is None else ("yes" if row["online"] else "no"),
                "not loaded" if row is None else row["state"],
            )
        print_table(table)
    finally:
        ctx.close()
