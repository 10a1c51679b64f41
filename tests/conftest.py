"""Shared fixtures: a private real Redis, the tiny real models, settings and a server context.

Nothing is mocked: Redis is a real redis-server on a free port (no persistence), the
journal a real SQLite file, the models real diffusers folders built by the CLI.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from app.core.config import Settings
from app.context import ServerContext, build_context
from app.fleet.config import Fleet, Machine
from app.devtools.redis_server import start_redis_server

TEST_API_KEY = "test-api-key-0123456789"
FAMILIES = frozenset({"sd1", "sd1-pix2pix", "sd-upscale", "animatediff"})


def make_fleet(*names: str) -> Fleet:
    """A fleet of CPU machines with distinct 32-character tokens; ``server`` is always in it."""
    machines = {}
    for name in ("server", *names):
        machines[name] = Machine(
            name=name, backend="cpu", memory_kind="unified", memory_bytes=4_000_000_000,
            families=FAMILIES, token=f"token-{name}-".ljust(32, "x"),
        )
    return Fleet(machines=machines)


def run_cli(*args: str, env: dict[str, str] | None = None, timeout_s: float = 180) -> subprocess.CompletedProcess[str]:
    """Run ``homefleet ARGS`` as a user would; raise with its output if it fails."""
    full_env = {**os.environ, **(env or {})}
    done = subprocess.run([sys.executable, "-m", "app.cli", *args], env=full_env, capture_output=True, text=True,
                          timeout=timeout_s)
    if done.returncode != 0:
        raise AssertionError(f"homefleet {' '.join(args)} exited {done.returncode}:\n{done.stdout}\n{done.stderr}")
    return done


def settings_env(settings: Settings) -> dict[str, str]:
    """``HOMEFLEET_*`` variables that give a CLI subprocess the same server settings."""
    env = {"HOMEFLEET_DATA_DIR": str(settings.data_dir), "HOMEFLEET_REDIS_URL": settings.redis_url}
    if settings.database_url:
        env["HOMEFLEET_DATABASE_URL"] = settings.database_url
    if settings.fleet_file:
        env["HOMEFLEET_FLEET_FILE"] = str(settings.fleet_file)
    return env


@pytest.fixture(scope="session")
def redis_base_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A private redis-server for the whole test session; yields ``redis://127.0.0.1:PORT``."""
    server = start_redis_server(tmp_path_factory.mktemp("redis"))
    try:
        yield server.url.rsplit("/", 1)[0]
    finally:
        server.stop()


@pytest.fixture(scope="session")
def tiny_models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny real pipelines of every kind, built once per session by ``homefleet models make-tiny``."""
    out = tmp_path_factory.mktemp("tiny")
    run_cli("models", "make-tiny", str(out), "--kind", "txt2img", "--kind", "edit", "--kind", "upscale",
            "--kind", "video")
    return out


@pytest.fixture
def redis_url(redis_base_url: str) -> str:
    """Database 1 of the session's Redis, flushed for this test."""
    url = f"{redis_base_url}/1"
    client = redis.Redis.from_url(url)
    client.flushdb()
    client.close()
    return url


POSTGRES_ADMIN_URL = os.environ.get("HOMEFLEET_TEST_POSTGRES", "postgresql://postgres@127.0.0.1:5432/postgres")


@pytest.fixture(params=["sqlite", "postgresql"])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str | None]:
    """The journal's database: a SQLite file (None: the default), or a fresh PostgreSQL
    database on the local server (``HOMEFLEET_TEST_POSTGRES`` names its admin URL)."""
    if request.param == "sqlite":
        yield None
        return
    import psycopg

    name = f"hf_test_{uuid.uuid4().hex[:12]}"
    try:
        admin = psycopg.connect(POSTGRES_ADMIN_URL, autocommit=True, connect_timeout=3)
    except psycopg.OperationalError as error:
        pytest.skip(f"PostgreSQL is not reachable at {POSTGRES_ADMIN_URL}: {error}")
    with admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    yield POSTGRES_ADMIN_URL.replace("postgresql://", "postgresql+psycopg://").rsplit("/", 1)[0] + f"/{name}"
    with psycopg.connect(POSTGRES_ADMIN_URL, autocommit=True) as admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def settings(tmp_path: Path, redis_url: str, database_url: str | None) -> Settings:
    return Settings(data_dir=tmp_path / "server", redis_url=redis_url, database_url=database_url,
                    fleet_lock_ttl_s=5, fleet_lock_wait_s=5, api_keys=[TEST_API_KEY])


@pytest.fixture
def ctx(settings: Settings) -> Iterator[ServerContext]:
    context = build_context(settings, make_fleet("m1", "m2"))
    try:
        yield context
    finally:
        context.close()
