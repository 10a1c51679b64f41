"""A fleet command run without ``HOMEFLEET_FLEET_FILE`` beside a server that runs a fleet file
(a new shell without the README's export): it is refused naming the file, not run against the
embedded default fleet, whose machines the server does not have (``residency set box2`` on a
fleet without box2 said "box2: keeps tiny-sd resident"). A server without a fleet file records
that it runs the embedded fleet, and such commands run. The real ASGI app (its lifespan: the
fleet-file watch) on a real Redis and journal, then ``homefleet`` as a user runs it."""

from __future__ import annotations

from fastapi.testclient import TestClient

from app.api.server import create_app
from app.context import build_context
from app.core.config import Settings
from app.core.keys import Keys
from app.core.secret_files import write_private
from app.fleet import live
from tests.helpers import make_fleet, run_cli, settings_env, wait_for


def serve_once(settings: Settings) -> None:
    """Start the server's app (its lifespan records the fleet it runs) and stop it."""
    fleet = make_fleet("box1") if settings.fleet_file else make_fleet()
    ctx = build_context(settings, fleet, migrate=True)
    ctx.redis.delete(ctx.keys.fleet_loaded())
    with TestClient(create_app(settings, ctx)):
        wait_for(
            lambda: live.loaded_report(ctx.redis, Keys(settings.key_prefix)) is not None,
            timeout_s=30,
            what="the server to record the fleet it runs",
        )


def test_a_fleet_command_without_the_servers_fleet_file_is_refused_naming_it(settings: Settings) -> None:
    fleet_file = settings.data_dir / "fleet.toml"
    write_private(fleet_file, make_fleet("box1").to_toml())
    served = settings.model_copy(update={"fleet_file": fleet_file})
    serve_once(served)
    without = {**settings_env(served), "HOMEFLEET_FLEET_FILE": None}
    for args in (("residency", "set", "box2", "tiny-sd"), ("drain", "box2", "--no-wait"), ("status",)):
        done = run_cli(*args, env=without, check=False)
        assert done.returncode == 2, (args, done.stdout, done.stderr)
        line = done.stderr.strip()
        assert line.startswith("error (fleet_file_not_set): HOMEFLEET_FLEET_FILE is not set, but the server"), line
        assert f"set HOMEFLEET_FLEET_FILE={fleet_file.resolve()}" in line and len(line.splitlines()) == 1, line
    status = run_cli("status", env=settings_env(served))  # with it, as the README exports it
    assert "box1" in status.stdout and "box2" not in status.stdout, status.stdout


def test_beside_a_server_of_the_embedded_fleet_a_command_without_a_fleet_file_runs(settings: Settings) -> None:
    fleet_file = settings.data_dir / "fleet.toml"
    write_private(fleet_file, make_fleet("box1").to_toml())
    serve_once(settings.model_copy(update={"fleet_file": fleet_file}))  # an earlier server ran a file...
    serve_once(settings)  # ...the one after it runs the embedded fleet: its record replaces the first
    ctx = build_context(settings, make_fleet())
    try:
        report = live.loaded_report(ctx.redis, Keys(settings.key_prefix))
    finally:
        ctx.close()
    assert report is not None and report["state"] == "embedded"
    done = run_cli("status", env={**settings_env(settings), "HOMEFLEET_FLEET_FILE": None}, check=False)
    assert done.returncode == 0, done.stderr
