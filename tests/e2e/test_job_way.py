"""A real job's whole way: submit, place, queue, claim, run, upload, verify, store.

Real Redis, real ``celery worker`` processes, real tiny diffusers pipelines.
"""

from __future__ import annotations

import io
import json
import signal
import time
from datetime import UTC, datetime
from pathlib import Path

import httpx
import pytest
from PIL import Image

from app.client import ApiError, HomefleetClient
from app.core import keys
from app.core.celery_app import RUN_JOB_TASK
from app.core.digest import bytes_digest
from app.core.states import JobState
from app.core.tls import tls_context
from app.jobs.webhooks import verify
from tests.e2e.conftest import QUOTA_KEY, QUOTA_NAME, RunningFleet
from tests.helpers import (
    LONG_SIZE,
    TEST_WEBHOOK_SECRET,
    files_under,
    pause,
    pool_process,
    resume,
    run_cli,
    settings_env,
    wait_for,
    webhook_receiver,
)

pytestmark = pytest.mark.e2e


def test_r2_jobs_for_server_and_a_pinned_machine_succeed_with_verified_results(fleet: RunningFleet) -> None:
    m1_before = files_under(fleet.local.machine_dir("m1"))
    on_server = fleet.client.submit(fleet.model, "txt2img", {"prompt": "a lighthouse", "steps": 2})
    on_m1 = fleet.client.submit(
        fleet.model, "txt2img", {"prompt": "a fox", "steps": 2, "width": 72, "height": 40}, target="m1"
    )
    assert (on_server["machine"], on_m1["machine"]) == ("server", "m1")
    for accepted, size in ((on_server, (64, 64)), (on_m1, (72, 40))):
        job = fleet.client.wait(accepted["id"], timeout_s=120)
        assert job["state"] == "succeeded", job
        data = fleet.client.download(accepted["id"])
        image = Image.open(io.BytesIO(data))
        assert (image.format, image.size) == ("PNG", size)
        journaled = fleet.ctx.journal.get(accepted["id"])
        assert bytes_digest(data) == journaled.result_digest == job["result"]["digest"]
        stored = Path(journaled.result_path or "")
        assert stored.read_bytes() == data
        assert stored.is_relative_to(fleet.local.settings.results_dir)
        assert journaled.load_s is not None and journaled.run_s is not None and journaled.run_s > 0
        assert '"model_id": "tiny-sd"' in image.info["homefleet"]  # provenance travels in the PNG
    # R2: the worker keeps no copy: its folders hold exactly what they held before.
    assert files_under(fleet.local.machine_dir("m1")) == m1_before


def test_a_keys_quota_refuses_with_429_while_its_job_waits_then_for_its_gpu_seconds(fleet: RunningFleet) -> None:
    """A key under a quota (max_queued_jobs=1, max_gpu_seconds_per_hour=0.05): a second job
    while its first is queued or running is 429 ``quota_queued``; another key is not held back;
    once the first ran on the worker, its measured load + run seconds spend the hour's GPU
    quota: 429 ``quota_gpu_seconds`` with a Retry-After until they leave the hour, and
    ``homefleet keys`` shows them."""
    quota = HomefleetClient(fleet.local.api_url, api_key=QUOTA_KEY)
    try:
        first = quota.submit(fleet.model, "txt2img", {"prompt": "quota first", "steps": 2}, target="m1")
        with pytest.raises(ApiError) as queued:
            quota.submit(fleet.model, "txt2img", {"prompt": "quota second", "steps": 2}, target="m1")
        assert (queued.value.status_code, queued.value.reason) == (429, "quota_queued"), queued.value.message
        assert f"'{QUOTA_NAME}'" in queued.value.message and "max_queued_jobs=1" in queued.value.message
        assert queued.value.retry_after_s is not None and queued.value.retry_after_s >= 1
        other = fleet.client.submit(fleet.model, "txt2img", {"prompt": "quota other key", "steps": 2}, target="m1")
        assert quota.wait(first["id"], timeout_s=120)["state"] == "succeeded"
        ran = fleet.ctx.journal.get(first["id"])
        spent = (ran.load_s or 0) + (ran.run_s or 0)
        assert spent > 0.05 and ran.api_key_id == QUOTA_NAME
        with pytest.raises(ApiError) as hour:
            quota.submit(fleet.model, "txt2img", {"prompt": "quota third", "steps": 2}, target="m1")
        assert (hour.value.status_code, hour.value.reason) == (429, "quota_gpu_seconds"), hour.value.message
        assert "max_gpu_seconds_per_hour=0.05" in hour.value.message
        assert hour.value.retry_after_s is not None and 3500 <= hour.value.retry_after_s <= 3601
        refused = [j for j in fleet.ctx.journal.list([JobState.rejected]) if j.api_key_id == QUOTA_NAME]
        assert sorted(j.reason for j in refused) == ["quota_gpu_seconds", "quota_queued"]  # journaled (R19)
        assert fleet.client.wait(other["id"], timeout_s=120)["state"] == "succeeded"
        shown = json.loads(run_cli("keys", "--json", env=settings_env(fleet.local.settings)).stdout)
        [row] = [r for r in shown if r["key_id"] == QUOTA_NAME]
        assert abs(row["gpu_s_last_hour"] - spent) < 0.01, row
    finally:
        quota.close()


