"""Residency commitments (R16, R17) and remembered OOMs (R21) through the HTTP API, on the
real Redis and journal; placement reads them through the Redis-backed ResidencyFacts."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from app.api.server import create_app
from app.context import ServerContext, build_context
from app.core.config import Settings
from tests.helpers import make_fleet

MODEL = "tiny-sd"
OTHER = "tiny-sd-b"


@pytest.fixture
def api(settings: Settings, tiny_models_dir: Path) -> Iterator[tuple[TestClient, ServerContext]]:
    ctx = build_context(settings, make_fleet("m1", "m2"), migrate=True)
    ctx.registry.add(tiny_models_dir / MODEL, MODEL)
    ctx.registry.add(tiny_models_dir / MODEL, OTHER)
    for name in ("server", "m1", "m2"):
        ctx.redis.set(ctx.keys.heartbeat(name), json.dumps({"machine": name, "at": time.time()}), ex=60)
        ctx.redis.sadd(ctx.keys.verified(name), MODEL, OTHER)
    with TestClient(create_app(settings, ctx), headers={"Authorization": f"Bearer {settings.api_keys[0]}"}) as client:
        yield client, ctx


def submit(client: TestClient, target: str, model: str = MODEL, **params: object) -> dict:
    answer = client.post(
        "/v1/jobs", json={"model": model, "kind": "txt2img", "params": {"prompt": "x", **params}, "target": target}
    )
    return {"status": answer.status_code, **answer.json()}


def test_r16_set_commitments_when_idle_and_placement_honours_them(api: tuple[TestClient, ServerContext]) -> None:
    client, ctx = api
    answer = client.put("/v1/machines/m1/residency", json={"models": [MODEL]})
    assert answer.status_code == 200, answer.text
    assert ctx.machines.view("m1").commitments == {MODEL}
    assert client.get("/v1/machines/m1/residency").json()["models"] == [MODEL]
    assert submit(client, "m1", OTHER)["status"] == 202  # unified memory: admitted by headroom (R15)


def test_r16_commitments_refused_with_409_while_work_is_queued(api: tuple[TestClient, ServerContext]) -> None:
    client, ctx = api
    accepted = submit(client, "m2")
    assert accepted["status"] == 202, accepted
    answer = client.put("/v1/machines/m2/residency", json={"models": [MODEL]})
    assert answer.status_code == 409
    error = answer.json()["error"]
    assert error["reason"] == "machine_busy" and "'m2' has 1 jobs queued or running" in error["message"]
    assert ctx.machines.view("m2").commitments == frozenset()
    ctx.redis.delete(ctx.keys.reservations("m2"))  # a message in the line alone also counts (LLEN)
    assert ctx.redis.llen(ctx.keys.queue_list("m2")) == 1
    assert client.put("/v1/machines/m2/residency", json={"models": []}).status_code == 409


def test_r16_unknown_machine_or_model_is_404(api: tuple[TestClient, ServerContext]) -> None:
    client, _ = api
    assert (
        client.put("/v1/machines/nope/residency", json={"models": [MODEL]}).json()["error"]["reason"]
        == "unknown_machine"
    )
    assert client.put("/v1/machines/m1/residency", json={"models": ["nope"]}).status_code == 404


def test_r17_no_video_on_a_machine_holding_commitments(
    api: tuple[TestClient, ServerContext], tiny_models_dir: Path
) -> None:
    client, ctx = api
    ctx.registry.add(tiny_models_dir / "tiny-animatediff", "tiny-video")
    for name in ("m1", "m2"):
        ctx.redis.sadd(ctx.keys.verified(name), "tiny-video")
    assert client.put("/v1/machines/m1/residency", json={"models": [MODEL]}).status_code == 200
    body = {"model": "tiny-video", "kind": "video", "params": {"prompt": "x"}}
    refused = client.post("/v1/jobs", json={**body, "target": "m1"}).json()["error"]
    assert refused["reason"] == "video_on_reserved_machine" and "R17" in refused["message"]
    decision = client.post("/v1/jobs?dry_run=true", json={**body, "target": "auto"}).json()
    assert decision["machines"]["m1"]["reason"] == "video_on_reserved_machine"
    assert decision["machines"]["m2"]["eligible"]
    # Committing a video-only model would keep every job of it off that machine (R17): refused.
    answer = client.put("/v1/machines/m2/residency", json={"models": ["tiny-video"]})
    assert answer.status_code == 422 and answer.json()["error"]["reason"] == "video_model_not_committable"
    assert "R17" in answer.json()["error"]["message"]
    assert ctx.residency.commitments("m2") == frozenset()


def test_r21_remembered_oom_refuses_same_or_larger_and_auto_skips(api: tuple[TestClient, ServerContext]) -> None:
    client, ctx = api
    ctx.residency.record_oom("m1", MODEL, "txt2img", 128 * 128, "job-1")
    ctx.residency.record_oom("m1", MODEL, "txt2img", 256 * 256, "job-2")  # a larger one: the smallest is kept
    assert ctx.machines.view("m1").oom_sizes == {(MODEL, "txt2img"): 128 * 128}
    refused = submit(client, "m1", width=128, height=128)
    assert refused["status"] == 422 and refused["error"]["reason"] == "remembered_oom"
    assert submit(client, "m1", width=64, height=64)["status"] == 202  # smaller still runs there
    decision = client.post(
        "/v1/jobs?dry_run=true",
        json={
            "model": MODEL,
            "kind": "txt2img",
            "target": "auto",
            "params": {"prompt": "x", "width": 128, "height": 128},
        },
    )
    assert decision.json()["machines"]["m1"]["reason"] == "remembered_oom"
    [listed] = client.get("/v1/ooms").json()
    assert (listed["machine"], listed["model_id"], listed["size"], listed["job_id"]) == ("m1", MODEL, 16384, "job-1")
    assert client.delete("/v1/ooms", params={"machine": "m1"}).json()["cleared"] == 1
    assert submit(client, "m1", width=128, height=128)["status"] == 202
