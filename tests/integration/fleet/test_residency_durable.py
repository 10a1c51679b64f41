"""Residency commitments (R16) and remembered OOMs (R21) survive Redis losing them: the journal's
database keeps the durable copy, and the server writes Redis again from it at start and in
reconciliation. Real Redis (flushed, as a restart without persistence leaves it), real
journal on SQLite and PostgreSQL, the real API and CLI."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from app.api.server import create_app
from app.context import ServerContext, build_context
from app.core.config import Settings
from app.core.secret_files import write_private
from app.fleet.residency_store import ResidencyStore
from tests.helpers import bring_online, make_fleet, run_cli, settings_env, wait_for

MODEL = "tiny-sd"
OTHER = "tiny-sd-b"
BIG = {"width": 128, "height": 128}
FLEET = make_fleet("m1", "m2")


@pytest.fixture
def settings(sql_settings: Settings) -> Settings:
    """These tests are about SQL: each runs on SQLite and on PostgreSQL (tests/conftest.py)."""
    return sql_settings


@pytest.fixture
def durable_settings(settings: Settings, tmp_path: Path) -> Settings:
    """The session settings with a fleet file, so that CLI subprocesses see machines m1 and m2."""
    fleet_file = tmp_path / "fleet.toml"
    write_private(fleet_file, FLEET.to_toml())
    return settings.model_copy(update={"fleet_file": fleet_file})


class Server:
    """The API over a fresh context; :meth:`restart` closes it and builds another (same Redis and
    database), as a restarted ``homefleet serve`` would."""

    def __init__(self, settings: Settings, models_dir: Path) -> None:
        self.settings = settings
        self.models_dir = models_dir
        self.client: TestClient | None = None
        self.ctx: ServerContext | None = None

    def start(self) -> tuple[TestClient, ServerContext]:
        ctx = build_context(self.settings, FLEET, migrate=True)
        for model_id in (MODEL, OTHER):
            if model_id not in {r.id for r in ctx.registry.list()}:
                ctx.registry.add(self.models_dir / MODEL, model_id)
        for name in FLEET.machines:
            bring_online(ctx, name, {MODEL, OTHER})
        client = TestClient(
            create_app(self.settings, ctx), headers={"Authorization": f"Bearer {self.settings.api_keys[0]}"}
        )
        client.__enter__()  # lifespan: the reconciliation loop's first pass runs now
        self.client, self.ctx = client, ctx
        return client, ctx

    def stop(self) -> None:
        if self.client is not None:
            self.client.__exit__(None, None, None)
            self.client = None

    def restart(self) -> tuple[TestClient, ServerContext]:
        self.stop()
        return self.start()


@pytest.fixture
def server(durable_settings: Settings, tiny_models_dir: Path) -> Iterator[Server]:
    running = Server(durable_settings, tiny_models_dir)
    try:
        yield running
    finally:
        running.stop()


def submit(client: TestClient, target: str, **params: object) -> dict:
    answer = client.post(
        "/v1/jobs", json={"model": MODEL, "kind": "txt2img", "target": target, "params": {"prompt": "x", **params}}
    )
    return {"status": answer.status_code, **answer.json()}


def oom_through_the_worker_api(client: TestClient, machine: str) -> str:
    """A job pinned to ``machine``, claimed and failed with reason ``oom`` over the internal API,
    as a worker reports a real OOM (R21). Returns its id."""
    job_id = submit(client, machine, **BIG)["id"]
    worker = {"Authorization": f"Bearer {FLEET.machines[machine].token}"}
    assert client.post(f"/internal/v1/jobs/{job_id}/claim", headers=worker).status_code == 200
    failed = client.post(
        f"/internal/v1/jobs/{job_id}/failure",
        headers=worker,
        json={"reason": "oom", "message": "RuntimeError: CUDA error: out of memory"},
    )
    assert failed.status_code == 200, failed.text
    return job_id


def test_r16_r21_facts_survive_a_redis_flush_through_restart_and_reconcile(server: Server) -> None:
    client, ctx = server.start()
    assert client.put("/v1/machines/m1/residency", json={"models": [MODEL]}).status_code == 200
    job_id = oom_through_the_worker_api(client, "m2")
    ctx.residency.record_oom("m2", MODEL, "txt2img", 256 * 256, "larger")  # the smallest size is kept, in both
    store = ResidencyStore(ctx.engine)
    assert store.commitments() == {"m1": frozenset({MODEL})}
    [durable] = store.ooms()
    assert (durable.machine, durable.model_id, durable.kind, durable.size, durable.job_id) == (
        "m2",
        MODEL,
        "txt2img",
        128 * 128,
        job_id,
    )

    ctx.redis.flushdb()  # Redis restarted without persistence: the hot copy is gone
    assert ctx.machines.view("m1").commitments == frozenset() and ctx.residency.ooms("m2") == []

    client, ctx = server.restart()  # the server's start restores Redis from the database
    wait_for(lambda: ctx.residency.commitments("m1") == {MODEL})
    assert ctx.residency.oom_sizes("m2") == {(MODEL, "txt2img"): 128 * 128}
    refused = submit(client, "m2", **BIG)  # the identical pinned job is refused at submission
    assert (refused["status"], refused["error"]["reason"]) == (422, "remembered_oom")
    assert client.get("/v1/machines/m1/residency").json()["models"] == [MODEL]

    ctx.redis.flushdb()  # again, and this time a reconciliation pass repairs it
    for name in FLEET.machines:
        bring_online(ctx, name, {MODEL, OTHER})
    report = ctx.reconciler().run_once()
    assert report.residency_restored and "restored from the database" in str(report)
    assert ctx.machines.view("m1").commitments == {MODEL}
    assert submit(client, "m2", **BIG)["error"]["reason"] == "remembered_oom"
    assert not ctx.reconciler().run_once().residency_restored  # Redis has its copy: nothing rewritten


def test_r16_r21_cleared_and_changed_facts_stay_so_after_redis_loses_them(server: Server) -> None:
    client, ctx = server.start()
    wait_for(lambda: ctx.redis.exists(ctx.keys.residency_durable()))  # the first pass has run
    assert client.put("/v1/machines/m1/residency", json={"models": [MODEL, OTHER]}).status_code == 200
    assert client.put("/v1/machines/m1/residency", json={"models": [OTHER]}).status_code == 200
    oom_through_the_worker_api(client, "m2")
    env = settings_env(server.settings)
    listed = run_cli("oom", "list", env=env).stdout
    assert "m2" in listed and MODEL in listed and "16384" in listed
    assert "1 remembered OOMs cleared" in run_cli("oom", "clear", "m2", env=env).stdout

    ctx.redis.flushdb()
    for name in FLEET.machines:
        bring_online(ctx, name, {MODEL, OTHER})
    assert ctx.reconciler().run_once().residency_restored
    assert ctx.residency.commitments("m1") == {OTHER}  # the last commitment, not the first
    assert ctx.residency.ooms("m2") == [] and ResidencyStore(ctx.engine).ooms() == []
    assert submit(client, "m2", **BIG)["status"] == 202  # the cleared record stays cleared


def test_r16_r21_an_empty_database_adopts_the_facts_redis_holds(server: Server) -> None:
    """The first start after the upgrade that added the tables: Redis already holds the facts."""
    _, ctx = server.start()
    wait_for(lambda: ctx.redis.exists(ctx.keys.residency_durable()))
    ctx.redis.delete(ctx.keys.residency_durable())  # as before the upgrade: no marker, facts only in Redis
    ctx.redis.sadd(ctx.keys.residency("m1"), MODEL)
    ctx.redis.hset(ctx.keys.oom("m2"), f"{MODEL}\ttxt2img", json.dumps({"size": 4096, "job_id": "j", "at": 1.0}))
    restored = ctx.residency.restore()
    assert (restored.source, restored.commitments, restored.ooms) == ("redis", 1, 1)
    store = ResidencyStore(ctx.engine)
    assert store.commitments() == {"m1": frozenset({MODEL})} and [r.size for r in store.ooms()] == [4096]
    assert ctx.residency.commitments("m1") == {MODEL}  # nothing wiped