def test_a_job_with_a_webhook_posts_its_signed_record_once_it_succeeded(fleet: RunningFleet) -> None:
    """Through the API with a real worker: the receiver fails the first attempt, takes the
    second (the fleet's webhook_backoff_s: 0.2 s); the body is the record GET answers."""
    with webhook_receiver(statuses=[500]) as receiver:
        accepted = fleet.client.submit(
            fleet.model, "txt2img", {"prompt": "a kite", "steps": 2}, target="m1", webhook_url=receiver.url
        )
        assert fleet.client.wait(accepted["id"], timeout_s=120)["state"] == "succeeded"
        events = wait_for(
            lambda: [e.detail for e in fleet.ctx.journal.events(accepted["id"]) if e.event == "webhook"][1:],
            timeout_s=30,
            what="the second attempt journaled",
        )
        record = fleet.client.get(accepted["id"])
    assert events == ["delivered: HTTP 200 (attempt 2)"]
    assert (
        next(e.detail for e in fleet.ctx.journal.events(accepted["id"]) if e.event == "webhook")
        == "attempt 1: HTTP 500; next in 0.2 s"
    )
    first, second = receiver.received
    assert record["webhook"]["state"] == "delivered" and record["webhook"]["attempts"] == 2, record["webhook"]
    assert json.loads(second.body) == json.loads(first.body) == {**record, "webhook": None}
    assert record["state"] == "succeeded" and record["result"]["digest"].startswith("blake3:")
    assert all(
        verify(TEST_WEBHOOK_SECRET, r.headers["x-homefleet-timestamp"], r.headers["x-homefleet-signature"], r.body)
        for r in (first, second)
    )
    finished = datetime.fromisoformat(record["finished_at"])
    latency_s = first.at_s - (finished if finished.tzinfo else finished.replace(tzinfo=UTC)).timestamp()
    print(f"webhook latency: {latency_s * 1000:.1f} ms from succeeded to the first attempt's arrival")
    assert -0.5 < latency_s < 5.0


