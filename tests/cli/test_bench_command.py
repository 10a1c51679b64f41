"""``homefleet bench`` against nothing, or with levels it cannot run: a clear error and a
non-zero exit, never an empty table and exit 0 (tests/e2e/test_serving_front.py runs a sweep)."""

from __future__ import annotations

import pytest

from app.devtools.redis_server import free_port
from tests.helpers import run_cli


def test_bench_against_a_server_that_does_not_answer_exits_2_naming_it() -> None:
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens
    done = run_cli("bench", "--url", url, "--concurrency", "1", "--jobs", "2", check=False, timeout_s=60)
    said = " ".join(done.stderr.split())
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"error (server_unreachable): the API at {url} does not answer" in said, said
    assert "Traceback" not in done.stderr and "concurrency=" not in done.stdout


@pytest.mark.parametrize("levels", ["1,x", "0", ","])
def test_bench_refuses_concurrency_levels_it_cannot_run(levels: str) -> None:
    done = run_cli("bench", "--url", "http://127.0.0.1:9", "--concurrency", levels, check=False, timeout_s=60)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "--concurrency" in done.stderr and "Traceback" not in done.stderr, done.stderr
