"""Shared fixtures: a private real Redis, the tiny real models, settings and a server context.

Nothing is mocked: Redis is a real redis-server on a free port (no persistence), the journal
a real SQLite file (and a real PostgreSQL database for the tests that are about SQL: the
``sql_settings`` fixture), the models real diffusers folders. Helpers: ``tests/helpers.py``.

Tiers (``tests/<tier>/`` mirrors the source tree inside each):
- ``unit``: in-process, pure; no subprocess, no Redis, no model on disk;
- ``integration``: real Redis and journal, the API in-process (FastAPI's TestClient);
- ``cli``: ``homefleet`` commands as subprocesses;
- ``e2e``, ``drills``, ``netns``, ``fuzz``: real ``celery worker`` processes and the API.
"""

from __future__ import annotations

import gc
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from app.context import ServerContext, build_context
from app.core.config import Settings
from app.devtools.redis_server import start_redis_server
from tests.helpers import TEST_API_KEY, make_fleet, resume_all

POSTGRES_ADMIN_URL = os.environ.get("HOMEFLEET_TEST_POSTGRES", "postgresql://postgres@127.0.0.1:5432/postgres")
TINY_KINDS = ("txt2img", "edit", "upscale", "video")


def pytest_configure(config: pytest.Config) -> None:
    """Under xdist, each worker's pipelines get its share of the host's cores: torch threads
    ``cores // workers`` (at least 1), for the pipelines it runs in-process and, through
    ``HOMEFLEET_TORCH_THREADS`` (unless set already), for its fleets' workers
    (``LocalFleet.torch_threads``). ``make test`` runs five workers on two cores: at torch's
    default of a thread per core, each pool process's two threads waited on each other at
    every operation while the other lanes held the cores, and a 4-step 64x64 job took 0.3-0.5
    CPU-s where one thread takes 0.2 (docs/benchmarks.md, "The test suite")."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers < 1:
        return
    share = max(1, (os.cpu_count() or 1) // workers)
    os.environ.setdefault("HOMEFLEET_TORCH_THREADS", str(share))
    import torch

    torch.set_num_threads(int(os.environ["HOMEFLEET_TORCH_THREADS"]))


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
    """The tiny real pipelines of every kind (``tiny-sd``, ``tiny-pix2pix``, ``tiny-upscaler``,
    ``tiny-animatediff``), built once per session, in-process, as ``homefleet models make-tiny`` builds them."""
    from app.devtools.tiny_models import make_tiny

    out = tmp_path_factory.mktemp("tiny")
    make_tiny(out, kinds=TINY_KINDS)
    return out


@pytest.fixture(scope="session")
def tiny_text_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny random-weight causal LMs (``tiny-llama``, ``tiny-qwen2``, ``tiny-gpt2``), built
    once per session as ``homefleet models make-tiny DIR --kind text`` builds them (~2 s)."""
    from app.devtools.tiny_text import TEXT_FAMILIES, make_tiny_text

    out = tmp_path_factory.mktemp("tiny-text")
    make_tiny_text(out, families=TEXT_FAMILIES)
    return out


@pytest.fixture(scope="session")
def tiny_families_dir(tiny_models_dir: Path) -> Path:
    """:func:`tiny_models_dir` with a tiny pipeline of every family the registry accepts
    (``tiny-sdxl``, ``tiny-flux``, ``tiny-qwen-image-edit``, ``tiny-wan`` added; the
    folder names in ``app.devtools.tiny_models.TINY_MODELS``), built once per session (~10 s)."""
    from app.devtools.tiny_models import TINY_MODELS, make_tiny_families

    make_tiny_families(tiny_models_dir, families=tuple(TINY_MODELS.values()))
    return tiny_models_dir


@pytest.fixture
def redis_url(redis_base_url: str) -> str:
    """Database 1 of the session's Redis, flushed for this test."""
    url = f"{redis_base_url}/1"
    client = redis.Redis.from_url(url)
    client.flushdb()
    client.close()
    return url


