"""``homefleet``: the server's and workers' command line (typer + rich)."""

from __future__ import annotations

import logging
import os
import re
import signal
import sys
from pathlib import Path
from typing import Annotated

import typer
from pydantic import ValidationError
from pydantic_settings import SettingsError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from rich.markup import escape

from app.cli.common import configure_console, console, server_settings
from app.cli.db import db_cli
from app.cli.dev import dev_cli
from app.cli.fleet import fleet_cli
from app.cli.keys import keys_cli
from app.cli.models import models_cli
from app.cli.residency import oom_cli, residency_cli
from app.core.config import WorkerSettings, unknown_variables
from app.core.errors import ConfigError, HomefleetError
from app.core.limits import DEFAULT_FAMILY, default_limits
from app.core.quiet import quiet_import_warnings
from app.core.secret_files import require_private
from app.fleet.config import load_fleet

cli = typer.Typer(help="Homefleet: image and video generation on a small fleet of mixed machines.", no_args_is_help=True)
cli.add_typer(models_cli, name="models")
cli.add_typer(db_cli, name="db")
cli.add_typer(residency_cli, name="residency")
cli.add_typer(oom_cli, name="oom")
for group in (fleet_cli, keys_cli, dev_cli):  # their commands sit at the top level: homefleet status, homefleet keys…
    cli.registered_commands += group.registered_commands


@cli.command()
def serve() -> None:
    """Run the HTTP API (public + internal routes) on HOMEFLEET_API_HOST:HOMEFLEET_API_PORT."""
    import uvicorn

    from app.api.server import create_app
    from app.context import build_context

    settings = server_settings()
    if settings.fleet_file is not None:  # it holds every machine's token: its owner's eyes only
        require_private(settings.fleet_file, "the fleet file")
    fleet = load_fleet(settings.fleet_file)
    try:  # workers authenticate with their machine's token: a server whose machines have none serves no one
        fleet.require_tokens()
    except ValueError as error:
        raise ConfigError(f"the fleet file {settings.fleet_file or '(embedded default)'}: {error}; "
                          "give each machine `token = \"...\"` (docs/operations.md, \"The fleet file\")") from error
    try:  # a limit for a misspelt family would apply to nothing (R22); the built-in entries are not misspelt
        fleet.check_family_names(settings.limits, "HOMEFLEET_LIMITS", also=[DEFAULT_FAMILY, *default_limits()])
    except ValueError as error:
        raise ConfigError(f"{error} (the fleet file: {settings.fleet_file or '(embedded default)'})") from error
    ctx = build_context(settings, fleet, migrate=True)  # the server migrates its journal (and `db upgrade`)
    try:  # a server beside another journal's Redis would judge jobs it never saw (app/fleet/pairing.py)
        ctx.pairing.check()
    except (RedisConnectionError, RedisTimeoutError):
        pass  # checked again by every reconciliation pass, once Redis answers
    except ConfigError:
        ctx.close()
        raise
    logging.basicConfig(level=logging.INFO, format="%(asctime)s api %(levelname)s %(name)s: %(message)s")
    # info: uvicorn's own startup lines, ending with "Uvicorn running on http://HOST:PORT"; no
    # access log (one line per request, workers' claims and heartbeats included).
    uvicorn.run(create_app(settings, ctx), host=settings.api_host, port=settings.api_port, log_level="info",
                access_log=False)


