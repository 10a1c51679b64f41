"""``homefleet``: the server's and workers' command line (typer + rich)."""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import re
import signal
import sys
from collections.abc import Mapping
from pathlib import Path
from types import FrameType
from typing import Annotated, get_origin

import typer
from pydantic import ValidationError
from pydantic_settings import SettingsError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from rich.markup import escape

from app.cli.common import configure_console, console, errors, server_settings
from app.cli.db import db_cli
from app.cli.dev import dev_cli
from app.cli.fleet import fleet_cli
from app.cli.jobs import jobs_cli
from app.cli.keys import keys_cli
from app.cli.listening import refuse_taken_port
from app.cli.machines import machines_cli
from app.cli.models import models_cli
from app.cli.residency import oom_cli, residency_cli
from app.cli.serve_lock import holding_data_dir
from app.cli.timings import timings_cli
from app.core.config import BrokerSettings, Settings, WorkerSettings, unknown_variables
from app.core.connections import redacted_url
from app.core.errors import ConfigError, HomefleetError
from app.core.limits import DEFAULT_FAMILY, default_limits
from app.core.quiet import quiet_import_warnings
from app.core.secret_files import require_private
from app.fleet.config import load_fleet

cli = typer.Typer(
    help="Homefleet: image and video generation on a small fleet of mixed machines.",
    no_args_is_help=True,
    rich_markup_mode="markdown",
)
cli.add_typer(models_cli, name="models")
cli.add_typer(db_cli, name="db")
cli.add_typer(machines_cli, name="machines")
cli.add_typer(residency_cli, name="residency")
cli.add_typer(oom_cli, name="oom")
cli.add_typer(timings_cli, name="timings")
cli.add_typer(jobs_cli, name="jobs")
for group in (fleet_cli, keys_cli, dev_cli):  # their commands sit at the top level: homefleet status, homefleet keys…
    cli.registered_commands += group.registered_commands


class CutAtShutdown(logging.Filter):
    """uvicorn ends its graceful shutdown (``api_shutdown_grace_s``) by cancelling the requests
    still running, an image call waiting for its job, and logs each as "Exception in ASGI
    application" with a ``CancelledError`` traceback, which reads as a crash. Such a record
    becomes one warning line: the call was cut, its jobs run on, and a client's resend of it gets
    them (C10). Any other record passes as it is."""

    def filter(self, record: logging.LogRecord) -> bool:
        import asyncio  # loaded by uvicorn already

        if record.exc_info is not None and isinstance(record.exc_info[1], asyncio.CancelledError):
            record.msg = (
                "a request still running when the shutdown's grace ran out was cut; its jobs run on, and a "
                "client's resend of the call gets them"
            )
            record.args, record.exc_info, record.exc_text = (), None, None
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


@cli.command()
def serve() -> None:
    """Run the HTTP API (public + internal routes) on HOMEFLEET_API_HOST:HOMEFLEET_API_PORT."""
    import uvicorn
    from uvicorn.config import STARTUP_FAILURE

    from app.api.auth import check_api_keys
    from app.api.server import create_app
    from app.context import build_context

    settings = server_settings()
    if settings.fleet_file is not None:  # it holds every machine's token: its owner's eyes only
        require_private(settings.fleet_file, "the fleet file")
    fleet = load_fleet(settings.fleet_file)
    try:  # workers authenticate with their machine's token: a server whose machines have none serves no one
        fleet.require_tokens()
    except ValueError as error:
        raise ConfigError(
            f"the fleet file {settings.fleet_file or '(embedded default)'}: {error}; "
            'give each machine `token = "..."` (docs/operations.md, "The fleet file")'
        ) from error
    try:  # a limit for a misspelt family would apply to nothing (R22); the built-in entries are not misspelt
        fleet.check_family_names(settings.limits, "HOMEFLEET_LIMITS", also=[DEFAULT_FAMILY, *default_limits()])
    except ValueError as error:
        raise ConfigError(f"{error} (the fleet file: {settings.fleet_file or '(embedded default)'})") from error
    # refused before anything is made: the data folder, its lock, the journal, Redis's pairing
    check_api_keys(settings)
    refuse_taken_port(settings.api_host, settings.api_port)
    # one server per data folder, held until this process ends (app/cli/serve_lock.py): a second
    # one is refused before it touches the journal; standby servers share the folder
    with holding_data_dir(settings.data_dir, shared=settings.leader_election):
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
        app = create_app(settings, ctx)
        logging.getLogger("uvicorn.error").addFilter(CutAtShutdown())
        gc.freeze()  # what start-up made is never garbage: collections scan only what requests make
        config = uvicorn.Config(
            app,
            host=settings.api_host,
            port=settings.api_port,
            log_level="info",
            access_log=False,
            timeout_graceful_shutdown=settings.api_shutdown_grace_s,  # calls still running are cut; then it stops
        )
        waiting = ctx.waiting

        class Server(uvicorn.Server):
            def handle_exit(self, sig: int, frame: FrameType | None) -> None:
                # calls waiting for their jobs answer 503 server_stopping now, resendable, instead
                # of being cut when the grace runs out (app/jobs/waiting.py stop_waiters)
                waiting.stop_waiters()
                super().handle_exit(sig, frame)

        server = Server(config)
        with contextlib.suppress(KeyboardInterrupt):  # as uvicorn.run: Ctrl-C is a stop
            server.run()
        if not server.started:  # as uvicorn.run: the socket could not be bound, or the app not started
            sys.exit(STARTUP_FAILURE)