def test_r8_c02_jobs_start_in_submission_order_and_wait_in_redis_meanwhile(fleet: RunningFleet) -> None:
    first = fleet.client.submit(fleet.model, "txt2img", {"prompt": "long", "steps": 20, **LONG_SIZE}, target="m2")
    second = fleet.client.submit(fleet.model, "txt2img", {"prompt": "short", "steps": 2}, target="m2")
    third = fleet.client.submit(fleet.model, "txt2img", {"prompt": "short", "steps": 2}, target="m2")
    assert [second["position"], third["position"]] == [1, 2]
    pid = pause(fleet.ctx, first["id"])  # running, at no CPU, while the queue is looked at
    # While the first runs, the other two are still in m2's Redis list, in order, and queued.
    assert fleet.ctx.redis.llen(fleet.ctx.keys.queue_list("m2")) == 2
    assert [fleet.client.get(j["id"])["state"] for j in (second, third)] == ["queued", "queued"]
    reserved = fleet.ctx.celery.control.inspect(timeout=3).reserved() or {}
    m2_reserved = [tasks for name, tasks in reserved.items() if name.startswith("m2@")]
    assert m2_reserved == [[]], reserved  # the busy worker holds no next job
    resume(pid)
    jobs = [fleet.client.wait(j["id"], timeout_s=120) for j in (first, second, third)]
    assert [j["state"] for j in jobs] == ["succeeded"] * 3
    starts = [fleet.ctx.journal.get(j["id"]).started_at for j in jobs]
    assert starts == sorted(starts)
    assert fleet.ctx.journal.get(first["id"]).finished_at <= starts[1]  # type: ignore[operator]


def test_c01_a_second_delivery_of_a_job_is_refused_and_it_runs_once(fleet: RunningFleet) -> None:
    accepted = fleet.client.submit(fleet.model, "txt2img", {"prompt": "once", "steps": 2}, target="m1")
    done = fleet.client.wait(accepted["id"], timeout_s=120)
    assert done["state"] == "succeeded"
    # Deliver the very same message again, as a broker redelivery would.
    fleet.ctx.celery.send_task(RUN_JOB_TASK, args=[accepted["id"]], task_id=accepted["id"], queue=keys.queue("m1"))

    def refused() -> bool:
        return any(e.event == "running_refused" for e in fleet.ctx.journal.events(accepted["id"]))

    wait_for(refused, what="the second claim to be refused")
    events = [e.event for e in fleet.ctx.journal.events(accepted["id"])]
    assert events.count("running") == 1 and events.count("succeeded") == 1
    after = fleet.ctx.journal.get(accepted["id"])
    assert (after.state, after.result_digest) == (JobState.succeeded, done["result"]["digest"])


def test_r10_a_job_pinned_to_an_unknown_machine_is_refused_naming_it(fleet: RunningFleet) -> None:
    response = httpx.post(
        f"{fleet.local.api_url}/v1/jobs",
        headers=fleet.local.auth_headers,
        json={"model": fleet.model, "kind": "txt2img", "params": {"prompt": "x"}, "target": "mars"},
        verify=tls_context(),
    )
    assert response.status_code == 422
    error = response.json()["error"]
    assert error["reason"] == "unknown_machine" and "'mars'" in error["message"]
    rejected = [j for j in fleet.ctx.journal.list([JobState.rejected]) if j.target == "mars"]
    assert len(rejected) == 1 and rejected[0].reason == "unknown_machine"


def test_r10_a_job_pinned_to_an_offline_machine_is_503_and_not_rerouted(fleet: RunningFleet) -> None:
    response = httpx.post(
        f"{fleet.local.api_url}/v1/jobs",
        headers=fleet.local.auth_headers,
        json={"model": fleet.model, "kind": "txt2img", "params": {"prompt": "x"}, "target": "m3"},
        verify=tls_context(),
    )
    assert response.status_code == 503
    assert response.json()["error"]["reason"] == "machine_unavailable"
    assert fleet.ctx.redis.llen(fleet.ctx.keys.queue_list("m3")) == 0


def test_internal_routes_need_the_machine_token(fleet: RunningFleet) -> None:
    accepted = fleet.client.submit(fleet.model, "txt2img", {"prompt": "x", "steps": 2}, target="m1")
    url = f"{fleet.local.api_url}/internal/v1/jobs/{accepted['id']}/claim"
    assert httpx.post(url, verify=tls_context()).status_code == 401
    assert httpx.post(url, headers={"Authorization": "Bearer wrong-token"}, verify=tls_context()).status_code == 401
    other = fleet.local.fleet.machines["m2"].token
    assert httpx.post(url, headers={"Authorization": f"Bearer {other}"}, verify=tls_context()).status_code == 403
    assert fleet.client.wait(accepted["id"], timeout_s=120)["state"] == "succeeded"


