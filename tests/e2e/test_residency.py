"""Residency through a real worker (R15, R16, R21; C05, C09): machine m3's worker runs the
cpu adapter with a small configured capacity (``HOMEFLEET_MEMORY_CAP_BYTES``: one tiny model
plus a job's working memory), so the unified policy really evicts. Loads are counted from the
journal's ``cold_load`` flags and the worker's log; a real OOM comes from a worker started
under ``prlimit --as`` (RLIMIT_AS)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from app.client import ApiError
from app.core.pricing import loaded_bytes
from app.core.variants import Variant
from routing.estimate import working_bytes
from tests.e2e.conftest import RunningFleet
from tests.helpers import run_cli, settings_env

pytestmark = pytest.mark.e2e

MACHINE = "m3"
MODELS = ("tiny-a", "tiny-b", "tiny-c")  # three checkpoints (copies of tiny-sd under their own ids)
RETIRING = "tiny-retiring"  # a fourth, retired by its test (R1): a retirement cannot be undone
PARAMS = {"prompt": "x", "steps": 1}


@pytest.fixture(scope="module")
def capped(fleet: RunningFleet, tiny_models_dir: Path) -> Iterator[RunningFleet]:
    """m3's worker with room for exactly one tiny model (+ the job's working memory)."""
    local = fleet.local
    for model_id in (*MODELS, RETIRING):
        if model_id not in {r.id for r in fleet.ctx.registry.list(retired=True)}:
            fleet.ctx.registry.add(tiny_models_dir / fleet.model, model_id)
        local.copy_model(model_id, MACHINE)
    weights = loaded_bytes(tiny_models_dir / fleet.model, Variant())
    cap = working_bytes("txt2img", 64 * 64) + weights * 3 // 2
    local.start_worker(MACHINE, extra_env={"HOMEFLEET_MEMORY_CAP_BYTES": str(cap)})
    try:
        for model_id in (*MODELS, RETIRING):
            local.wait_online([MACHINE], model_id=model_id, timeout_s=120)
        yield fleet
    finally:
        fleet.client._json(fleet.client.http.put(f"/v1/machines/{MACHINE}/residency", json={"models": []}))
        local.stop_worker(MACHINE)


def run_all(fleet: RunningFleet, models: list[str]) -> list[bool]:
    """Submit jobs for ``models`` to m3 at once (FIFO), wait for all; their cold_load flags."""
    ids = [fleet.client.submit(m, "txt2img", PARAMS, target=MACHINE)["id"] for m in models]
    for job_id in ids:
        assert fleet.client.wait(job_id, timeout_s=180)["state"] == "succeeded", fleet.client.get(job_id)
    return [bool(fleet.ctx.journal.get(job_id).cold_load) for job_id in ids]


def warm(fleet: RunningFleet) -> list[str]:
    return json.loads(fleet.ctx.redis.get(fleet.ctx.keys.warm(MACHINE)) or "[]")


def evictions(fleet: RunningFleet) -> int:
    return (fleet.local.logs_dir / f"worker-{MACHINE}.log").read_text().count("homefleet.residency: evicting")


def test_c09_no_reload_thrash_through_a_real_worker(capped: RunningFleet) -> None:
    a, b = MODELS[0], MODELS[1]
    run_all(capped, [a])
    assert warm(capped) == [a]
    assert run_all(capped, [b, b, b, a, b, a]) == [True, False, False, True, True, True]
    assert warm(capped) == [a]


def test_c05_checkpoint_switches_evict_before_each_load(capped: RunningFleet) -> None:
    a, b, c = MODELS
    run_all(capped, [a])  # one model resident, whatever ran before: each switch below evicts once
    before = evictions(capped)
    assert run_all(capped, [b, c, a, b]) == [True, True, True, True]
    assert evictions(capped) - before == 4 and warm(capped) == [b]  # one model resident after every switch


def test_r15_r16_protected_model_is_never_evicted_and_the_job_is_refused(capped: RunningFleet) -> None:
    a, b = MODELS[0], MODELS[1]
    http = capped.client.http
    assert http.put(f"/v1/machines/{MACHINE}/residency", json={"models": [a]}).status_code == 200
    run_all(capped, [a])
    job_id = capped.client.submit(b, "txt2img", PARAMS, target=MACHINE)["id"]
    job = capped.client.wait(job_id, timeout_s=120)
    assert (job["state"], capped.ctx.journal.get(job_id).reason) == ("failed", "residency_protected")
    assert "protected" in (capped.ctx.journal.get(job_id).message or "") and warm(capped) == [a]
    assert http.put(f"/v1/machines/{MACHINE}/residency", json={"models": []}).status_code == 200


def _pool_vm_bytes(fleet: RunningFleet) -> int:
    worker = psutil.Process(fleet.local.processes[f"worker-{MACHINE}"].pid)
    return max(p.memory_info().vms for p in [worker, *worker.children(recursive=True)])


def test_r21_real_oom_under_rlimit_is_remembered_and_its_repeat_refused(capped: RunningFleet) -> None:
    a = MODELS[0]
    run_all(capped, [a])  # the pool process has loaded a model and run a job
    # 150 MB of address space to spare: a 1024x1024 job (its peak ~900 MB above a 64x64 job's)
    # fails in its first large allocations, within a second (with 250-400 MB it could run for a
    # minute first); the 64x64 job after it fits because the worker frees what the failed run's
    # frames held (tasks.run_job.release_failed_run)
    limit_bytes = _pool_vm_bytes(capped) + 150_000_000
    capped.local.stop_worker(MACHINE)
    capped.local.start_worker(MACHINE, prefix=["prlimit", f"--as={limit_bytes}", "--"])
    capped.local.wait_online([MACHINE], model_id=a, timeout_s=120)
    big = {**PARAMS, "width": 1024, "height": 1024}
    try:
        job_id = capped.client.submit(a, "txt2img", big, target=MACHINE)["id"]
        job = capped.client.wait(job_id, timeout_s=300)
        journaled = capped.ctx.journal.get(job_id)
        assert (job["state"], journaled.reason) == ("failed", "oom"), journaled.message
        assert "can't allocate memory" in (journaled.message or "")
        [record] = capped.ctx.residency.ooms(MACHINE)
        assert (record.model_id, record.kind, record.size, record.job_id) == (a, "txt2img", 1024 * 1024, job_id)
        with pytest.raises(ApiError) as refused:
            capped.client.submit(a, "txt2img", big, target=MACHINE)
        assert (refused.value.status_code, refused.value.reason) == (422, "remembered_oom")
        small = capped.client.wait(capped.client.submit(a, "txt2img", PARAMS, target=MACHINE)["id"], timeout_s=120)
        assert small["state"] == "succeeded", capped.ctx.journal.get(
            small["id"]
        ).message  # a smaller job still runs there
        assert capped.ctx.residency.clear_ooms(MACHINE) == 1
        assert capped.ctx.residency.ooms(MACHINE) == []
    finally:  # the fleet is shared: a failure here must not leave m3 refusing the next tests' jobs
        capped.ctx.residency.clear_ooms(MACHINE)


def test_r1_a_retired_model_leaves_the_workers_memory_at_once(capped: RunningFleet) -> None:
    """``homefleet models retire`` on a model warm in a worker: the pool process drops it within
    a few heartbeats (tasks/retirements.py), not at its turn for eviction; the heartbeat stops
    naming it warm and the worker's log says why."""
    run_all(capped, [RETIRING])
    before = warm(capped)
    assert before[-1] == RETIRING  # most recently used
    settings = capped.local.settings
    done = run_cli(
        "models",
        "retire",
        RETIRING,
        env={**settings_env(settings), "HOMEFLEET_FLEET_FILE": str(capped.local.fleet_file)},
    )
    assert f"retired {RETIRING} on" in done.stdout and "drop it from memory" in done.stdout, done.stdout
    verified = capped.ctx.keys.verified(MACHINE)
    deadline = time.monotonic() + 30
    while (RETIRING in warm(capped) or capped.ctx.redis.sismember(verified, RETIRING)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert warm(capped) == before[:-1]  # the others stay warm
    assert not capped.ctx.redis.sismember(verified, RETIRING)  # withdrawn too (R4)
    log, said = (
        capped.local.logs_dir / f"worker-{MACHINE}.log",
        f"model {RETIRING} is no longer registered (retired); dropped from memory",
    )
    while said not in log.read_text() and time.monotonic() < deadline:  # unpublished first, then dropped
        time.sleep(0.2)
    assert said in log.read_text()