worker_cli = typer.Typer(
    help="Run this host's worker (`homefleet worker --machine ...`), or join the fleet "
    "(`homefleet worker join SERVER_URL JOIN_TOKEN`)."
)
cli.add_typer(worker_cli, name="worker")


@worker_cli.callback(invoke_without_command=True)
def worker(
    context: typer.Context,
    machine: Annotated[
        str | None,
        typer.Option(
            help="machine name (HOMEFLEET_MACHINE); a device of a multi-device host is HOST:INDEX, e.g. box:1, "
            "which binds CUDA_VISIBLE_DEVICES=1"
        ),
    ] = None,
    models_dir: Annotated[Path | None, typer.Option(help="this machine's model folder (HOMEFLEET_MODELS_DIR)")] = None,
    token_file: Annotated[
        Path | None,
        typer.Option(
            help="a file holding this machine's token (HOMEFLEET_WORKER_TOKEN_FILE); or set HOMEFLEET_WORKER_TOKEN",
        ),
    ] = None,
    token: Annotated[
        str | None,
        typer.Option(
            help="deprecated: `ps` shows it to every user of the host; use --token-file or HOMEFLEET_WORKER_TOKEN"
        ),
    ] = None,
    server_url: Annotated[
        str | None,
        typer.Option(help="the server's URL, or every standby server's, comma-separated (HOMEFLEET_SERVER_URL)"),
    ] = None,
    env_file: Annotated[
        Path | None,
        typer.Option(
            help="a worker.env written by `homefleet worker join`: start that worker again (the environment's "
            "HOMEFLEET_* and this command's options win over it)"
        ),
    ] = None,
    loglevel: str = "INFO",
    print_systemd_unit: Annotated[
        bool,
        typer.Option(
            "--print-systemd-unit",
            help="print a systemd unit that runs this worker and restarts it when it exits "
            "(needs --token-file); start nothing",
        ),
    ] = False,
    print_launchd_plist: Annotated[
        bool,
        typer.Option(
            "--print-launchd-plist",
            help="print a launchd plist (a Mac) that runs this worker and restarts it when it "
            "exits (needs --token-file); start nothing",
        ),
    ] = False,
) -> None:
    """Run the Celery worker of one machine: queue machine.<name>, prefork, concurrency 1. Its
    token comes from HOMEFLEET_WORKER_TOKEN or a file (--token-file), never the command line.
    One worker per device: on a host with devices, one per --machine box:N (with the host's token).
    A new host joins first: ``homefleet worker join SERVER_URL JOIN_TOKEN`` (docs/operations.md,
    "Add a machine")."""
    if context.invoked_subcommand is not None:
        return
    from tasks.worker import start_worker

    if token is not None:
        print(
            "warning: --token is deprecated: the command line is visible to every user of this host (ps); "
            "use --token-file FILE or HOMEFLEET_WORKER_TOKEN",
            file=sys.stderr,
        )
    overrides = {
        k: v
        for k, v in {
            "machine": machine,
            "models_dir": models_dir,
            "worker_token": token,
            "worker_token_file": token_file,
            "server_url": server_url,
        }.items()
        if v is not None
    }
    require_env_file(env_file)
    settings = WorkerSettings(_env_file=env_file, **overrides)  # type: ignore[arg-type]
    if settings.worker_token_file is not None:
        require_private(settings.worker_token_file, "the token file")
    if print_systemd_unit or print_launchd_plist:
        print_supervisor_file(settings, launchd=print_launchd_plist)
        return
    logging.basicConfig(level=loglevel, format=f"%(asctime)s {settings.machine} %(levelname)s %(name)s: %(message)s")
    start_worker(settings, loglevel)


