"""``homefleet``: the server's and workers' command line (typer + rich)."""

from __future__ import annotations

import logging
import os
import re
import signal
import sys
import time
from pathlib import Path
from typing import Annotated

import typer
from pydantic import ValidationError
from pydantic_settings import SettingsError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from app.core.config import Settings, WorkerSettings, unknown_variables
from app.core.errors import ConfigError, HomefleetError
from app.fleet.config import load_fleet
from app.core.limits import DEFAULT_FAMILY
from app.cli.residency import oom_cli, residency_cli
from tasks.pipelines import quiet_import_warnings

cli = typer.Typer(help="Homefleet: image and video generation on a small fleet of mixed machines.", no_args_is_help=True)
models_cli = typer.Typer(help="The model registry (server side).", no_args_is_help=True)
cli.add_typer(models_cli, name="models")
db_cli = typer.Typer(help="The journal's database schema (Alembic migrations).", no_args_is_help=True)
cli.add_typer(db_cli, name="db")
cli.add_typer(residency_cli, name="residency")
cli.add_typer(oom_cli, name="oom")
# Piped (no terminal, no COLUMNS): 200 columns, so tables are not cut at rich's default of 80.
console = Console(width=None if sys.stdout.isatty() or "COLUMNS" in os.environ else 200)


def _settings() -> Settings:
    return Settings()


@cli.command()
def serve() -> None:
    """Run the HTTP API (public + internal routes) on HOMEFLEET_API_HOST:HOMEFLEET_API_PORT."""
    import uvicorn

    from app.context import build_context
    from app.fleet.pairing import check_pairing
    from app.api.server import create_app

    settings = _settings()
    fleet = load_fleet(settings.fleet_file)
    try:  # workers authenticate with their machine's token: a server whose machines have none serves no one
        fleet.require_tokens()
    except ValueError as error:
        raise ConfigError(f"the fleet file {settings.fleet_file or '(embedded default)'}: {error}; "
                          "give each machine `token = \"...\"` (README, \"The fleet config\")") from error
    try:  # a limit for a misspelt family would apply to nothing (R22)
        fleet.check_family_names(settings.limits, "HOMEFLEET_LIMITS", also=[DEFAULT_FAMILY])
    except ValueError as error:
        raise ConfigError(f"{error} (the fleet file: {settings.fleet_file or '(embedded default)'})") from error
    ctx = build_context(settings, fleet)
    try:  # a server beside another journal's Redis would judge jobs it never saw (app/fleet/pairing.py)
        check_pairing(ctx)
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
    machine: Annotated[str | None, typer.Option(help="machine name (HOMEFLEET_MACHINE)")] = None,
    models_dir: Annotated[Path | None, typer.Option(help="this machine's model folder (HOMEFLEET_MODELS_DIR)")] = None,
    token: Annotated[str | None, typer.Option(help="this machine's token (HOMEFLEET_WORKER_TOKEN)")] = None,
    server_url: Annotated[str | None, typer.Option(help="the server's URL (HOMEFLEET_SERVER_URL)")] = None,
    loglevel: str = "INFO",
) -> None:
    """Run the Celery worker of one machine: queue machine.<name>, prefork, concurrency 1."""
    from tasks.worker import start_worker

    overrides = {k: v for k, v in {"machine": machine, "models_dir": models_dir, "worker_token": token,
                                   "server_url": server_url}.items() if v is not None}
    settings = WorkerSettings(**overrides)  # type: ignore[arg-type]
    logging.basicConfig(level=loglevel, format=f"%(asctime)s {settings.machine} %(levelname)s %(name)s: %(message)s")
    start_worker(settings, loglevel)


@models_cli.command("make-tiny")
def models_make_tiny(
    directory: Annotated[Path, typer.Argument(help="where to build the tiny pipelines")],
    kind: Annotated[list[str] | None, typer.Option(help="kinds to build (repeatable); default txt2img")] = None,
    seed: int = 0,
) -> None:
    """Build tiny diffusers pipelines with random weights (never downloads anything)."""
    from app.devtools.tiny_models import make_tiny

    built = make_tiny(directory, kinds=tuple(kind or ["txt2img"]), seed=seed)
    for name, folder in built.items():
        console.print(f"{name}: {folder}")


