"""A full disk (R2, R19): a real ``homefleet serve`` under ``prlimit --fsize``
(no file it writes may pass LIMIT bytes: the write fails with EFBIG, as on a full disk) and a
real worker. An input upload is 507 naming what could not be stored; a result the server
cannot store is kept in the worker's spool and retried, then the job ends ``failed`` with
reason ``result_not_stored``; once the server has room, ``homefleet results recover`` (the
worker stopped) brings the spooled result in and the job is ``succeeded``, the same bytes, run once. With the worker's
spool full too (a 16 KiB tmpfs) the job fails ``result_not_stored`` at once, naming both refusals."""

from __future__ import annotations

import io
import random
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from PIL import Image

from app.client import ApiError, HomefleetClient
from app.core.config import Settings
from app.core.digest import bytes_digest
from app.core.secret_files import write_private
from app.devtools.localfleet import LocalFleet
from app.devtools.procs import stop_process_group
from app.devtools.redis_server import free_port
from tests.helpers import TEST_API_KEY, make_fleet, run_cli

pytestmark = pytest.mark.e2e

MODEL = "tiny-sd"
LIMIT = 30_000  # bytes per file the server may write: its log fits, a 128 x 128 PNG of noise (~45 KB) does not
SIDE = 128


@pytest.fixture
def postgres_url() -> Iterator[str]:
    """A fresh PostgreSQL database for the journal: its files are the database server's, not
    the limited process's (a SQLite journal and its WAL would hit the limit first)."""

    pytest.importorskip("psycopg")
    from tests.conftest import fresh_postgres_database

    yield from fresh_postgres_database("hf_full_disk")


def limited_fleet(
    tmp_path: Path, redis_base_url: str, tiny_models_dir: Path, postgres_url: str, spool: Path | None = None
) -> Iterator[tuple[LocalFleet, Path]]:
    """A server under ``prlimit --fsize=LIMIT`` and worker m1 whose spool is ``spool`` (default:
    beside its models folder)."""
    if shutil.which("prlimit") is None:
        pytest.skip("prlimit (util-linux) is not installed")
    redis_url = f"{redis_base_url}/6"
    redis.Redis.from_url(redis_url).flushdb()
    fleet = make_fleet("m1")
    fleet_file = tmp_path / "fleet.toml"
    write_private(fleet_file, fleet.to_toml())
    settings = Settings(
        data_dir=tmp_path / "server",
        redis_url=redis_url,
        fleet_file=fleet_file,
        api_port=free_port(),
        heartbeat_interval_s=0.5,
        heartbeat_ttl_s=8,
        api_keys=[TEST_API_KEY],
        database_url=postgres_url,
    )
    operator = {
        "HOMEFLEET_DATA_DIR": str(settings.data_dir),
        "HOMEFLEET_FLEET_FILE": str(fleet_file),
        "HOMEFLEET_REDIS_URL": redis_url,
        "HOMEFLEET_DATABASE_URL": postgres_url,
    }
    run_cli("db", "upgrade", env=operator)  # migrations run unlimited: only the serving process is limited
    run_cli("models", "add", str(tiny_models_dir / MODEL), "--id", MODEL, env=operator)
    local = LocalFleet(settings, fleet, fleet_file, forkserver=True)
    local.copy_model(MODEL, "m1")
    spool = spool or local.machine_dir("m1") / "spool"
    try:
        local.start_api(prefix=["prlimit", f"--fsize={LIMIT}"])
        local.start_worker(
            "m1",
            extra_env={
                "HOMEFLEET_RESULT_UPLOAD_ATTEMPTS": "3",
                "HOMEFLEET_RESULT_RETRY_S": "0.5",
                "HOMEFLEET_SPOOL_DIR": str(spool),
            },
        )
        local.wait_online(["m1"], model_id=MODEL, timeout_s=120)
        yield local, spool
    finally:
        local.stop()


@pytest.fixture
def limited(
    tmp_path: Path, redis_base_url: str, tiny_models_dir: Path, postgres_url: str
) -> Iterator[tuple[LocalFleet, Path]]:
    yield from limited_fleet(tmp_path, redis_base_url, tiny_models_dir, postgres_url)


@pytest.fixture
def full_spool(tmp_path: Path) -> Iterator[tuple[Path, str]]:
    """A spool on which the worker's writes fail, and the error they fail with: a 16 KiB tmpfs
    (``ENOSPC``, a full disk) where this process may mount one (root), else a folder under a
    regular file (``ENOTDIR``: the same path, a write the worker's disk refuses)."""
    small = tmp_path / "small-disk"
    small.mkdir()
    mounted = (
        shutil.which("mount") is not None
        and subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=16k", "tmpfs", str(small)],
            capture_output=True,
            check=False,
        ).returncode
        == 0
    )
    if not mounted:
        blocker = tmp_path / "not-a-folder"
        blocker.write_text("a file where the spool's parent folder should be")
        yield blocker / "spool", "ENOTDIR"
        return
    try:
        yield small / "spool", "ENOSPC: No space left on device"
    finally:
        subprocess.run(["umount", str(small)], check=False)


@pytest.fixture
def both_full(
    tmp_path: Path, redis_base_url: str, tiny_models_dir: Path, postgres_url: str, full_spool: tuple[Path, str]
) -> Iterator[tuple[LocalFleet, Path, str]]:
    for local, spool in limited_fleet(tmp_path, redis_base_url, tiny_models_dir, postgres_url, full_spool[0]):
        yield local, spool, full_spool[1]