def test_c02_a_queued_job_survives_its_worker_being_killed_and_runs_once_later(fleet: RunningFleet) -> None:
    running = fleet.client.submit(fleet.model, "txt2img", {"prompt": "long", "steps": 60, **LONG_SIZE}, target="m2")
    waiting = fleet.client.submit(fleet.model, "txt2img", {"prompt": "next", "steps": 2}, target="m2")
    wait_for(lambda: fleet.client.get(running["id"])["state"] == "running", what="the first job to start")
    fleet.local.stop_worker("m2", signal.SIGKILL)
    assert fleet.ctx.redis.llen(fleet.ctx.keys.queue_list("m2")) == 1
    assert fleet.client.get(waiting["id"])["state"] == "queued"
    fleet.local.start_worker("m2")
    done = fleet.client.wait(waiting["id"], timeout_s=120)
    assert done["state"] == "succeeded"
    assert [e.event for e in fleet.ctx.journal.events(waiting["id"])].count("running") == 1
    # The killed job is never re-run by itself: reconciliation marks it interrupted (R19).
    wait_for(lambda: fleet.client.get(running["id"])["state"] == "interrupted", what="reconciliation")
    assert fleet.client.get(running["id"])["reason"] in {"worker_lost", "worker_restarted"}
    assert [e.event for e in fleet.ctx.journal.events(running["id"])].count("running") == 1


def test_c03_cancel_while_the_worker_is_offline_and_the_job_never_runs(fleet: RunningFleet) -> None:
    busy = fleet.client.submit(fleet.model, "txt2img", {"prompt": "long", "steps": 60, **LONG_SIZE}, target="m1")
    doomed = fleet.client.submit(fleet.model, "txt2img", {"prompt": "never", "steps": 2}, target="m1")
    wait_for(lambda: fleet.client.get(busy["id"])["state"] == "running", what="the first job to start")
    fleet.local.stop_worker("m1", signal.SIGKILL)  # offline: it could not hear any broadcast
    assert fleet.client.cancel(doomed["id"])["state"] == "cancelled"
    assert fleet.ctx.queues.queued_ids("m1") == []
    fleet.local.start_worker("m1")
    fleet.local.wait_online(["m1"], model_id=fleet.model)
    probe = fleet.client.submit(fleet.model, "txt2img", {"prompt": "after", "steps": 2}, target="m1")
    assert fleet.client.wait(probe["id"], timeout_s=120)["state"] == "succeeded"  # m1 works again...
    events = [e.event for e in fleet.ctx.journal.events(doomed["id"])]
    assert events == ["queued", "cancelled"]  # ...and the cancelled job never ran
    with pytest.raises(ApiError) as refused:
        fleet.client.cancel(probe["id"])
    assert refused.value.status_code == 409 and "succeeded" in refused.value.message


def test_r20_an_idempotent_retry_over_http_returns_the_original(fleet: RunningFleet) -> None:
    params = {"prompt": "retry me", "steps": 2}
    first = fleet.client.submit(fleet.model, "txt2img", params, target="m2", idempotency_key="e2e-key-1")
    again = fleet.client.submit(fleet.model, "txt2img", params, target="m2", idempotency_key="e2e-key-1")
    assert again["id"] == first["id"]
    with pytest.raises(ApiError) as reused:
        fleet.client.submit(fleet.model, "txt2img", {"prompt": "other"}, target="m2", idempotency_key="e2e-key-1")
    assert reused.value.status_code == 422 and reused.value.reason == "idempotency_key_reused"
    assert fleet.client.wait(first["id"], timeout_s=120)["state"] == "succeeded"
    journaled = [j for j in fleet.ctx.journal.list() if (j.idempotency_key or "").endswith("/e2e-key-1")]
    assert [j.idempotency_key for j in journaled] == [f"{journaled[0].api_key_id}/e2e-key-1"]  # the API key's own