@models_cli.command("add")
def models_add(
    path: Annotated[Path, typer.Argument(help="a diffusers folder (with model_index.json)")],
    model_id: Annotated[str | None, typer.Option("--id", help="model id; minted from the folder name if absent")] = None,
    precision: Annotated[str, typer.Option(help="fp32 | bf16 | fp16: dtype workers load it with")] = "fp32",
    quantization: Annotated[str | None, typer.Option(help="load-time quantization of the denoiser, e.g. torchao-int8wo")] = None,
) -> None:
    """Register a diffusers folder: mint its id, copy it to the server's model folder, hash every file."""
    from app.context import build_checked_context

    ctx = build_checked_context(_settings())
    try:
        record = ctx.registry.add(path, model_id, precision=precision, quantization=quantization)
        manifest = ctx.registry.manifest(record.id)
    finally:
        ctx.close()
    console.print(f"registered [bold]{record.id}[/] family={record.family} kinds={','.join(record.kinds)} "
                  f"files={len(manifest.files)} bytes={record.total_bytes} variant={record.variant.key()}")


@models_cli.command("list")
def models_list() -> None:
    """Registered models with their family, kinds and size."""
    from app.context import build_checked_context

    ctx = build_checked_context(_settings())
    try:
        table = Table("id", "family", "kinds", "bytes", "pipeline")
        for m in ctx.registry.list():
            table.add_row(m.id, m.family, ",".join(m.kinds), str(m.total_bytes), m.pipeline_class)
        console.print(table)
    finally:
        ctx.close()


@models_cli.command("verify")
def models_verify(
    model: Annotated[list[str] | None, typer.Argument(help="model ids; default: every registered model")] = None,
) -> None:
    """Rehash every file of the server's models in full, ignoring the (size, mtime, inode)
    cache; record changed digests. Exit 1 if any file changed or is missing (R5, C07)."""
    from app.context import build_checked_context

    ctx = build_checked_context(_settings())
    try:
        checks = ctx.registry.verify(model or None)
    finally:
        ctx.close()
    table = Table("model", "file", "status", "digest")
    for check in checks:
        colour = {"ok": "green", "changed": "yellow", "missing": "red"}[check.status]
        detail = check.actual if check.status == "ok" else f"{check.recorded} -> {check.actual or 'missing'}"
        table.add_row(check.model_id, check.path, f"[{colour}]{check.status}[/]", detail)
    console.print(table)
    bad = [c for c in checks if c.status != "ok"]
    console.print(f"{len(checks)} files rehashed, {len(bad)} changed or missing")
    raise typer.Exit(1 if bad else 0)


@cli.command()
def sync(
    machine: Annotated[str, typer.Argument(help="the machine to copy to")],
    model: Annotated[list[str] | None, typer.Argument(help="model ids; default: every model it supports")] = None,
    wait: Annotated[bool, typer.Option(help="follow the copy with a progress bar until it ends")] = True,
) -> None:
    """Copy model files from the server to MACHINE (R6): the worker pulls, verifies, renames.
    Refused (exit 2) while the machine has work queued or running. Exit 1 if the sync fails."""
    import time

    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

    from app.context import build_checked_context
    from app.jobs.sync import ENDED, Syncs

    ctx = build_checked_context(_settings())
    try:
        syncs = Syncs(ctx.settings, ctx.redis, ctx.celery, ctx.fleet, ctx.journal, ctx.registry, ctx.machines)
        record = syncs.start(machine, model or [])
        console.print(f"sync {record['id']} to [bold]{machine}[/]: {record['files_total']} files, "
                      f"{record['bytes_total']} bytes of {', '.join(record['models']) or 'no models'}")
        if not wait:
            return
        columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                   TimeRemainingColumn())
        with Progress(*columns, console=console) as progress:
            bar = progress.add_task(machine, total=max(record["bytes_total"], 1))
            while record["state"] not in ENDED:
                time.sleep(0.2)
                record = syncs.get(record["id"])
                progress.update(bar, completed=record["bytes_done"],
                                description=f"{machine} {record['files_done']}/{record['files_total']} {record['file']}")
    finally:
        ctx.close()
    for result in record["results"]:
        if result["status"] not in ("present", "copied"):
            console.print(f"[red]{result['status']}[/] {result['model_id']}/{result['path']}: {result['message']}")
    colour = "green" if record["state"] == "succeeded" else "red"
    console.print(f"sync {record['id']} [{colour}]{record['state']}[/]; {machine} verifies: "
                  f"{', '.join(record['verified']) or 'none'}" + (f"; {record['message']}" if record["message"] else ""))
    raise typer.Exit(0 if record["state"] == "succeeded" else 1)


@db_cli.command("upgrade")
def db_upgrade() -> None:
    """Create or migrate the journal's schema to the newest revision (HOMEFLEET_DATABASE_URL)."""
    from alembic.runtime.migration import MigrationContext

    from app.core.connections import create_engine

    engine = create_engine(_settings())  # applies every migration
    with engine.connect() as connection:
        console.print(f"{engine.url.render_as_string(hide_password=True)} at revision "
                      f"{MigrationContext.configure(connection).get_current_revision()}")
    engine.dispose()