def noise_png(side: int) -> bytes:
    rng = random.Random(24)
    image = Image.frombytes("RGB", (side, side), bytes(rng.getrandbits(8) for _ in range(side * side * 3)))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def test_a_full_disk_is_507_the_result_is_spooled_and_recovered(limited: tuple[LocalFleet, Path]) -> None:
    local, spool = limited
    client = HomefleetClient(local.api_url, api_key=TEST_API_KEY)
    try:
        # An input over the limit: 507 naming it, logged; nothing half-written is left.
        big = noise_png(SIDE)
        assert len(big) > LIMIT
        with pytest.raises(ApiError) as refused:
            client.upload(big)
        assert refused.value.status_code == 507, refused.value
        assert refused.value.reason == "storage_full" and "the uploaded input" in refused.value.message
        # A result over the limit: kept by the worker, retried, then the job fails result_not_stored.
        job = client.submit(
            MODEL,
            "txt2img",
            {"prompt": "noise", "steps": 1, "width": SIDE, "height": SIDE, "guidance_scale": 1.0, "seed": 7},
            target="m1",
        )
        ended = client.wait(job["id"], timeout_s=300)
        assert ended["state"] == "failed" and ended["reason"] == "result_not_stored", ended
        assert str(spool) in ended["message"] and "homefleet results recover" in ended["message"]
        kept = spool / f"{job['id']}.result"
        assert kept.is_file() and kept.stat().st_size > LIMIT
        log = (local.logs_dir / "api.log").read_text()
        assert "storage full" in log and "File too large" in log
        worker_log = (local.logs_dir / "worker-m1.log").read_text()
        assert worker_log.count(f"job {job['id']}: the server could not store the result (attempt") == 2
        data = kept.read_bytes()
        # The server gets room (restarted without the limit); the worker's host, its worker stopped
        # (a running one tries its spool itself: tests/e2e/test_result_spool.py), brings the result in.
        local.stop_worker("m1")
        stop_process_group(local.processes.pop("api"))
        local.start_api()
        worker_env = {
            "HOMEFLEET_MACHINE": "m1",
            "HOMEFLEET_MODELS_DIR": str(local.models_dir("m1")),
            "HOMEFLEET_WORKER_TOKEN": local.fleet.machines["m1"].token or "",
            "HOMEFLEET_SERVER_URL": local.api_url,
            "HOMEFLEET_SPOOL_DIR": str(spool),
            "HOMEFLEET_REDIS_URL": local.settings.redis_url,
        }
        # the settings `worker join` writes (worker.env), as the host has them
        env_file = spool.parent / "worker.env"
        env_file.write_text("".join(f"{name}={value}\n" for name, value in worker_env.items()))
        done = run_cli("results", "recover", "--env-file", str(env_file))
        assert f"{job['id']}: recovered" in done.stdout, done.stdout
        recovered = client.get(job["id"])
        assert recovered["state"] == "succeeded" and recovered["result"]["digest"] == bytes_digest(data)
        assert client.download(job["id"]) == data
        assert not kept.exists()
        again = run_cli("results", "recover", env=worker_env)  # nothing left: a no-op
        assert "0 spooled results" in again.stdout
    finally:
        client.close()


def test_both_disks_full_fail_the_job_at_once_naming_both_refusals(both_full: tuple[LocalFleet, Path, str]) -> None:
    """The server answers 507 and the worker's spool cannot keep the result either: the upload
    is retried while the task holds the bytes, then the job ends ``failed`` ``result_not_stored``
    at once (never ``running`` until the hung bound), naming the server's refusal and the spool's
    error; the worker lives on and runs the next job."""
    local, spool, spool_error = both_full
    client = HomefleetClient(local.api_url, api_key=TEST_API_KEY)
    try:
        params = {"prompt": "noise", "steps": 1, "width": SIDE, "height": SIDE, "guidance_scale": 1.0, "seed": 7}
        submitted = time.monotonic()
        job = client.submit(MODEL, "txt2img", params, target="m1")
        ended = client.wait(job["id"], timeout_s=120)
        took_s = time.monotonic() - submitted
        assert ended["state"] == "failed" and ended["reason"] == "result_not_stored", ended
        assert took_s < 60, took_s  # a load, a step and 3 attempts (1.5 s of pauses), not the hung bound
        message = ended["message"]
        assert "507 storage_full" in message and "File too large" in message, message  # the server's refusal
        assert f"could not keep it in its spool {spool}" in message and spool_error in message, message
        assert "after 3 attempts" in message and "the result is lost" in message
        assert not spool.is_dir() or not list(spool.iterdir()), list(spool.iterdir())  # nothing half-written
        worker_log = (local.logs_dir / "worker-m1.log").read_text()
        assert "raised unexpected" not in worker_log
        assert worker_log.count(f"job {job['id']}: the server could not store the result (attempt") == 2
        assert f"job {job['id']}: the server could not store the result" in worker_log
        assert "kept in memory only" in worker_log
        # The worker lives on: a result that fits the server's disk is stored.
        small = client.submit(MODEL, "txt2img", {**params, "width": 64, "height": 64}, target="m1")
        done = client.wait(small["id"], timeout_s=120)
        assert done["state"] == "succeeded", done
        assert len(client.download(small["id"])) < LIMIT
    finally:
        client.close()