def test_r12_warm_models_are_advertised_again_after_redis_loses_them_and_not_after_their_process_died(
    fleet: RunningFleet,
) -> None:
    """Placement prices a cold load by the heartbeat's warm models (R12). Redis lost the warm
    record (a restart without persistence): the worker advertises the model again, instead of
    an empty set until its next load. The pool process that held the model died (an OOM kill):
    its replacement holds nothing, and the heartbeat says so."""
    ctx, machine = fleet.ctx, "m1"

    def warm() -> list[str]:
        raw = ctx.redis.get(ctx.keys.heartbeat(machine))
        return json.loads(raw)["warm_models"] if raw else []

    job = fleet.client.submit(fleet.model, "txt2img", {"prompt": "warm it", "steps": 2}, target=machine)
    assert fleet.client.wait(job["id"], timeout_s=120)["state"] == "succeeded"
    wait_for(lambda: warm() == [fleet.model], what="the model warm in m1's heartbeat")
    ctx.redis.delete(ctx.keys.warm(machine))  # as a Redis restart without persistence does
    time.sleep(3 * fleet.local.settings.heartbeat_interval_s)
    wait_for(lambda: ctx.redis.get(ctx.keys.warm(machine)) is not None, timeout_s=10, what="the warm record back")
    assert warm() == [fleet.model]

    pool = pool_process(fleet.local.processes[f"worker-{machine}"].pid)
    pool.kill()  # as the kernel's OOM killer does, between jobs
    wait_for(lambda: warm() == [], timeout_s=30, what="the new pool process's empty warm set")
    again = fleet.client.submit(fleet.model, "txt2img", {"prompt": "cold again", "steps": 2}, target=machine)
    assert fleet.client.wait(again["id"], timeout_s=120)["state"] == "succeeded"
    assert fleet.ctx.journal.get(again["id"]).cold_load is True  # as the heartbeat said
    wait_for(lambda: warm() == [fleet.model], what="the model warm again")


def test_r4_workers_follow_the_registry_without_a_restart(fleet: RunningFleet, tiny_models_dir: Path) -> None:
    """A model registered while the fleet runs is verified by the server's own worker (it shares
    the folder `models add` copies into), so a job for it runs on `server` at once; a model whose
    manifest changed on the server (`homefleet models update` recorded new digests) is withdrawn
    from a worker whose copy is the old one, and stays verified on the server, whose copy is the
    new one. Without a restart, and hashing only the models that changed."""
    ctx, model = fleet.ctx, "tiny-sd-follow"
    ctx.registry.add(tiny_models_dir / "tiny-sd", model_id=model)

    def verified(machine: str) -> list[str]:
        return (ctx.machines.heartbeat(machine) or {}).get("verified_models", [])

    wait_for(lambda: model in verified("server"), timeout_s=60, what="the server's worker to verify the new model")
    job = fleet.client.submit(model, "txt2img", {"prompt": "new", "steps": 2})  # the default target: server
    assert fleet.client.wait(job["id"], timeout_s=120)["state"] == "succeeded"
    assert model not in verified("m1")  # no copy there

    synced = fleet.client.http.post("/v1/machines/m1/sync", json={"models": [model]})
    assert synced.status_code == 202, synced.text
    wait_for(lambda: model in verified("m1"), timeout_s=120, what="m1 to verify the synced copy")

    config = next(ctx.registry.folder(model).rglob("scheduler_config.json"))
    config.write_text(config.read_text() + " ")  # changed on the server
    assert any(check.status == "changed" for check in ctx.registry.verify([model]))  # found, not recorded (R5)
    assert ctx.registry.update(model).changed == [config.relative_to(ctx.registry.folder(model)).as_posix()]
    wait_for(lambda: model not in verified("m1"), timeout_s=60, what="m1 to withdraw its old copy")
    # the server's worker may see the file change before the new manifest and withdraw its copy
    # until the registry's new digests reach it; then it verifies it again, unasked
    wait_for(lambda: model in verified("server"), timeout_s=60, what="the server's worker to verify the new copy")
    log = fleet.local.logs_dir / "worker-m1.log"  # the line follows the withdrawal
    wait_for(
        lambda: f"the registry changed; not verified: {model}" in log.read_text(),
        timeout_s=30,
        what="m1's log to say what the registry's change withdrew",
    )
