"""Sync's server side (R6), the server's full rehash (C07) and a tampered upload (R2), on a
real Redis, real Celery publishing and the real HTTP app; no worker reads the queues here (the
worker's sync task runs in this process against the real API where a test needs it)."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from PIL import Image

from app.api.server import create_app
from app.context import ServerContext, build_context
from app.core.celery_app import SYNC_TASK
from app.core.config import Settings, WorkerSettings
from app.core.digest import bytes_digest, file_digest
from app.core.errors import Conflict, MachineUnavailable, Rejected
from app.core.lora_files import LORA_WEIGHTS
from app.core.protocol import SyncFinish
from app.core.secret_files import write_private
from app.core.states import JobState
from app.db.tables import Job
from app.devtools.localfleet import LocalFleet
from app.devtools.redis_server import free_port
from app.devtools.tiny_models import make_tiny_lora
from app.jobs.sync import Syncs, SyncState
from tasks import runtime
from tasks import sync as worker_sync
from tests.helpers import TEST_API_KEY, bring_online, make_fleet, run_cli, settings_env, wait_for


def syncs_of(ctx: ServerContext) -> Syncs:
    return ctx.syncs()


@pytest.fixture
def model(ctx: ServerContext, tiny_models_dir: Path) -> str:
    return ctx.registry.add(tiny_models_dir / "tiny-sd").id


def test_r6_sync_is_refused_with_409_while_the_machine_has_work(ctx: ServerContext, model: str) -> None:
    bring_online(ctx, "m1", {model})
    job = ctx.dispatcher.submit(model, "txt2img", {"prompt": "x"}, "m1").job
    with pytest.raises(Conflict) as refused:
        syncs_of(ctx).start("m1", [model])
    assert refused.value.status_code == 409 and refused.value.reason == "machine_busy"
    assert "1 job(s) queued or running" in refused.value.message
    assert ctx.redis.get(ctx.keys.syncing("m1")) is None  # nothing reserved
    assert ctx.redis.llen(ctx.keys.queue_list("m1")) == 1  # nothing published behind the job
    # Running counts as busy too.
    ctx.journal.claim(job.id, "m1")
    ctx.redis.delete(ctx.keys.queue_list("m1"))
    with pytest.raises(Conflict, match=r"machine_busy|has work"):
        syncs_of(ctx).start("m1", [model])


def test_r6_a_sync_reserves_its_machine_and_waits_in_its_queue(ctx: ServerContext, model: str) -> None:
    bring_online(ctx, "m1", {model})
    bring_online(ctx, "server", {model})
    record = syncs_of(ctx).start("m1", [model])
    assert record["state"] == SyncState.queued and record["models"] == [model]
    assert record["bytes_total"] == ctx.registry.get(model).total_bytes
    assert ctx.redis.get(ctx.keys.syncing("m1")) == record["id"]
    [message] = [json.loads(raw) for raw in ctx.redis.lrange(ctx.keys.queue_list("m1"), 0, -1)]
    assert (message["headers"]["task"], message["headers"]["id"]) == (SYNC_TASK, record["id"])
    # While it holds m1, nothing is placed there: pinned is refused, Auto goes elsewhere.
    with pytest.raises(MachineUnavailable) as refused:  # 503: it is temporary
        ctx.dispatcher.submit(model, "txt2img", {"prompt": "x"}, "m1")
    assert refused.value.reason == "machine_syncing"
    assert ctx.dispatcher.submit(model, "txt2img", {"prompt": "x"}, "auto").job.machine == "server"
    with pytest.raises(Conflict) as again:
        syncs_of(ctx).start("m1", [model])
    assert again.value.reason == "machine_syncing"
    # The worker claims it once; a second delivery is refused.
    grant = syncs_of(ctx).claim(record["id"], "m1")
    assert grant.models[model].files == ctx.registry.manifest(model).files
    with pytest.raises(Conflict) as second:
        syncs_of(ctx).claim(record["id"], "m1")
    assert second.value.reason == "sync_claimed"
    done = syncs_of(ctx).finish(record["id"], "m1", SyncFinish(succeeded=True, verified=[model]))
    assert done["state"] == SyncState.succeeded and ctx.redis.get(ctx.keys.syncing("m1")) is None
    shown = syncs_of(ctx).get(record["id"])  # every timestamp a number of Unix seconds
    assert all(isinstance(shown[f], float) for f in ("created_at", "claimed_at", "finished_at"))
    assert shown["created_at"] <= shown["claimed_at"] <= shown["finished_at"]
    assert ctx.dispatcher.submit(model, "txt2img", {"prompt": "x"}, "m1").job.machine == "m1"


def test_r6_sync_to_an_offline_or_unknown_machine_is_refused(ctx: ServerContext, model: str) -> None:
    with pytest.raises(MachineUnavailable):
        syncs_of(ctx).start("m2", [model])
    with pytest.raises(Rejected) as unknown:
        syncs_of(ctx).start("mars", [model])
    assert unknown.value.reason == "unknown_machine"
    assert ctx.redis.llen(ctx.keys.queue_list("m2")) == 0


def test_r6_a_reservation_that_expires_reads_interrupted_and_frees_the_machine(
    settings: Settings, model: str, ctx: ServerContext
) -> None:
    short = Syncs(
        settings.model_copy(update={"sync_reservation_ttl_s": 0.3}),
        ctx.redis,
        ctx.celery,
        ctx.fleet,
        ctx.journal,
        ctx.registry,
        ctx.machines,
        ctx.lock,
    )
    bring_online(ctx, "m1", {model})
    record = short.start("m1", [model])
    short.claim(record["id"], "m1")
    short.progress(record["id"], "m1", 0, 1000, f"{model}/unet/diffusion_pytorch_model.safetensors")
    deadline = time.monotonic() + 10
    while ctx.redis.exists(ctx.keys.syncing("m1")) and time.monotonic() < deadline:
        time.sleep(0.05)
    after = short.get(record["id"])
    assert after["state"] == SyncState.interrupted and "reservation expired" in after["message"]
    with pytest.raises(Conflict) as lost:
        short.progress(record["id"], "m1", 0, 2000, "")
    assert lost.value.reason == "sync_not_reserved"  # the worker stops copying


def test_r6_before_its_claim_a_sync_waits_sync_claim_wait_s_not_the_reservation_ttl(
    settings: Settings, model: str, ctx: ServerContext
) -> None:
    """A worker still starting (verifying its folder) claims later than one reservation TTL:
    the sync is still its to run. Only a sync unclaimed for ``sync_claim_wait_s`` lapses."""

    def syncs(**update: float) -> Syncs:
        return Syncs(
            settings.model_copy(update={"sync_reservation_ttl_s": 0.3, **update}),
            ctx.redis,
            ctx.celery,
            ctx.fleet,
            ctx.journal,
            ctx.registry,
            ctx.machines,
            ctx.lock,
        )

    bring_online(ctx, "m1", {model})
    patient = syncs()  # the default claim wait: 120 s
    record = patient.start("m1", [model])
    time.sleep(0.9)  # three reservation TTLs, unclaimed
    assert patient.get(record["id"])["state"] == SyncState.queued
    patient.claim(record["id"], "m1")
    assert patient.get(record["id"])["state"] == SyncState.running
    assert 0 < ctx.redis.pttl(ctx.keys.syncing("m1")) <= 300  # claimed: back to the short TTL
    wait_for(lambda: not ctx.redis.exists(ctx.keys.syncing("m1")), timeout_s=10, what="the claimed sync to lapse")

    ctx.redis.delete(ctx.keys.queue_list("m1"))  # the first sync's message: no worker reads it here
    impatient = syncs(sync_claim_wait_s=0.5)
    second = impatient.start("m1", [model])
    wait_for(
        lambda: impatient.get(second["id"])["state"] == SyncState.interrupted,
        timeout_s=10,
        what="the unclaimed sync to lapse after its claim wait",
    )
    with pytest.raises(Conflict) as late:
        impatient.claim(second["id"], "m1")
    assert late.value.reason == "sync_not_reserved"


def test_r6_a_sync_finished_while_it_is_read_reads_succeeded_not_interrupted(ctx: ServerContext, model: str) -> None:
    """The reader's race: ``get`` reads the record (``running``), the worker's ``finish`` writes
    ``succeeded`` and releases the reservation, then ``get`` finds no reservation. That read is
    the finish's, not an expiry: ``homefleet sync`` (which polls ``get``) once printed
    ``interrupted`` for a sync its worker had finished in 0.6 s."""
    syncs = syncs_of(ctx)
    bring_online(ctx, "m1", {model})
    record = syncs.start("m1", [model])
    syncs.claim(record["id"], "m1")
    reservation = ctx.keys.syncing("m1")
    plain_get = ctx.redis.get
    finished: list[str] = []

    def get_after_the_finish(key: str) -> object:
        if key == reservation and not finished:  # between the record's read and the reservation's
            finished.append("finishing")  # once: finish() reads the record through get() too
            finished[0] = syncs.finish(
                record["id"],
                "m1",
                SyncFinish(succeeded=True, message="all files verified", verified=[model], results=[]),
            )["state"]
        return plain_get(key)

    ctx.redis.get = get_after_the_finish  # type: ignore[method-assign]
    try:
        read = syncs.get(record["id"])
    finally:
        del ctx.redis.get
    assert finished == [SyncState.succeeded]  # the finish did run inside the read
    assert (read["state"], read["message"], read["verified"]) == (SyncState.succeeded, "all files verified", [model])


SHORT_TTL_S = 4.0  # seconds: short, yet renewals every third of it survive a loaded CI host


@pytest.fixture
def short_api(settings: Settings) -> Iterator[tuple[LocalFleet, ServerContext]]:
    """The real API (``homefleet serve``) with a 2 s sync reservation, and a context on its
    Redis and journal."""
    fleet = make_fleet("m1", "m2")
    fleet_file = settings.data_dir.parent / "fleet.toml"
    write_private(fleet_file, fleet.to_toml())
    short = settings.model_copy(
        update={"sync_reservation_ttl_s": SHORT_TTL_S, "fleet_file": fleet_file, "api_port": free_port()}
    )
    local = LocalFleet(short, fleet, fleet_file, forkserver=True)
    context = build_context(short, fleet, migrate=True)
    try:
        local.start_api()
        yield local, context
    finally:
        local.stop()
        context.close()


def test_r6_the_reservation_is_renewed_while_a_file_hashes_longer_than_its_ttl(
    short_api: tuple[LocalFleet, ServerContext], tiny_models_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    local, ctx = short_api
    model = ctx.registry.add(tiny_models_dir / "tiny-sd").id
    worker = WorkerSettings(
        machine="m1",
        models_dir=tmp_path / "m1-models",
        server_url=local.api_url,
        worker_token=ctx.fleet.machines["m1"].token,
        redis_url=ctx.settings.redis_url,
    )
    rt = runtime.WorkerRuntime(worker, uuid.uuid4().hex)
    assert rt.server is not None  # its clients and device made before the sync starts, as a worker's are
    monkeypatch.setattr(runtime, "_runtime", rt)
    bring_online(ctx, "m1", set())
    record = syncs_of(ctx).start("m1", [model])
    # The unet's hash takes three TTLs (as a large file's would); the renewal is the real one.
    held: list[bool] = []
    real_digest = worker_sync.file_digest

    def slow_digest(path: Path, *args: object) -> str:
        if path.name.startswith(".diffusion_pytorch_model") and path.parent.name == "unet":
            time.sleep(3 * SHORT_TTL_S)
            held.append(ctx.redis.get(ctx.keys.syncing("m1")) == record["id"])
        return real_digest(path, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(worker_sync, "file_digest", slow_digest)
    worker_sync.sync(record["id"])
    done = syncs_of(ctx).get(record["id"])
    assert done["state"] == SyncState.succeeded, done["message"]
    assert held == [True]  # still reserved after the long hash: nothing could be placed on m1 meanwhile
    unet = "unet/diffusion_pytorch_model.safetensors"
    assert {r["path"]: r["status"] for r in done["results"]}[unet] == "copied"
    assert (worker.models_dir / model / unet).read_bytes() == (ctx.registry.folder(model) / unet).read_bytes()
    # The renewal stopped with the sync: no thread left, the reservation released by the finish.
    assert not [t for t in threading.enumerate() if t.name == "homefleet-sync-renewal"]
    assert ctx.redis.get(ctx.keys.syncing("m1")) is None


def test_c07_models_verify_finds_an_in_place_change_the_cache_cannot_see(ctx: ServerContext, model: str) -> None:
    path = ctx.registry.folder(model) / "unet" / "diffusion_pytorch_model.safetensors"
    before = ctx.registry.manifest(model)
    registered = next(f.digest for f in before.files if f.path == "unet/diffusion_pytorch_model.safetensors")
    stat = path.stat()
    with open(path, "r+b") as handle:  # same inode, same size; then the mtime is put back
        handle.seek(-1, os.SEEK_END)
        last = handle.read(1)
        handle.seek(-1, os.SEEK_END)
        handle.write(bytes([last[0] ^ 0xFF]))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    # The (size, mtime_ns, inode) cache cannot see it; the full rehash does, and records nothing (R5).
    assert ctx.registry.manifest(model) == before
    for _ in range(2):
        changed = [c for c in ctx.registry.verify() if c.status != "ok"]
        assert [(c.path, c.status, c.recorded) for c in changed] == [
            ("unet/diffusion_pytorch_model.safetensors", "changed", registered)
        ]
        assert changed[0].actual == file_digest(path) != registered
    assert ctx.registry.registered_manifest(model) == before


def test_c07_homefleet_models_verify_exits_1_naming_the_file_and_records_nothing(
    ctx: ServerContext, model: str
) -> None:
    path = ctx.registry.folder(model) / "vae" / "diffusion_pytorch_model.safetensors"
    registered = file_digest(path)
    stat = path.stat()
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    with open(path, "r+b") as handle:
        handle.write(bytes(data))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    env = {**os.environ, **settings_env(ctx.settings), "COLUMNS": "300"}
    for args in (["models", "verify"], ["models", "verify", model]):  # the second finds it again: nothing recorded
        run = subprocess.run(
            [sys.executable, "-m", "app.cli", *args], env=env, capture_output=True, text=True, timeout=120
        )
        assert run.returncode == 1, run.stdout + run.stderr
        assert "1 changed or missing" in run.stdout
        assert (
            f"changed: {model} vae/diffusion_pytorch_model.safetensors registered {registered} "
            f"actual {file_digest(path)}"
        ) in run.stdout, run.stdout
        assert "homefleet models update ID" in run.stdout
    assert {f.path: f.digest for f in ctx.registry.registered_manifest(model).files}[
        "vae/diffusion_pytorch_model.safetensors"
    ] == registered


@pytest.fixture
def filed(settings: Settings) -> Iterator[ServerContext]:
    """The server's parts over a fleet of server, m1 and m2 written to a fleet file, which a CLI
    command run with :func:`settings_env` reads too."""
    fleet = make_fleet("m1", "m2")
    fleet_file = settings.data_dir.parent / "fleet.toml"
    write_private(fleet_file, fleet.to_toml())
    context = build_context(settings.model_copy(update={"fleet_file": fleet_file}), fleet, migrate=True)
    try:
        yield context
    finally:
        context.close()


@pytest.mark.parametrize("updated", ["base", "adapter"])
def test_r6_models_update_of_an_unchanged_folder_records_withdraws_and_syncs_nothing(
    filed: ServerContext, tiny_models_dir: Path, tmp_path: Path, updated: str
) -> None:
    """``homefleet models update`` of a model whose server folder holds what is registered (a
    base model, or a LoRA adapter) says so in one line and does nothing: the registered files
    and figures stay, and m1, which advertises the model, keeps it, with no sync reserved or
    queued there (one would take m1 from its jobs until it ended, R6). A file that did change
    is still recorded and synced to m1."""
    ctx = filed
    base = ctx.registry.add(tiny_models_dir / "tiny-sd").id
    adapter = ctx.registry.add(make_tiny_lora(tiny_models_dir / "tiny-sd", tmp_path / "lora"), adapter_of="sd1").id
    model = {"base": base, "adapter": adapter}[updated]
    bring_online(ctx, "m1", {base, adapter})
    manifest, record = ctx.registry.registered_manifest(model), ctx.registry.get(model)
    env: dict[str, str | None] = {**settings_env(ctx.settings), "COLUMNS": "300"}
    done = run_cli("models", "update", model, env=env)
    assert done.stdout.splitlines() == [
        f"{model}: no file changed; nothing to do (nothing recorded or withdrawn, no sync started)"
    ], done.stdout
    assert ctx.registry.registered_manifest(model) == manifest
    again = ctx.registry.get(model)
    assert (again.total_bytes, again.weights_bytes) == (record.total_bytes, record.weights_bytes)
    assert ctx.redis.smembers(ctx.keys.verified("m1")) == {base, adapter}  # still advertised (R4)
    assert ctx.redis.get(ctx.keys.syncing("m1")) is None  # m1 not reserved: its jobs are still placed there
    assert ctx.redis.llen(ctx.keys.queue_list("m1")) == 0  # no sync published

    if updated == "base":  # one file changed: recorded, and m1's copy is the old content
        config = ctx.registry.folder(base) / "scheduler" / "scheduler_config.json"
        config.write_text(config.read_text() + "\n")
    else:  # other LoRA weights of the same shape under the same name
        other = make_tiny_lora(tiny_models_dir / "tiny-sd", tmp_path / "other", seed=1) / LORA_WEIGHTS
        shutil.copyfile(other, ctx.registry.folder(adapter) / LORA_WEIGHTS)
    done = run_cli("models", "update", model, env=env)
    assert f"updated {model}: 1 changed, 0 added, 0 removed" in done.stdout, done.stdout
    assert "m1 held the old content (withdrawn there now): sync " in done.stdout, done.stdout
    assert ctx.redis.get(ctx.keys.syncing("m1")) is not None


@pytest.fixture
def api(settings: Settings) -> Iterator[tuple[TestClient, ServerContext]]:
    context = build_context(settings, make_fleet("m1", "m2"), migrate=True)
    try:
        yield TestClient(create_app(settings, context), headers={"Authorization": f"Bearer {TEST_API_KEY}"}), context
    finally:
        context.close()


def png_bytes() -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (8, 8), (1, 2, 3)).save(buffer, format="PNG")
    return buffer.getvalue()


def claimed_on_m1(client: TestClient, ctx: ServerContext, tiny_models_dir: Path) -> tuple[Job, dict[str, str]]:
    """A tiny-sd job journaled on m1 and claimed by m1's worker: (the job, m1's auth header)."""
    model = ctx.registry.add(tiny_models_dir / "tiny-sd").id
    job = ctx.journal.add(
        Job(state=JobState.queued, model_id=model, kind="txt2img", params={}, target="m1", machine="m1")
    )
    auth = {"Authorization": f"Bearer {ctx.fleet.machines['m1'].token}"}
    assert client.post(f"/internal/v1/jobs/{job.id}/claim", headers=auth).status_code == 200
    return job, auth


@pytest.mark.parametrize("tamper", ["bytes_changed", "not_an_image"])
def test_r2_a_tampered_upload_is_refused_fails_the_job_and_stores_nothing(
    api: tuple[TestClient, ServerContext], tiny_models_dir: Path, tamper: str
) -> None:
    client, ctx = api
    job, auth = claimed_on_m1(client, ctx, tiny_models_dir)
    data = png_bytes()
    digest = bytes_digest(data)
    if tamper == "bytes_changed":
        data = data[:-1] + bytes([data[-1] ^ 1])  # altered after the worker hashed it
    else:
        data = b"#!/bin/sh\nrm -rf /\n"
        digest = bytes_digest(data)
    form = {"digest": digest, "load_s": "0.1", "run_s": "0.2", "cold_load": "true"}
    response = client.post(
        f"/internal/v1/jobs/{job.id}/result", headers=auth, data=form, files={"file": ("result", data, "image/png")}
    )
    assert response.status_code == 422
    assert response.json()["error"]["reason"] == "integrity"
    failed = ctx.journal.get(job.id)
    assert (failed.state, failed.reason, failed.result_path) == (JobState.failed, "integrity", None)
    results = ctx.settings.results_dir
    assert not results.exists() or not [p for p in results.rglob("*") if p.is_file()]
    refused = client.get(f"/v1/jobs/{job.id}/result")  # the job exists; it has no result
    assert (refused.status_code, refused.json()["error"]["reason"]) == (409, "no_result")


def test_r19_a_claim_the_server_cannot_answer_leaves_no_job_running(
    api: tuple[TestClient, ServerContext], tiny_models_dir: Path
) -> None:
    """The server builds the claim's manifest before the claim: a model file missing on the
    server ends the job (interrupted, model_changed naming the file, R5) instead of a 500
    after the job was marked running with nobody running it."""
    client, ctx = api
    model = ctx.registry.add(tiny_models_dir / "tiny-sd").id
    bring_online(ctx, "m1", {model})
    job = ctx.dispatcher.submit(model, "txt2img", {"prompt": "x"}, "m1").job
    gone = next(p for p in ctx.registry.folder(model).rglob("*.json") if p.name != "model_index.json")
    gone.unlink()
    auth = {"Authorization": f"Bearer {ctx.fleet.machines['m1'].token}"}
    answer = client.post(f"/internal/v1/jobs/{job.id}/claim", headers=auth)
    assert answer.status_code == 409 and answer.json()["error"]["reason"] == "model_changed"
    assert f"{gone.relative_to(ctx.registry.folder(model)).as_posix()}: missing" in answer.json()["error"]["message"]
    ended = ctx.journal.get(job.id)
    assert (ended.state, ended.reason) == (JobState.interrupted, "model_changed")
    assert ctx.machines.reservations.count("m1") == 0  # released
    assert client.post(f"/internal/v1/jobs/{job.id}/claim", headers=auth).status_code == 409  # never runs later


def test_r2_a_result_for_a_job_no_longer_running_is_refused_and_not_stored(
    api: tuple[TestClient, ServerContext], tiny_models_dir: Path
) -> None:
    client, ctx = api
    job, auth = claimed_on_m1(client, ctx, tiny_models_dir)
    ctx.journal.transition(
        job.id, [JobState.running], JobState.interrupted, reason="hung"
    )  # the reconciler gave up on it
    data = png_bytes()
    form = {"digest": bytes_digest(data), "load_s": "0.1", "run_s": "0.2", "cold_load": "true"}
    late = client.post(
        f"/internal/v1/jobs/{job.id}/result", headers=auth, data=form, files={"file": ("result", data, "image/png")}
    )
    assert late.status_code == 409 and late.json()["error"]["reason"] == "not_running"
    assert ctx.journal.get(job.id).state == JobState.interrupted
    results = ctx.settings.results_dir
    assert not results.exists() or not [p for p in results.rglob("*") if p.is_file()]  # no orphan file


def test_r6_the_file_endpoint_needs_a_token_serves_only_manifest_files_and_ranges(
    api: tuple[TestClient, ServerContext], tiny_models_dir: Path
) -> None:
    client, ctx = api
    model = ctx.registry.add(tiny_models_dir / "tiny-sd").id
    url = f"/internal/v1/models/{model}/files/unet/diffusion_pytorch_model.safetensors"
    assert client.get(url).status_code == 401
    auth = {"Authorization": f"Bearer {ctx.fleet.machines['m2'].token}"}
    whole = (ctx.registry.folder(model) / "unet" / "diffusion_pytorch_model.safetensors").read_bytes()
    full = client.get(url, headers=auth)
    assert full.status_code == 200 and full.content == whole
    assert full.headers["x-content-digest"] == bytes_digest(whole)
    part = client.get(url, headers={**auth, "Range": "bytes=1000-"})
    assert part.status_code == 206 and part.content == whole[1000:]
    for path in ("../../journal.db", "unet/nope.bin"):
        refused = client.get(f"/internal/v1/models/{model}/files/{path}", headers=auth)
        assert refused.status_code == 404


def test_r4_a_model_whose_server_copy_is_gone_keeps_its_registered_manifest_and_is_refused_by_sync(
    api: tuple[TestClient, ServerContext], tiny_models_dir: Path
) -> None:
    """One model whose files are gone from the server's folder (deleted, or `models add` run
    with another data folder) made GET /internal/v1/manifest answer 500 for every worker, so no
    restarted worker came online, and sync crashed. The workers' manifest is the REGISTERED one
    (no server file is read for it: a worker's good copy stays verifiable, R4/R5); a sync of
    the model is refused naming what is missing."""
    client, ctx = api
    good = ctx.registry.add(tiny_models_dir / "tiny-sd", model_id="good").id
    gone = ctx.registry.add(tiny_models_dir / "tiny-sd", model_id="gone").id
    (ctx.registry.folder(gone) / "model_index.json").unlink()
    auth = {"Authorization": f"Bearer {ctx.fleet.machines['m1'].token}"}
    answer = client.get("/internal/v1/manifest", headers=auth)
    assert answer.status_code == 200, answer.text
    assert set(answer.json()["models"]) == {good, gone}
    assert answer.json()["models"][gone] == ctx.registry.registered_manifest(gone).model_dump(mode="json")
    bring_online(ctx, "m1", set())
    refused = client.post("/v1/machines/m1/sync", json={"models": [gone]})
    assert refused.status_code == 409 and refused.json()["error"]["reason"] == "model_changed", refused.text
    assert "model_index.json: missing" in refused.json()["error"]["message"]
    assert "homefleet models update gone" in refused.json()["error"]["message"]