@db_cli.command("pair")
def db_pair() -> None:
    """Make HOMEFLEET_REDIS_URL run with this journal (HOMEFLEET_DATA_DIR / HOMEFLEET_DATABASE_URL),
    replacing the journal it ran with: once, after replacing the journal on purpose. The next
    reconciliation releases the reservations of jobs this journal does not know."""
    from app.core.connections import create_engine, create_redis, redacted_url
    from app.core.keys import Keys
    from app.fleet.pairing import pair

    settings = _settings()
    engine, client = create_engine(settings), create_redis(settings)
    try:
        previous, mine = pair(client, Keys(settings.key_prefix), engine, settings.data_dir)
    finally:
        client.close()
        engine.dispose()
    console.print(f"{redacted_url(settings.redis_url)} runs with journal {mine} "
                  f"({engine.url.render_as_string(hide_password=True)})"
                  + (f"; it ran with {previous}" if previous and previous != mine else ""), highlight=False)


@cli.command()
def status() -> None:
    """Machines: online, state (draining, syncing: nothing new is placed there), verified and
    warm models, backlog (LLEN of machine.<name> + running) and expected drain time (seconds,
    from learned timings)."""
    from app.context import build_checked_context
    from app.fleet.status import fleet_status

    ctx = build_checked_context(_settings())  # running counts come from the journal: the server's
    try:
        table = Table("machine", "online", "state", "verified models", "warm models", "backlog", "drain_s")
        for row in fleet_status(ctx):
            table.add_row(row["name"], "yes" if row["online"] else "no", row["state"],
                          ", ".join(row["verified_models"]) or "-",
                          ", ".join(row["warm_models"]) or "-", str(row["backlog"]), f"{row['drain_s']:.1f}")
        console.print(table)
    finally:
        ctx.close()


@cli.command()
def flower(
    port: int = 5555,
    address: str = "127.0.0.1",
    basic_auth: Annotated[str | None, typer.Option(help="user:password for the dashboard and API")] = None,
) -> None:
    """Run Flower against the fleet's broker (workers must run with -E, which `homefleet worker` does)."""
    import os

    argv = [sys.executable, "-m", "celery", "-A", "app.celery", "flower", f"--port={port}", f"--address={address}"]
    if basic_auth:
        argv.append(f"--basic-auth={basic_auth}")
    os.execv(sys.executable, argv)


@cli.command()
def drain(
    machine: Annotated[str, typer.Argument(help="the machine to drain")],
    undo: Annotated[bool, typer.Option("--undo", help="resume placing jobs on it")] = False,
    wait: Annotated[bool, typer.Option(help="wait until its backlog is empty")] = True,
    timeout_s: Annotated[float, typer.Option(help="how long to wait, seconds")] = 3600.0,
) -> None:
    """Stop placing new jobs on MACHINE (pinned jobs get 503 machine_draining, Auto skips it),
    then wait with a progress bar until its queued and running jobs are done."""
    from rich.progress import Progress

    from app.context import build_checked_context

    ctx = build_checked_context(_settings())
    try:
        if machine not in ctx.fleet.machines:
            raise typer.BadParameter(f"{machine!r} is not a machine of this fleet", param_hint="MACHINE")
        if undo:
            ctx.redis.delete(ctx.keys.draining(machine))
            console.print(f"{machine}: placing jobs again")
            return
        ctx.redis.set(ctx.keys.draining(machine), "1")
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


@cli.command()
def reconcile() -> None:
    """One reconciliation pass now (the API also runs one at start and periodically, R19)."""
    from app.context import build_checked_context
    from app.jobs.reconcile import Reconciler

    ctx = build_checked_context(_settings())
    try:
        console.print(str(Reconciler(ctx, server=False).run_once()))
    finally:
        ctx.close()


@cli.command()
def drill(
    name: Annotated[str, typer.Argument(help="duplicate | worker_kill | server_kill | redis_restart | visibility | hang")],
    count: Annotated[int, typer.Option(min=1, help="jobs in the drill")] = 200,
    work_dir: Annotated[Path, typer.Option(help="where the drill's private fleet lives")] = Path("var/drills"),
) -> None:
    """Run a fault drill on a private local fleet; the last line gives its figures (issue 5)."""
    import tempfile

    from app.devtools.drills import DRILLS, FLEET_OPTIONS, DrillFleet
    from app.devtools.tiny_models import make_tiny

    if name not in DRILLS:
        raise typer.BadParameter(f"unknown drill {name!r}; drills: {', '.join(DRILLS)}", param_hint="NAME")
    logging.basicConfig(level=logging.WARNING)
    work_dir.mkdir(parents=True, exist_ok=True)
    tiny = make_tiny(work_dir / "tiny", kinds=("txt2img",))["txt2img"]
    run_dir = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=work_dir))
    started = time.monotonic()
    with DrillFleet(run_dir, tiny, **FLEET_OPTIONS.get(name, {})) as fleet:  # type: ignore[arg-type]
        result = DRILLS[name](fleet, count)
    console.print(f"wall_s={time.monotonic() - started:.1f} logs and journal: {run_dir}")
    print(result.line())
    if result.double_runs or result.lost:
        raise typer.Exit(1)