def _settings(tmp_path: Path, redis_url: str, database_url: str | None) -> Settings:
    return Settings(
        data_dir=tmp_path / "server",
        redis_url=redis_url,
        database_url=database_url,
        fleet_lock_ttl_s=5,
        fleet_lock_wait_s=5,
        api_keys=[TEST_API_KEY],
    )


@pytest.fixture
def settings(tmp_path: Path, redis_url: str) -> Settings:
    """Server settings with a SQLite journal in ``tmp_path``."""
    return _settings(tmp_path, redis_url, None)


@pytest.fixture(params=["sqlite", "postgresql"])
def database_url(request: pytest.FixtureRequest) -> Iterator[str | None]:
    """The journal's database, for tests that are about SQL: a SQLite file (None: the default),
    or a fresh PostgreSQL database on the local server (``HOMEFLEET_TEST_POSTGRES`` names its
    admin URL)."""
    if request.param == "sqlite":
        yield None
        return
    yield from fresh_postgres_database("hf_test")


def fresh_postgres_database(prefix: str) -> Iterator[str]:
    """Yield the SQLAlchemy URL of a new database ``<prefix>_<random>`` on the local PostgreSQL
    server, dropped afterwards; skip the test when the server does not answer."""
    import psycopg

    name = f"{prefix}_{uuid.uuid4().hex[:12]}"
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
def sql_settings(tmp_path: Path, redis_url: str, database_url: str | None) -> Settings:
    """Server settings whose journal is SQLite, then PostgreSQL (the test runs once with each)."""
    return _settings(tmp_path, redis_url, database_url)


@pytest.fixture
def ctx(settings: Settings) -> Iterator[ServerContext]:
    """The server's parts over ``settings`` and a fleet of server, m1 and m2 (journal migrated)."""
    context = build_context(settings, make_fleet("m1", "m2"), migrate=True)
    try:
        yield context
    finally:
        context.close()


@pytest.fixture
def sql_ctx(sql_settings: Settings) -> Iterator[ServerContext]:
    """As ``ctx``, on SQLite then on PostgreSQL."""
    context = build_context(sql_settings, make_fleet("m1", "m2"), migrate=True)
    try:
        yield context
    finally:
        context.close()


# Parallel runs (pytest-xdist, ``--dist loadgroup``): the tests that share a fleet of real worker
# processes run in one xdist worker, so that each fleet starts once; everything else is spread
# test by test. Each xdist worker has its own Redis server, ports and temporary folders.
XDIST_GROUPS: dict[str, str | None] = {
    "tests/e2e/test_kinds.py": "models",  # these two share a fleet: every pipeline class
    "tests/e2e/test_families.py": "models",
    "tests/e2e/test_sync.py": "sync",
    "tests/e2e/test_watchdog.py": "watchdog",
    "tests/e2e/test_full_disk.py": "full_disk",  # its own server, under prlimit --fsize
    "tests/e2e/test_broker.py": "broker",  # its own fleet, under a broker key prefix
    "tests/e2e/test_revoke_and_flower.py": "revoke",  # its own fleet and Flower (Redis db 6)
    "tests/e2e/test_text.py": "text",  # its own fleet: tiny causal LMs (Redis db 11)
    "tests/e2e/test_devices.py": "devices",  # its own fleet: one host of two devices (Redis db 9)
    "tests/e2e/test_rotated_token.py": "rotated_token",  # its own fleet: a token rotated under it (Redis db 15)
    # one test each, with a fleet of its own: scheduled as single tests, off the shared fleet's lane
    "tests/e2e/test_join.py": None,
    "tests/e2e/test_supervised_restart.py": None,
    "tests/e2e/test_real_layouts.py": None,
    "tests/e2e/test_single_file.py": None,
    "tests/e2e/": "fleet",  # the session's shared fleet (tests/e2e/conftest.py)
    "tests/drills/": "drills",
    "tests/netns/": "netns",  # one multi-host fleet (tests/netns/conftest.py)
    "tests/fuzz/": "fuzz",
}


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[object]:
    """Each test runs with every object made before it frozen out of the cyclic collector's scans
    (``gc.freeze``), and thawed after it, so that nothing is kept for ever. A test process holds
    ~2.3 million objects by the end of a run (torch, diffusers, transformers, hypothesis and every
    earlier test's leftovers), and each full collection scanned them all: ~0.1 s at every
    automatic one, up to a second at each of the residency cache's collections after an eviction
    (R15). Measured on the integration API and unit tiers in one process: 35.5 CPU-s of
    collections in 148 CPU-s, 6.7 with this (docs/benchmarks.md, "The test suite"). After it, any
    blocker the test left paused is continued (``tests.helpers.pause``)."""
    gc.freeze()
    try:
        return (yield)
    finally:
        gc.unfreeze()
        resume_all()  # a blocker a failed test left paused (tests/helpers.py ``pause``)