@worker_cli.command("join")
def worker_join(
    server_url: Annotated[str, typer.Argument(help="the server's URL, as `homefleet machines add` printed it")],
    join_token: Annotated[
        str | None,
        typer.Argument(
            help="the join token `homefleet machines add` printed (single use, expiring); '-' or absent: read from "
            "stdin"
        ),
    ] = None,
    join_token_file: Annotated[Path | None, typer.Option(help="read the join token from this file instead")] = None,
    models_dir: Annotated[
        Path,
        typer.Option(
            help="this machine's model folder; its parent is the worker's folder, where the machine's token file "
            "(worker-token, mode 0600) and worker.env are written"
        ),
    ] = Path("homefleet-worker/models"),
    loglevel: str = "INFO",
    print_systemd_unit: Annotated[
        bool,
        typer.Option(
            "--print-systemd-unit", help="after joining, print the systemd unit that runs this worker; start nothing"
        ),
    ] = False,
    print_launchd_plist: Annotated[
        bool,
        typer.Option(
            "--print-launchd-plist", help="after joining, print the launchd plist that runs this worker; start nothing"
        ),
    ] = False,
) -> None:
    """Join the fleet from a new host, then run its worker: detect this host's device (refused
    when it is not the one registered), trade the join token for the machine's name, token and
    broker settings, write the token to a 0600 file in the worker's folder, start the worker.
    Only the single-use, short-lived join token may be on the command line (``ps`` shows it);
    the machine's token never is."""
    from tasks import join as joining
    from tasks.worker import start_worker

    token = joining.read_join_token(join_token, join_token_file)
    device = joining.probe_apart()
    # with a supervisor file asked for, stdout is that file only (`... > unit.service`): the rest to stderr
    say = errors if print_systemd_unit or print_launchd_plist else console
    say.print(f"this host: {device.backend} ({device.memory_bytes / 1e9:.1f} GB), torch {device.torch or '-'}")
    grant = joining.request_grant(server_url, token, device)
    joining.check_device(grant, device)
    token_file, values = joining.save_grant(grant, server_url, models_dir)
    env_file = token_file.parent / joining.ENV_FILE
    from app.core.tls import ca_environment

    # the CA this join trusted the server by is no worker setting: the restart's command line names it
    trusted = "".join(f"{name}={path} " for name, path in ca_environment(os.environ).items())
    say.print(
        f"joined as machine [bold]{grant.machine}[/]; its token is in {token_file} (mode 0600), its "
        f"settings in {env_file}; to start this worker again (after a reboot): "
        f"`{trusted}homefleet worker --env-file {env_file}`, or keep it running with a supervisor: add "
        "--print-systemd-unit (a Mac: --print-launchd-plist)",
        soft_wrap=True,
        highlight=False,
    )
    settings = WorkerSettings(**values)
    if print_systemd_unit or print_launchd_plist:
        print_supervisor_file(settings, launchd=print_launchd_plist)
        return
    logging.basicConfig(level=loglevel, format=f"%(asctime)s {settings.machine} %(levelname)s %(name)s: %(message)s")
    start_worker(settings, loglevel)


JOINED_ENV_FILE = Path("homefleet-worker/worker.env")
"""Where ``homefleet worker join`` (its default ``--models-dir``) writes the worker's settings,
relative to the folder it ran in."""


def joined_env_file(env_file: Path | None) -> Path | None:
    """``env_file`` as given, else :data:`JOINED_ENV_FILE` when it is there (the folder a
    ``worker join`` ran in), said on stderr; else None."""
    if env_file is None and JOINED_ENV_FILE.is_file():
        errors.print(f"settings: {JOINED_ENV_FILE} (written by `homefleet worker join`; --env-file names another)")
        return JOINED_ENV_FILE
    return env_file