@cli.command()
def worker(
    machine: Annotated[str | None, typer.Option(
        help="machine name (HOMEFLEET_MACHINE); a device of a multi-device host is <host>:<index>, e.g. box:1, "
             "which binds CUDA_VISIBLE_DEVICES=1")] = None,
    models_dir: Annotated[Path | None, typer.Option(help="this machine's model folder (HOMEFLEET_MODELS_DIR)")] = None,
    token_file: Annotated[Path | None, typer.Option(
        help="a file holding this machine's token (HOMEFLEET_WORKER_TOKEN_FILE); or set HOMEFLEET_WORKER_TOKEN")] = None,
    token: Annotated[str | None, typer.Option(
        help="deprecated: `ps` shows it to every user of the host; use --token-file or HOMEFLEET_WORKER_TOKEN")] = None,
    server_url: Annotated[str | None, typer.Option(help="the server's URL (HOMEFLEET_SERVER_URL)")] = None,
    loglevel: str = "INFO",
    print_systemd_unit: Annotated[bool, typer.Option(
        "--print-systemd-unit", help="print a systemd unit that runs this worker and restarts it when it exits "
                                     "(needs --token-file); start nothing")] = False,
    print_launchd_plist: Annotated[bool, typer.Option(
        "--print-launchd-plist", help="print a launchd plist (a Mac) that runs this worker and restarts it when it "
                                      "exits (needs --token-file); start nothing")] = False,
) -> None:
    """Run the Celery worker of one machine: queue machine.<name>, prefork, concurrency 1. Its
    token comes from HOMEFLEET_WORKER_TOKEN or a file (--token-file), never the command line.
    One worker per device: on a host with devices, one per --machine box:N (with the host's token)."""
    from tasks.worker import start_worker

    if token is not None:
        print("warning: --token is deprecated: the command line is visible to every user of this host (ps); "
              "use --token-file FILE or HOMEFLEET_WORKER_TOKEN", file=sys.stderr)
    overrides = {k: v for k, v in {"machine": machine, "models_dir": models_dir, "worker_token": token,
                                   "worker_token_file": token_file, "server_url": server_url}.items()
                 if v is not None}
    settings = WorkerSettings(**overrides)  # type: ignore[arg-type]
    if settings.worker_token_file is not None:
        require_private(settings.worker_token_file, "the token file")
    if print_systemd_unit or print_launchd_plist:
        print_supervisor_file(settings, launchd=print_launchd_plist)
        return
    logging.basicConfig(level=loglevel, format=f"%(asctime)s {settings.machine} %(levelname)s %(name)s: %(message)s")
    start_worker(settings, loglevel)


def print_supervisor_file(settings: WorkerSettings, launchd: bool) -> None:
    """Print the systemd unit (or launchd plist) that runs and restarts this worker
    (app/cli/supervision.py): its machine, models folder and token file as absolute paths, the
    server's and Redis' URLs in its environment, this interpreter.

    Raises:
        ConfigError: the token is not in a file (a supervisor file never holds the token).
    """
    from app.cli import supervision

    if settings.worker_token_file is None:
        raise ConfigError("--print-systemd-unit and --print-launchd-plist need --token-file (or "
                          "HOMEFLEET_WORKER_TOKEN_FILE): a supervisor file names the token's file, never the token")
    argv = supervision.worker_argv(sys.executable, settings.machine, settings.models_dir.expanduser().resolve(),
                                   settings.worker_token_file.expanduser().resolve())
    environment = {"HOMEFLEET_SERVER_URL": settings.server_url, "HOMEFLEET_REDIS_URL": settings.redis_url}
    if "@" in settings.redis_url.split("//", 1)[-1].split("/", 1)[0]:
        print("warning: the printed file holds HOMEFLEET_REDIS_URL with its password: make it readable by its "
              "owner only (chmod 600)", file=sys.stderr)
    if launchd:
        log_file = Path.home() / "Library" / "Logs" / f"homefleet-worker-{settings.machine.replace(':', '-')}.log"
        sys.stdout.write(supervision.launchd_plist(argv, environment, settings.machine, Path.cwd(), log_file))
    else:
        sys.stdout.write(supervision.systemd_unit(argv, environment, settings.machine, Path.cwd()))


results_cli = typer.Typer(help="A worker's results the server could not store.")
cli.add_typer(results_cli, name="results")


