"""``HOMEFLEET_REDIS_URL=unix:///path/redis.sock`` (redis-py's form, accepted by the settings)
works for the broker too: kombu names the same Redis ``redis+socket://`` (new-user pass: every
worker died with "No such transport: unix"). Real redis-server on a unix socket."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from app.celery_app import RUN_JOB_TASK, create_celery
from app.config import BrokerSettings
from app.redis_server import redis_server_binary


@pytest.fixture
def socket_path(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "redis.sock"
    process = subprocess.Popen([redis_server_binary(), "--port", "0", "--unixsocket", str(path), "--save", "",
                                "--appendonly", "no", "--dir", str(tmp_path)], stdout=subprocess.DEVNULL,
                               stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 10
        while not path.exists():
            assert time.monotonic() < deadline and process.poll() is None, "redis-server did not start"
            time.sleep(0.05)
        yield path
    finally:
        process.terminate()
        process.wait(timeout=10)


def test_a_unix_socket_redis_url_publishes_and_consumes_on_the_same_redis_and_db(socket_path: Path) -> None:
    settings = BrokerSettings(redis_url=f"unix://{socket_path}?db=3")
    celery = create_celery(settings)
    celery.send_task(RUN_JOB_TASK, args=["job-1"], task_id="job-1", queue="machine.m1")
    direct = redis.Redis(unix_socket_path=str(socket_path), db=3, decode_responses=True)
    assert direct.llen("machine.m1") == 1  # the same Redis, the same database
    with celery.connection_for_read() as connection:
        message = connection.SimpleQueue("machine.m1", no_ack=True).get(timeout=5)  # a worker's side: kombu consumes
        assert message.headers["id"] == "job-1"
    assert direct.llen("machine.m1") == 0