@cli.command()
def bench(
    url: Annotated[str | None, typer.Option(help="the API to measure; default: http://HOMEFLEET_API_HOST:PORT")] = None,
    api_key: Annotated[str | None, typer.Option(envvar="HOMEFLEET_API_KEY", help="bearer key; default: the first of HOMEFLEET_API_KEYS")] = None,
    model: Annotated[str, typer.Option(help="registered txt2img model")] = "tiny-sd",
    concurrency: Annotated[str, typer.Option(help="comma-separated concurrency levels")] = "1,2,4",
    jobs: Annotated[int, typer.Option(min=1, help="jobs per level")] = 8,
    steps: Annotated[int, typer.Option(min=1, help="denoising steps per job")] = 2,
    target: Annotated[str, typer.Option(help="machine name or 'auto'")] = "auto",
    local: Annotated[bool, typer.Option(help="start a private local fleet (Redis, API, workers m1 and m2) to measure")] = False,
    work_dir: Annotated[Path, typer.Option(help="where --local keeps its fleet")] = Path("var/bench"),
) -> None:
    """Concurrency sweep of submissions: queue time and run time per machine, and rejections."""
    from app.devtools.bench import sweep
    from app.client import HomefleetClient

    levels = [int(part) for part in concurrency.split(",") if part.strip()]
    params = {"prompt": "a benchmark lighthouse", "steps": steps}
    logging.basicConfig(level=logging.WARNING)
    if local:
        import tempfile

        from app.devtools.drills import MODEL, DrillFleet
        from app.devtools.tiny_models import make_tiny

        work_dir.mkdir(parents=True, exist_ok=True)
        tiny = make_tiny(work_dir / "tiny", kinds=("txt2img",))["txt2img"]
        with DrillFleet(Path(tempfile.mkdtemp(prefix="bench-", dir=work_dir)), tiny) as fleet:
            assert fleet.client is not None
            reports = sweep(fleet.client, MODEL, levels, jobs, params, target)
    else:
        settings = _settings()
        key = api_key or (settings.api_keys[0] if settings.api_keys else None)
        with HomefleetClient(url or f"http://{settings.api_host}:{settings.api_port}", api_key=key) as client:
            reports = sweep(client, model, levels, jobs, params, target)
    table = Table("concurrency", "machine", "jobs", "queue p50 s", "queue p95 s", "run p50 s", "run p95 s")

    def cell(value: float | None) -> str:
        return "-" if value is None else f"{value:.3f}"

    for report in reports:
        for row in report.rows():
            table.add_row(str(row["concurrency"]), row["machine"], str(row["jobs"]), cell(row["queue_p50_s"]),
                          cell(row["queue_p95_s"]), cell(row["run_p50_s"]), cell(row["run_p95_s"]))
    console.print(table)
    for report in reports:
        for row in report.rows():
            print(" ".join(f"{k}={cell(v) if isinstance(v, float) or v is None else v}" for k, v in row.items()))
        refused = ", ".join(f"{reason}={n}" for reason, n in sorted(report.rejections.items())) or "none"
        ended = ", ".join(f"{state}={n}" for state, n in sorted(report.ended.items())) or "none"
        print(f"concurrency={report.concurrency} wall_s={report.wall_s:.2f} ended: {ended}; rejections: {refused}")


@cli.command()
def demo(
    data_dir: Annotated[Path, typer.Option(help="where the demo keeps its journal, models and results")] = Path("var/demo"),
) -> None:
    """The fleet on this machine: three machines, real tiny pipelines, real PNG results. Runs
    its own Redis unless HOMEFLEET_REDIS_URL names one (then that one, if it answers)."""
    from app.devtools.demo import run_demo

    logging.basicConfig(level=logging.WARNING)
    settings = _settings()
    raise typer.Exit(run_demo(data_dir, settings.redis_url if "redis_url" in settings.model_fields_set else None,
                              console))


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
        problems.append(f"{where}: {message}")
    return "; ".join(problems)


def main() -> None:
    # SIGTERM ends a command like Ctrl-C does: as an exception, so the fleets that `demo`,
    # `drill` and `bench --local` start are stopped by their context managers. (`serve` and
    # `worker` install their own handlers: uvicorn's and Celery's.)
    signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))
    quiet_import_warnings()  # before any command imports torch (make-tiny, worker, drill, bench --local)
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
