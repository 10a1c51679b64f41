"""``HOMEFLEET_REDIS_URL=unix:///path/redis.sock`` (redis-py's form, accepted by the settings)
works for the broker too: kombu names the same Redis ``redis+socket://`` (new-user pass: every
worker died with "No such transport: unix"). Real redis-server on a unix socket, with and
without a password."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import pytest
import redis

from app.core.celery_app import RUN_JOB_TASK, create_celery
from app.core.config import BrokerSettings
from app.devtools.redis_server import redis_server_binary

PASSWORD = "se@cret:1"  # characters a URL must escape


@pytest.fixture(params=[None, PASSWORD], ids=["open", "requirepass"])
def socket_redis(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[tuple[Path, str | None]]:
    """(the socket's path, the password or None) of a private redis-server."""
    path = tmp_path / "redis.sock"
    command = [
        redis_server_binary(),
        "--port",
        "0",
        "--unixsocket",
        str(path),
        "--save",
        "",
        "--appendonly",
        "no",
        "--dir",
        str(tmp_path),
    ]
    if request.param:
        command += ["--requirepass", request.param]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 10
        while not path.exists():
            assert time.monotonic() < deadline and process.poll() is None, "redis-server did not start"
            time.sleep(0.05)
        yield path, request.param
    finally:
        process.terminate()
        process.wait(timeout=10)


def test_a_unix_socket_redis_url_publishes_and_consumes_on_the_same_redis_and_db(
    socket_redis: tuple[Path, str | None],
) -> None:
    """Also with the password in redis-py's query (``?password=``, escaped) and another redis-py
    option (``socket_timeout``) that kombu would pass on untyped."""
    path, password = socket_redis
    query = "db=3&socket_timeout=5" + (f"&password={quote(password, safe='')}" if password else "")
    settings = BrokerSettings(redis_url=f"unix://{path}?{query}")
    assert redis.Redis.from_url(settings.redis_url).ping()  # redis-py reads the same URL
    celery = create_celery(settings)
    celery.send_task(RUN_JOB_TASK, args=["job-1"], task_id="job-1", queue="machine.m1")
    direct = redis.Redis(unix_socket_path=str(path), db=3, password=password, decode_responses=True)
    assert direct.llen("machine.m1") == 1  # the same Redis, the same database
    with celery.connection_for_read() as connection:
        message = connection.SimpleQueue("machine.m1", no_ack=True).get(timeout=5)  # a worker's side: kombu consumes
        assert message.headers["id"] == "job-1"
    assert direct.llen("machine.m1") == 0
