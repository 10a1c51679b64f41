"""The fork server (app/devtools/forkserver.py): a command forked from the preloaded
interpreter behaves as the exec'd ``homefleet`` does: the environment it is given (all of it),
its own session, its output in its log, its exit code or signal. Real Redis, a real
``homefleet worker`` (R7: it takes its machine's lease before anything else)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import redis

from app.core.keys import Keys
from app.devtools import forkserver
from tests.helpers import wait_for

TOKEN = "t" * 32


def worker_env(redis_url: str, tmp_path: Path) -> dict[str, str]:
    (tmp_path / "models").mkdir(exist_ok=True)  # a worker refuses a models folder that is not there
    return {
        "PATH": os.environ.get("PATH", ""),
        "HOMEFLEET_MACHINE": "m1",
        "HOMEFLEET_REDIS_URL": redis_url,
        "HOMEFLEET_WORKER_TOKEN": TOKEN,
        "HOMEFLEET_MODELS_DIR": str(tmp_path / "models"),
        "HOMEFLEET_SERVER_URL": "http://127.0.0.1:9",
        "HOMEFLEET_HEARTBEAT_INTERVAL_S": "0.2",
    }


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGTERM, 0), (signal.SIGKILL, -signal.SIGKILL)])
def test_a_forked_worker_takes_its_lease_in_its_own_session_and_ends_as_its_signal_says(
    redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sig: int, code: int
) -> None:
    # this process's own HOMEFLEET_* variables must not reach the command: it gets env, all of it
    monkeypatch.setenv("HOMEFLEET_KEY_PREFIX", "leaked")  # would move the lease key
    log = tmp_path / "worker.log"
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    lease_key = Keys("hf").worker_lease("m1")
    process = forkserver.start(["worker"], worker_env(redis_url, tmp_path), log)
    try:
        assert process.pid > 0 and process.poll() is None
        boot = wait_for(lambda: client.get(lease_key), timeout_s=60, what="the forked worker's lease")
        assert boot and client.get(Keys("hf").worker_lease("m2")) is None
        assert os.getsid(process.pid) == process.pid  # its own session: stopped with its process group
        with pytest.raises(Exception, match=r"Timeout|timed out"):
            process.wait(timeout=0.2)  # still waiting for a server that does not answer
    finally:
        process.send_signal(sig)
    assert process.wait(timeout=30) == code == process.returncode
    text = log.read_text()
    assert "m1" in text  # its log is its output
    if sig == signal.SIGTERM:  # a clean stop frees the machine at once (R7)
        assert client.get(lease_key) is None


def test_a_forked_command_that_fails_exits_with_its_code_and_its_message_in_its_log(tmp_path: Path) -> None:
    log = tmp_path / "status.log"
    env = {"PATH": os.environ.get("PATH", ""), "HOMEFLEET_HEARTBEAT_TTL_S": "not-seconds"}
    process = forkserver.start(["status"], env, log)
    assert process.wait(timeout=60) == 2
    text = log.read_text()
    assert "invalid_settings" in text and "heartbeat_ttl_s" in text.lower(), text