def require_env_file(env_file: Path | None) -> None:
    """Raises ConfigError (``invalid_settings``) when ``env_file`` is given and is no file."""
    if env_file is not None and not env_file.is_file():
        raise ConfigError(
            f"{env_file} is not a file: `homefleet worker join` writes worker.env in the worker's folder, "
            "the parent of its --models-dir",
            reason="invalid_settings",
        )


@cli.command()
def doctor(
    env_file: Annotated[
        Path | None,
        typer.Option(
            help="a worker.env written by `homefleet worker join` (default: homefleet-worker/worker.env here, "
            "when there; HOMEFLEET_* of the environment win over it)"
        ),
    ] = None,
    token_file: Annotated[
        Path | None,
        typer.Option(help="the token file the worker is started with (`homefleet worker --token-file`)"),
    ] = None,
) -> None:
    """One screen on this host: torch's version and device (CUDA, MPS or CPU, and its memory),
    whether the server and the broker answer, the token file and its mode, and what is missing.
    Exit 1 when something is missing."""
    from tasks import join as joining

    env_file = joined_env_file(env_file)
    require_env_file(env_file)
    values = joining.read_env_file(env_file) if env_file is not None else {}
    values.update({key: value for key, value in os.environ.items() if key.startswith("HOMEFLEET_")})
    if token_file is not None:  # as `worker --token-file` sets it (a token in the environment too is refused)
        values["HOMEFLEET_WORKER_TOKEN_FILE"] = str(token_file)
    lines, missing = joining.doctor(values)
    width = max((len(what) for what, _ in lines), default=0)
    for what, finding in lines:  # one line each, never cut: a path or URL is copied from here
        console.print(f"[bold]{what:<{width}}[/]  {escape(finding)}", soft_wrap=True)
    if missing:
        console.print("[red]missing:[/]")
        for item in missing:
            console.print(f"  - {escape(item)}", soft_wrap=True)
        raise typer.Exit(1)
    console.print("[green]nothing missing[/]")


