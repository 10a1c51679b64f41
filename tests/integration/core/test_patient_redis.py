"""A pool process's Redis client rides out a Redis restart (R19): a claimed job's bookkeeping
(its watchdog record, R21) written while Redis restarts lands once Redis is back, instead of
failing the task and leaving the job ``running`` with nobody running it. The API's client, not
patient, fails at once, so that it can answer 503 (R20)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import redis

from app.core.config import Settings
from app.core.connections import create_redis
from app.devtools.redis_server import start_redis_server


def test_a_patient_client_writes_through_a_redis_restart_and_a_plain_one_fails_at_once(tmp_path: Path) -> None:
    server = start_redis_server(tmp_path / "a")
    port = int(server.url.rsplit(":", 1)[1].split("/")[0])
    settings = Settings(data_dir=tmp_path, redis_url=server.url)
    patient, plain = create_redis(settings, retry_s=30), create_redis(settings)
    assert patient.ping() and plain.ping()
    server.stop()
    with pytest.raises(redis.ConnectionError):
        plain.set("k", "plain")
    restarted: list[object] = []

    def restart_soon() -> None:
        time.sleep(1.5)
        restarted.append(start_redis_server(tmp_path / "b", port=port))

    thread = threading.Thread(target=restart_soon)
    thread.start()
    started = time.monotonic()
    try:
        assert patient.set("k", "written") is True  # waited for the restart
        waited_s = time.monotonic() - started
        thread.join()
        assert patient.get("k") == "written"
        assert waited_s >= 1.0, waited_s  # it did wait (the restart came 1.5 s later)
    finally:
        thread.join()
        for again in restarted:
            again.stop()  # type: ignore[attr-defined]