def pytest_sessionfinish(session: pytest.Session) -> None:
    """One full collection at the end, then everything frozen: pytest's own end (its check for
    exceptions raised in ``__del__``) collects five times more, each a full scan of the
    process's objects, ~1.8 CPU-s apiece in an xdist worker at the end of a run. The one here
    still runs every finalizer, and pytest still hears of what they raise."""
    gc.collect()
    gc.freeze()


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which turns the marks into the groups it schedules
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    root = Path(__file__).resolve().parent.parent
    for item in items:
        path = item.path.relative_to(root).as_posix()
        group = next((name for prefix, name in XDIST_GROUPS.items() if path.startswith(prefix)), None)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))


def pytest_collection_finish(session: pytest.Session) -> None:
    """Refuse to run when a fleet-sharing test would not be scheduled with its group (xdist
    schedules by the ``@group`` suffix its own hook adds to the node id): two xdist workers would
    each start that fleet, and the multi-host tests would share namespaces."""
    if not session.config.getoption("loadgroup", default=False):
        return
    stray = [item.nodeid for item in session.items if item.get_closest_marker("xdist_group") and "@" not in item.nodeid]
    if stray:
        raise pytest.UsageError(f"{len(stray)} grouped tests lost their xdist group, e.g. {stray[0]}")


#: how much of each fleet process's log a failed test's report shows (lines)
LOG_TAIL_LINES = 40


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """A failed test that used a fleet of real processes reports the tail of each process's log
    (``<data_dir>/logs/*.log``, :class:`app.devtools.localfleet.LocalFleet`), newest first: a
    job stuck ``queued`` or ``running`` on CI is explained by its worker's last lines, which are
    gone with CI's machine."""
    report = yield
    if report.failed and call.when == "call":
        for name, text in fleet_log_tails(item):
            report.sections.append((f"fleet log {name} (last {LOG_TAIL_LINES} lines)", text))
    return report


def fleet_log_tails(item: pytest.Item) -> list[tuple[str, str]]:
    """``(log file name, its last lines)`` for every LocalFleet among ``item``'s fixtures (held
    directly or as ``.local``), the most recently written log first."""
    from app.devtools.localfleet import LocalFleet

    logs: dict[Path, None] = {}
    for value in getattr(item, "funcargs", {}).values():
        local = value if isinstance(value, LocalFleet) else getattr(value, "local", None)
        if isinstance(local, LocalFleet) and local.logs_dir.is_dir():
            logs.update(dict.fromkeys(local.logs_dir.glob("*.log")))
    tails = []
    for path in sorted(logs, key=lambda p: p.stat().st_mtime, reverse=True):
        name = f"{path.parent.parent.name}/{path.name}"
        try:
            tails.append((name, "\n".join(path.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:])))
        except OSError as error:  # said in the report, never dropped
            tails.append((name, f"(the log could not be read: {error})"))
    return tails
