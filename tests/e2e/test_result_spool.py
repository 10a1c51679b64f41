"""A result the server could not be reached to take (R2, R19), end to end: a real
``homefleet serve`` killed while a real worker runs a job, so the worker's upload finds no
server past its client's retries and the result goes to the worker's spool, the job still
``running`` in the journal. The server starts again; the running worker brings the spooled
result in by itself (``tasks/spool.py``, ``SpoolRecovery``): the job ``succeeded`` with the
spooled bytes, claimed once, and the spool is empty, without ``homefleet results recover``.
A job whose message the worker took while the server was down waits for its claim as long as
the outage lasts, and runs once the server is back (R19)."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from app.client import HomefleetClient
from app.context import build_context
from app.core.digest import bytes_digest
from app.core.states import JobState
from app.devtools.localfleet import LocalFleet
from app.devtools.procs import stop_process_group
from tests.helpers import LONG_SIZE, TEST_API_KEY, fleet_files, wait_for

pytestmark = pytest.mark.e2e

MODEL = "tiny-sd"
LONG = {"prompt": "a result nobody takes at first", "steps": 20, "seed": 11, **LONG_SIZE}


@pytest.fixture
def fleet(tmp_path: Path, redis_base_url: str, tiny_models_dir: Path) -> Iterator[tuple[LocalFleet, Path]]:
    """Server and worker m1; the worker gives an unreachable server up after 1 s (its client's
    retries), tries one upload, and tries its spool every second."""
    files = fleet_files(tmp_path / "server", f"{redis_base_url}/9", "m1")
    config, fleet_file, settings = files.config, files.fleet_file, files.settings
    local = LocalFleet(settings, config, fleet_file, forkserver=True)
    ctx = build_context(settings, config, migrate=True)
    spool = local.machine_dir("m1") / "spool"
    try:
        ctx.registry.add(tiny_models_dir / MODEL, model_id=MODEL)
        local.copy_model(MODEL, "m1")
        local.start_api()
        local.start_worker(
            "m1",
            extra_env={
                "HOMEFLEET_SERVER_RETRY_S": "1",
                "HOMEFLEET_RESULT_UPLOAD_ATTEMPTS": "1",
                "HOMEFLEET_RESULT_RECOVER_INTERVAL_S": "1",
                "HOMEFLEET_SPOOL_DIR": str(spool),
            },
        )
        local.wait_online(["m1"], model_id=MODEL, timeout_s=120)
        yield local, spool
    finally:
        local.stop()
        ctx.close()


def test_a_result_kept_while_the_server_was_down_is_brought_in_by_the_running_worker(
    fleet: tuple[LocalFleet, Path],
) -> None:
    local, spool = fleet
    ctx = build_context(local.settings, local.fleet)
    client = HomefleetClient(local.api_url, api_key=TEST_API_KEY)
    worker_log = local.logs_dir / "worker-m1.log"
    try:
        job = client.submit(MODEL, "txt2img", LONG, target="m1")
        job_id = job["id"]
        wait_for(
            lambda: int(ctx.redis.hget(ctx.keys.progress(job_id), "step") or 0) >= 1,
            timeout_s=120,
            what=f"job {job_id} to report a step",
        )
        stop_process_group(local.processes.pop("api"), signal.SIGKILL)  # gone, its port closed
        kept = spool / f"{job_id}.result"
        wait_for(  # the file is written before the line that says so is logged
            lambda: kept.is_file() and "the server could not be reached to take the result" in worker_log.read_text(),
            timeout_s=120,
            what="the worker to spool the result nobody took, and say so",
        )
        assert ctx.journal.get(job_id).state == "running"  # nobody could tell the server
        data = kept.read_bytes()

        local.start_api()
        done = client.wait(job_id, timeout_s=60)
        assert done["state"] == "succeeded", done
        assert done["result"]["digest"] == bytes_digest(data)
        assert client.download(job_id) == data
        # the worker removes its copy once the server's answer reaches it, just after the journal says so
        wait_for(lambda: list(spool.iterdir()) == [], timeout_s=30, what="the worker to drop its spooled copy")
        assert f"job {job_id}: spooled result recovered" in worker_log.read_text()
        claims = [event for event in ctx.journal.events(job_id) if event.event == JobState.running]
        assert len(claims) == 1  # run once (R3)
    finally:
        client.close()
        ctx.close()


def test_r19_a_job_taken_while_the_server_is_down_waits_for_its_claim_and_runs_once_it_is_back(
    fleet: tuple[LocalFleet, Path],
) -> None:
    """The server is killed while m1 runs a job with another queued behind it, and stays down
    longer than the worker's ``server_retry_s`` (1 s here; 120 s by default). The worker takes the
    queued job's message (early ack: it leaves the queue) and cannot claim it. Before, the claim
    gave up after ``server_retry_s``: the task failed, and once the server was back reconciliation
    found the job ``queued`` with its message gone and ended it ``interrupted`` (``lost``: "its
    worker stopped before claiming it"), though no worker stopped and it never ran; one job per
    ``server_retry_s`` of the outage went that way on every idle machine. Now the claim waits for
    the server, and the job runs once it answers, once."""
    local, spool = fleet
    ctx = build_context(local.settings, local.fleet)
    client = HomefleetClient(local.api_url, api_key=TEST_API_KEY)
    worker_log = local.logs_dir / "worker-m1.log"
    try:
        running = client.submit(MODEL, "txt2img", LONG, target="m1")["id"]
        waiting = client.submit(MODEL, "txt2img", {"prompt": "behind it", "steps": 2, "seed": 3}, target="m1")["id"]
        wait_for(
            lambda: int(ctx.redis.hget(ctx.keys.progress(running), "step") or 0) >= 1,
            timeout_s=120,
            what=f"job {running} to report a step",
        )
        stop_process_group(local.processes.pop("api"), signal.SIGKILL)
        # The claim's pauses grow 0.2, 0.4, 0.8, 1.6 s: a fourth pause is past server_retry_s (1 s),
        # where the claim used to give up (after two).
        given_up = f"Task homefleet.run_job[{waiting}] raised"

        def waited_or_gave_up() -> bool:
            text = worker_log.read_text()
            return text.count(f"/jobs/{waiting}/claim again") >= 4 or given_up in text

        wait_for(waited_or_gave_up, timeout_s=120, what=f"the worker to wait for the claim of job {waiting}")
        assert given_up not in worker_log.read_text(), "the worker gave the claim up"
        assert ctx.journal.get(waiting).state == JobState.queued  # not claimed: nobody could

        local.start_api()
        done = client.wait(waiting, timeout_s=120)
        assert (done["state"], done["reason"]) == ("succeeded", None), done
        claims = [event for event in ctx.journal.events(waiting) if event.event == JobState.running]
        assert len(claims) == 1  # run once (R19)
        assert worker_log.read_text().count(f"job {waiting} claimed") == 1
        assert client.wait(running, timeout_s=120)["state"] == "succeeded"  # its spooled result brought in
        wait_for(lambda: list(spool.iterdir()) == [], timeout_s=60, what="the spool to be emptied")
    finally:
        client.close()
        ctx.close()
