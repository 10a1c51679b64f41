"""Residency commitments applied at worker start (R16), through a real ``celery worker``: once
its files are verified (R4), the worker loads its machine's committed models as protected, so
its heartbeat shows them warm before any job is submitted, and the first job does not cold-load.
A committed model that is not verified there is skipped with a warning."""

from __future__ import annotations

import json
import time

import pytest

from tests.e2e.conftest import EDIT_MODEL, RunningFleet

pytestmark = pytest.mark.e2e

MACHINE = "m3"  # in the fleet config, no worker until a test starts one


def heartbeat(fleet: RunningFleet) -> dict:
    raw = fleet.ctx.redis.get(fleet.ctx.keys.heartbeat(MACHINE))
    return json.loads(raw) if raw else {}


def test_r16_committed_models_are_warm_at_worker_start_and_the_first_job_runs_warm(fleet: RunningFleet) -> None:
    model, http, local = fleet.model, fleet.client.http, fleet.local
    local.copy_model(model, MACHINE)  # EDIT_MODEL is registered but never copied to m3
    answer = http.put(f"/v1/machines/{MACHINE}/residency", json={"models": [model, EDIT_MODEL]})
    assert answer.status_code == 200, answer.text
    log_file = local.logs_dir / f"worker-{MACHINE}.log"
    log_start = log_file.stat().st_size if log_file.exists() else 0
    jobs_before = len(fleet.ctx.journal.list(machine=MACHINE))
    local.start_worker(MACHINE)
    try:
        deadline = time.monotonic() + 180
        while model not in heartbeat(fleet).get("warm_models", []):
            assert time.monotonic() < deadline, f"{model} not warm in m3's heartbeat: {heartbeat(fleet)}"
            time.sleep(0.2)
        beat = heartbeat(fleet)
        assert beat["warm_models"] == [model] and model in beat["verified_models"]
        assert EDIT_MODEL not in beat["verified_models"]
        assert len(fleet.ctx.journal.list(machine=MACHINE)) == jobs_before  # warm before any job was placed there
        log = log_file.read_bytes()[log_start:].decode(errors="replace")
        assert f"committed model {model} preloaded" in log
        assert f"committed model {EDIT_MODEL} is not verified here; not preloaded" in log

        job_id = fleet.client.submit(model, "txt2img", {"prompt": "x", "steps": 1}, target=MACHINE)["id"]
        assert fleet.client.wait(job_id, timeout_s=180)["state"] == "succeeded"
        journaled = fleet.ctx.journal.get(job_id)
        assert (journaled.cold_load, journaled.load_s) == (False, 0.0)  # the preloaded pipeline ran it
    finally:
        local.stop_worker(MACHINE)
        assert http.put(f"/v1/machines/{MACHINE}/residency", json={"models": []}).status_code == 200
