"""Running a fleet on this host: ``homefleet demo``, ``drill``, ``fuzz``, ``bench``."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from app.cli.common import console, errors, print_table, server_settings
from app.cli.listening import refuse_taken_port
from app.core.errors import ConfigError

dev_cli = typer.Typer()  # its commands are added to the top level (app/cli/main.py)


@dev_cli.command()
def drill(
    name: Annotated[
        str,
        typer.Argument(
            help="duplicate | worker_kill | server_kill | redis_restart | redis_loss_requeue | redis_loss_backlogs | "
            "visibility | hang | sentinel_failover | standby_server"
        ),
    ],
    count: Annotated[int, typer.Option(min=1, help="jobs in the drill")] = 200,
    work_dir: Annotated[Path, typer.Option(help="where the drill's private fleet lives")] = Path("var/drills"),
) -> None:
    """Run a fault drill on a private local fleet; the last line gives its figures."""
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
    with DrillFleet(run_dir, tiny, **FLEET_OPTIONS.get(name, {})) as fleet:
        result = DRILLS[name](fleet, count)
    console.print(f"wall_s={time.monotonic() - started:.1f} logs and journal: {run_dir}")
    print(result.line())
    # figures with a target of 0: a 500, a 503 without Retry-After, a replaced worker, a key that made two jobs,
    # a webhook received twice or never
    zero = ("errors_500", "no_retry_after", "worker_restarts", "duplicates", "webhooks_twice", "webhooks_missing")
    missed = any(result.figures.get(figure, 0) for figure in zero)
    disordered = result.figures.get("order_kept", 1) < result.figures.get("backlogs", 0)  # R8 on every backlog
    if result.double_runs or result.lost or missed or disordered:
        raise typer.Exit(1)


@dev_cli.command()
def fuzz(
    examples: Annotated[int, typer.Option(min=1, help="schemathesis' --max-examples (per operation and phase)")] = 6,
    work_dir: Annotated[Path, typer.Option(help="where the run's private fleet lives")] = Path("var/fuzz"),
    min_cases: Annotated[int, typer.Option(min=0, help="fail when fewer cases ran")] = 0,
    workers: Annotated[int, typer.Option(min=1, help="schemathesis' concurrent requests (--workers)")] = 1,
    wait_s: Annotated[int, typer.Option(min=1, help="each image or text request's Prefer: wait (seconds)")] = 5,
) -> None:
    """Fuzz the public API over real HTTP with schemathesis, all checks and its stateful phase,
    against a private server and worker with a verified tiny model; the last line
    gives the figures. Exit 1 on any failure, a 5xx other than a documented 503, an accepted
    job that did not end, fewer than ``--min-cases`` cases, a route of the document that got none,
    or a runtime error of schemathesis' own that is not known-benign (app/devtools/fuzz.py,
    ``BENIGN_RUNTIME_ERRORS``; each is printed)."""
    import shutil
    import tempfile

    from app.devtools.fuzz import run_fuzz

    logging.basicConfig(level=logging.WARNING)
    work_dir.mkdir(parents=True, exist_ok=True)
    run_dir = Path(tempfile.mkdtemp(prefix="fuzz-", dir=work_dir))
    started = time.monotonic()
    report = run_fuzz(run_dir, examples, wait_s=wait_s, workers=workers)
    print(report.output[-6000:])
    print("cases per route:")
    print("\n".join(report.route_lines()))
    print(f"wall_s={time.monotonic() - started:.0f}")
    for error in report.runtime_errors:
        known = "known-benign" if error not in report.unknown_runtime_errors else "NOT known-benign"
        print(f"schemathesis runtime error ({known}): {error}")
    print(report.summary())
    if (
        report.failures
        or report.server_errors
        or report.unended
        or report.cases < min_cases
        or not report.sound
        or len(report.routes) < report.operations
    ):
        console.print(f"logs and journal: {run_dir}")
        raise typer.Exit(1)
    shutil.rmtree(run_dir, ignore_errors=True)


@dev_cli.command()
def bench(
    url: Annotated[str | None, typer.Option(help="the API to measure; default: http://HOMEFLEET_API_HOST:PORT")] = None,
    api_key: Annotated[
        str | None,
        typer.Option(envvar="HOMEFLEET_API_KEY", help="bearer key; default: the first of HOMEFLEET_API_KEYS"),
    ] = None,
    model: Annotated[str, typer.Option(help="registered txt2img model")] = "tiny-sd",
    concurrency: Annotated[str, typer.Option(help="comma-separated concurrency levels")] = "1,2,4",
    jobs: Annotated[int, typer.Option(min=1, help="jobs per level")] = 8,
    steps: Annotated[int, typer.Option(min=1, help="denoising steps per job")] = 2,
    target: Annotated[str, typer.Option(help="machine name or 'auto'")] = "auto",
    local: Annotated[
        bool, typer.Option(help="start a private local fleet (Redis, API, workers m1 and m2) to measure")
    ] = False,
    work_dir: Annotated[Path, typer.Option(help="where --local keeps its fleet")] = Path("var/bench"),
) -> None:
    """Concurrency sweep of submissions: queue time and run time per machine, and rejections.
    Exit 2 when the server does not answer at the start, 1 when it stopped answering mid-run."""
    import httpx

    from app.client import HomefleetClient
    from app.devtools.bench import UNREACHABLE, sweep

    try:
        levels = [int(part) for part in concurrency.split(",") if part.strip()]
    except ValueError as error:
        raise typer.BadParameter(
            f"{concurrency!r}: comma-separated whole numbers, e.g. 1,2,4", param_hint="--concurrency"
        ) from error
    if not levels or min(levels) < 1:
        raise typer.BadParameter(f"{concurrency!r}: each level at least 1", param_hint="--concurrency")
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
        settings = server_settings()
        key = api_key or (settings.api_keys[0] if settings.api_keys else None)
        where = url or f"http://{settings.api_host}:{settings.api_port}"
        with HomefleetClient(where, api_key=key) as client:
            try:
                client.http.get("/health")  # any answer will do (503 until a worker is online)
            except httpx.HTTPError as error:
                raise ConfigError(
                    f"the API at {where} does not answer ({error}); start `homefleet serve` or give --url",
                    reason=UNREACHABLE,
                ) from error
            reports = sweep(client, model, levels, jobs, params, target)
    table = Table("concurrency", "machine", "jobs", "queue p50 s", "queue p95 s", "run p50 s", "run p95 s")

    def cell(value: float | None) -> str:
        return "-" if value is None else f"{value:.3f}"

    for report in reports:
        for row in report.rows():
            table.add_row(
                str(row["concurrency"]),
                row["machine"],
                str(row["jobs"]),
                cell(row["queue_p50_s"]),
                cell(row["queue_p95_s"]),
                cell(row["run_p50_s"]),
                cell(row["run_p95_s"]),
            )
    print_table(table)
    for report in reports:
        for row in report.rows():
            print(" ".join(f"{k}={cell(v) if isinstance(v, float) or v is None else v}" for k, v in row.items()))
        refused = ", ".join(f"{reason}={n}" for reason, n in sorted(report.rejections.items())) or "none"
        ended = ", ".join(f"{state}={n}" for state, n in sorted(report.ended.items())) or "none"
        print(f"concurrency={report.concurrency} wall_s={report.wall_s:.2f} ended: {ended}; rejections: {refused}")
    if any(report.rejections[UNREACHABLE] for report in reports):
        errors.print(f"[red]error[/] ({UNREACHABLE}): the server stopped answering during the run")
        raise typer.Exit(1)


@dev_cli.command()
def demo(
    data_dir: Annotated[Path, typer.Option(help="where the demo keeps its journal, models and results")] = Path(
        "var/demo"
    ),
) -> None:
    """The fleet on this machine: three machines, real tiny pipelines, real PNG results. Runs
    its own Redis unless HOMEFLEET_REDIS_URL names one (then that one, if it answers); its API
    listens on HOMEFLEET_API_PORT when set, else on a free port."""
    from app.devtools.demo import run_demo

    logging.basicConfig(level=logging.WARNING)
    settings = server_settings()
    api_port = settings.api_port if "api_port" in settings.model_fields_set else None
    if api_port is not None:  # refused before anything is built or started
        refuse_taken_port(settings.api_host, api_port)
    raise typer.Exit(
        run_demo(
            data_dir,
            settings.redis_url if "redis_url" in settings.model_fields_set else None,
            console,
            api_port=api_port,
        )
    )