@results_cli.command("recover")
def results_recover(
    machine: Annotated[str | None, typer.Option(help="machine name (HOMEFLEET_MACHINE)")] = None,
    models_dir: Annotated[Path | None, typer.Option(help="this machine's model folder (HOMEFLEET_MODELS_DIR)")] = None,
    token_file: Annotated[Path | None, typer.Option(
        help="a file holding this machine's token (HOMEFLEET_WORKER_TOKEN_FILE); or set HOMEFLEET_WORKER_TOKEN")] = None,
    server_url: Annotated[str | None, typer.Option(help="the server's URL (HOMEFLEET_SERVER_URL)")] = None,
) -> None:
    """On a worker's host: upload the results its spool kept because the server could not store
    them (jobs failed ``result_not_stored``); each one the server takes makes its job
    ``succeeded``. Exit 1 if any stays in the spool."""
    from tasks.spool import recover_spool

    overrides = {k: v for k, v in {"machine": machine, "models_dir": models_dir, "worker_token_file": token_file,
                                   "server_url": server_url}.items() if v is not None}
    outcomes = recover_spool(WorkerSettings(**overrides))  # type: ignore[arg-type]
    for job_id, outcome in outcomes:
        console.print(f"{job_id}: {escape(outcome)}")
    kept = sum(1 for _, outcome in outcomes if outcome.startswith("kept"))
    console.print(f"{len(outcomes)} spooled results: {len(outcomes) - kept} brought in or refused, {kept} kept")
    raise typer.Exit(1 if kept else 0)


def settings_problem(error: ValidationError | SettingsError) -> str:
    """One line naming what is wrong: the ``HOMEFLEET_*`` variable (or the fleet file's entry),
    the field path and pydantic's message, without its documentation links."""
    if isinstance(error, SettingsError):
        match = re.search(r'field "(\w+)"', str(error))
        variable = f"HOMEFLEET_{match.group(1).upper()}" if match else "a HOMEFLEET_* variable"
        return f"{variable} could not be parsed: lists and tables are JSON (e.g. '[\"key1\", \"key2\"]')"
    problems = []
    for detail in error.errors(include_url=False):
        path = [str(part) for part in detail["loc"]]
        if error.title in ("Settings", "WorkerSettings") and path:
            path[0] = f"HOMEFLEET_{path[0].upper()}"
        where = ".".join(path)
        if error.title == "Fleet":
            where = f"the fleet file {where}" if where else "the fleet file"
        message = detail["msg"].removeprefix("Value error, ")  # pydantic's prefix for a validator's ValueError
        problems.append(f"{where}: {message}" if where else message)  # a model-wide check names its variables itself
    return "; ".join(problems)


def main() -> None:
    # SIGTERM ends a command like Ctrl-C does: as an exception, so the fleets that `demo`,
    # `drill` and `bench --local` start are stopped by their context managers. (`serve` and
    # `worker` install their own handlers: uvicorn's and Celery's.)
    signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))
    quiet_import_warnings()  # before any command imports torch (make-tiny, worker, drill, bench --local)
    configure_console()
    for line in unknown_variables(os.environ):
        print(f"warning: {line}", file=sys.stderr)
    try:
        cli()
    except HomefleetError as error:
        console.print(f"[red]error[/] ({error.reason}): {escape(error.message)}")  # "[x]" in a message is text
        sys.exit(2)
    except (ValidationError, SettingsError) as error:  # HOMEFLEET_* variables or the fleet file's entries
        console.print(f"[red]error[/] (invalid_settings): {escape(settings_problem(error))}", highlight=False)
        sys.exit(2)
    except (RedisConnectionError, RedisTimeoutError) as error:
        console.print(f"[red]error[/] (redis_down): Redis does not answer ({escape(str(error))}); start it or set "
                      "HOMEFLEET_REDIS_URL")
        sys.exit(2)


if __name__ == "__main__":
    main()