def print_supervisor_file(settings: WorkerSettings, launchd: bool) -> None:
    """Print the systemd unit (or launchd plist) that runs and restarts this worker
    (app/cli/supervision.py): its machine, models folder and token file as absolute paths, the
    server's and Redis' URLs in its environment (and ``SSL_CERT_FILE``/``SSL_CERT_DIR`` where set
    here: the CA this process trusts the server by), this interpreter.

    Raises:
        ConfigError: the token is not in a file (a supervisor file never holds the token).
    """
    from app.cli import supervision
    from app.core.tls import ca_environment

    if settings.worker_token_file is None:
        raise ConfigError(
            "--print-systemd-unit and --print-launchd-plist need --token-file (or "
            "HOMEFLEET_WORKER_TOKEN_FILE): a supervisor file names the token's file, never the token"
        )
    argv = supervision.worker_argv(
        sys.executable,
        settings.machine,
        settings.models_dir.expanduser().resolve(),
        settings.worker_token_file.expanduser().resolve(),
    )
    environment = {"HOMEFLEET_SERVER_URL": settings.server_url, "HOMEFLEET_REDIS_URL": settings.redis_url}
    environment |= ca_environment(os.environ)  # the CA certificates this process trusts the server by (TLS)
    for name, field in BrokerSettings.model_fields.items():  # what the fleet shares, where it is not the default
        if name != "redis_url" and getattr(settings, name) != field.default:
            environment[f"HOMEFLEET_{name.upper()}"] = str(getattr(settings, name))
    if "@" in settings.redis_url.split("//", 1)[-1].split("/", 1)[0]:
        print(
            "warning: the printed file holds HOMEFLEET_REDIS_URL with its password: make it readable by its "
            "owner only (chmod 600)",
            file=sys.stderr,
        )
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
    token_file: Annotated[
        Path | None,
        typer.Option(
            help="a file holding this machine's token (HOMEFLEET_WORKER_TOKEN_FILE); or set HOMEFLEET_WORKER_TOKEN"
        ),
    ] = None,
    server_url: Annotated[
        str | None,
        typer.Option(help="the server's URL, or every standby server's, comma-separated (HOMEFLEET_SERVER_URL)"),
    ] = None,
    env_file: Annotated[
        Path | None,
        typer.Option(
            help="a worker.env written by `homefleet worker join` (default: homefleet-worker/worker.env here, "
            "when there; the environment's HOMEFLEET_* and this command's options win over it)"
        ),
    ] = None,
) -> None:
    """On a worker's host: upload the results its spool kept because the server could not store
    them (jobs failed ``result_not_stored``) or could not be reached to take them; each one the
    server takes makes its job ``succeeded``. A running worker does the same every
    ``HOMEFLEET_RESULT_RECOVER_INTERVAL_S``. Exit 1 if any stays in the spool."""
    from tasks.spool import recover_spool

    env_file = joined_env_file(env_file)
    require_env_file(env_file)

    overrides = {
        k: v
        for k, v in {
            "machine": machine,
            "models_dir": models_dir,
            "worker_token_file": token_file,
            "server_url": server_url,
        }.items()
        if v is not None
    }
    outcomes = recover_spool(WorkerSettings(_env_file=env_file, **overrides))  # type: ignore[arg-type]
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
        field = match.group(1) if match else ""
        variable = f"HOMEFLEET_{field.upper()}" if match else "a HOMEFLEET_* variable"
        shapes = [m.model_fields[field].annotation for m in (Settings, WorkerSettings) if field in m.model_fields]
        table = any(get_origin(shape) in (dict, Mapping) for shape in shapes)  # a table's example for a table
        example = '{"key1": {...}}' if table else '["key1", "key2"]'
        return f"{variable} could not be parsed: lists and tables are JSON (e.g. '{example}')"
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
        errors.print(f"[red]error[/] ({error.reason}): {escape(error.message)}")  # "[x]" in a message is text
        sys.exit(2)
    except (ValidationError, SettingsError) as error:  # HOMEFLEET_* variables or the fleet file's entries
        said = "; ".join([settings_problem(error), *getattr(error, "__notes__", ())])  # notes: app/context.py
        errors.print(f"[red]error[/] (invalid_settings): {escape(said)}", highlight=False)
        sys.exit(2)
    except (RedisConnectionError, RedisTimeoutError) as error:
        errors.print(
            f"[red]error[/] (redis_down): Redis does not answer ({escape(str(error))}); start it or set "
            "HOMEFLEET_REDIS_URL"
        )
        sys.exit(2)
    except Exception as error:  # the journal or a folder the settings name: one line, not a traceback
        found = unusable(error)
        if found is None:
            raise
        errors.print(f"[red]error[/] ({found[0]}): {escape(found[1])}", highlight=False)
        sys.exit(2)


def unusable(error: BaseException) -> tuple[str, str] | None:
    """(reason, message) for an error of the journal's database or of a file the settings name,
    which no command catches itself: a URL SQLAlchemy cannot parse or has no driver for
    (``invalid_settings``), a database that does not answer or cannot be opened
    (``journal_down``), a folder that cannot be created or used (``path_unusable``); None for
    any other error (a bug: its traceback is shown)."""
    exc = sys.modules.get("sqlalchemy.exc")  # not imported: the error cannot be SQLAlchemy's
    if exc is not None and isinstance(error, exc.SQLAlchemyError):
        try:
            url = redacted_url(server_settings().journal_url)
        except (ValidationError, SettingsError):
            url = "HOMEFLEET_DATABASE_URL"
        cause = str(getattr(error, "orig", None) or error).strip().splitlines()[0]
        if isinstance(error, exc.ArgumentError):
            return "invalid_settings", f"HOMEFLEET_DATABASE_URL {url!r} cannot be used: {cause}"
        if isinstance(error, exc.DBAPIError):
            return "journal_down", (
                f"the journal's database {url} does not answer or cannot be opened ({cause}); start it or "
                "set HOMEFLEET_DATABASE_URL (or HOMEFLEET_DATA_DIR for the default SQLite file)"
            )
        return None
    if isinstance(error, OSError) and error.filename is not None:
        message = f"{error.filename} cannot be used: {error.strerror or error}"
        try:
            data_dir = server_settings().data_dir
        except (ValidationError, SettingsError):
            return "path_unusable", message
        inside = Path(os.fsdecode(error.filename)).is_relative_to(data_dir)  # the folder or a file of it
        return "path_unusable", message + (" (check HOMEFLEET_DATA_DIR)" if inside else "")
    return None


if __name__ == "__main__":
    main()
