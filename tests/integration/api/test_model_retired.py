"""``homefleet models retire ID`` (R1, R4): a model registered by mistake is taken out of
service for good, its record kept. Refused while a job of it is queued or running; once
retired it is listed, defaulted to and submitted to no more, by the server that was already
running (a warm registry and a cached estimator) as by a new one, and its id stays taken.
Real Redis, real journal, the real ASGI app, the CLI in a process of its own; no worker runs
(jobs stay queued)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlmodel import Session, select

from app.api.routes.images import default_model
from app.context import ServerContext, build_context
from app.core.config import Settings
from app.core.errors import NotFound
from app.core.states import JobState
from app.db.tables import Job
from routing.estimate import readable_bytes
from tests.helpers import api_with_copies, make_fleet, run_cli, settings_env

BAD, MODEL = "a-bad", "tiny-sd"  # BAD sorts first: the default of every route that takes no model


@pytest.fixture
def api(settings: Settings, tiny_models_dir: Path) -> Iterator[tuple[TestClient, ServerContext]]:
    with api_with_copies(settings, tiny_models_dir / MODEL, BAD, MODEL) as (client, ctx):
        yield client, ctx


def submit(client: TestClient, model: str) -> Any:
    return client.post(
        "/v1/jobs",
        json={"model": model, "kind": "txt2img", "target": "auto", "params": {"prompt": "a cat", "steps": 2}},
    )


def retire(settings: Settings, *args: str) -> tuple[int, str]:
    done = run_cli("models", "retire", *args, env=settings_env(settings), check=False)
    return done.returncode, " ".join((done.stdout + done.stderr).split())  # rich wraps long lines


def test_r1_retire_is_refused_while_a_job_of_the_model_is_queued_naming_it(
    api: tuple[TestClient, ServerContext], settings: Settings
) -> None:
    client, _ = api
    queued = submit(client, BAD)
    assert queued.status_code == 202, queued.text
    job_id = queued.json()["id"]
    code, said = retire(settings, BAD)
    assert code == 2 and "model_in_use" in said and job_id in said and "cancel" in said, said
    assert BAD in [m["id"] for m in client.get("/v1/models").json()["data"]]  # nothing recorded
    assert submit(client, BAD).status_code == 202  # still in service

    code, said = retire(settings, "no-such-model")
    assert code == 2 and "unknown_model" in said, said


def test_r1_a_retired_model_leaves_the_running_servers_listings_defaults_and_submissions(
    api: tuple[TestClient, ServerContext], settings: Settings
) -> None:
    """The server context was built, and its caches warmed by a submission, BEFORE the CLI
    retired the model in another process: it refuses the model at once, without a restart."""
    client, ctx = api
    first = submit(client, BAD)  # warms the server's registry cache and its placement estimator
    assert first.status_code == 202, first.text
    assert default_model(ctx, "txt2img") == BAD
    assert client.post(f"/v1/jobs/{first.json()['id']}/cancel").status_code == 200
    mark = ctx.redis.get(ctx.keys.registry_changed())

    code, said = retire(settings, BAD)
    assert code == 0 and f"retired {BAD}" in said and str(ctx.registry.folder(BAD)) in said, said
    assert ctx.registry.folder(BAD).is_dir()  # its files stay without --delete-files

    assert ctx.redis.get(ctx.keys.registry_changed()) != mark  # every process re-reads; workers withdraw it (R4)
    assert default_model(ctx, "txt2img") == MODEL  # the next by id
    assert [m["id"] for m in client.get("/v1/models").json()["data"]] == [MODEL]
    assert client.get(f"/v1/models/{BAD}").json()["retired_at"] is not None  # still described, for its jobs
    assert client.get(f"/v1/models/{MODEL}").json()["retired_at"] is None
    assert [m["id"] for m in client.get("/info").json()["models"]] == [MODEL]
    refused = submit(client, BAD)
    assert refused.status_code == 404, refused.text
    error = refused.json()["error"]
    assert (error["reason"], error["param"]) == ("model_retired", "model") and "in service: tiny-sd" in error["message"]
    openai = client.post("/v1/images/generations", json={"prompt": "a cat", "model": BAD})
    assert openai.status_code == 404 and openai.json()["error"]["code"] == "model_retired", openai.text
    kept = client.put("/v1/machines/m1/residency", json={"models": [BAD]})  # nothing of it to keep warm
    assert kept.status_code == 404 and kept.json()["error"]["reason"] == "model_retired", kept.text
    assert client.get(f"/v1/jobs/{first.json()['id']}").json()["state"] == "cancelled"  # its history stays
    with Session(ctx.engine) as session:  # every refusal journaled with its reason, as unknown_model's are
        rejected = session.exec(select(Job).where(Job.model_id == BAD, Job.state == JobState.rejected)).all()
    assert {j.reason for j in rejected} == {"model_retired"} and len(rejected) == 2
    assert submit(client, MODEL).status_code == 202

    added = run_cli(
        "models", "add", str(ctx.registry.folder(MODEL)), "--id", BAD, env=settings_env(settings), check=False
    )
    assert added.returncode == 2 and "model_id_taken" in added.stderr, added.stderr  # its id stays taken
    assert "`homefleet models list --all` lists every id" in " ".join(added.stderr.split()), added.stderr
    unknown = submit(client, "no-such-model").json()["error"]
    assert unknown["reason"] == "unknown_model" and unknown["message"].endswith("in service: tiny-sd"), unknown
    listed = run_cli("models", "list", env=settings_env(settings)).stdout
    assert BAD not in listed and MODEL in listed
    wide = run_cli("models", "list", env={**settings_env(settings), "COLUMNS": "200"}).stdout
    lines = [line.replace("┃", "│") for line in wide.splitlines()]
    cells = [[c.strip() for c in line.split("│")[1:-1]] for line in lines if "│" in line]
    assert cells[0][:6] == ["id", "family", "kinds", "precision", "on disk / loaded", "source"], wide
    [row] = [r for r in cells if r[0] == MODEL]
    record = ctx.registry.get(MODEL)
    assert record.weights_bytes is not None and record.weights_bytes != record.total_bytes  # two figures
    sizes = f"{readable_bytes(record.total_bytes)} / {readable_bytes(record.weights_bytes)}"
    assert row[3:6] == ["fp32", sizes, "diffusers"], wide
    everything = run_cli("models", "list", "--all", env=settings_env(settings)).stdout
    assert BAD in everything and "retired" in everything

    code, said = retire(settings, BAD, "--delete-files")
    assert code == 0 and "already retired" in said and "deleted its files" in said, said
    assert "nothing changed" not in said, said  # its files were deleted: something did
    assert not ctx.registry.folder(BAD).exists()

    # `models verify` of it: marked retired, its missing files fail nothing and no update is suggested
    verified = run_cli("models", "verify", BAD, env=settings_env(settings), check=False)
    said = " ".join(verified.stdout.split())
    assert verified.returncode == 0 and f"{BAD} (retired)" in said, said
    assert "its files were deleted" in said and "models update" not in said, said
    assert "missing: " not in said, said  # no line per deleted file
    verified = run_cli("models", "verify", env=settings_env(settings), check=False)  # every model in service
    assert verified.returncode == 0 and BAD not in verified.stdout, verified.stdout


def test_r14_a_submission_validated_before_the_retirement_is_refused_under_the_fleet_lock(
    api: tuple[TestClient, ServerContext], settings: Settings
) -> None:
    """The retirement holds the fleet lock and replaces the registry's change mark: a decision
    taken after it (a submission whose checks passed before it) re-reads the models and refuses
    the retired one instead of placing it with a stale estimator."""
    _, ctx = api
    assert BAD in ctx.dispatcher.snapshot(BAD).estimator.models  # the estimator is cached with it
    other = build_context(settings, make_fleet("m1"))  # the CLI's process
    try:
        with other.lock.held("retire"):
            other.registry.retire(BAD)
    finally:
        other.close()
    with pytest.raises(NotFound) as refused:
        ctx.dispatcher.snapshot(BAD)
    assert refused.value.reason == "model_retired"
    with pytest.raises(NotFound) as unsynced:  # nor is it copied to a machine again
        ctx.syncs().start("m1", [BAD])
    assert unsynced.value.reason == "model_retired"
    assert MODEL in ctx.dispatcher.snapshot(MODEL).estimator.models


def test_the_hugging_face_placeholder_names_a_model_only_while_one_of_that_id_is_in_service(
    settings: Settings, tiny_models_dir: Path
) -> None:
    """huggingface_hub sends ``"model": "dummy"`` when given none: a model registered as
    ``dummy`` takes it while in service; once retired, the placeholder means no model again; with
    every model of the kind retired, the refusal names them."""
    import asyncio

    from app.api.routes.images import HF_NO_MODEL, model_or_default

    with api_with_copies(settings, tiny_models_dir / MODEL, HF_NO_MODEL, MODEL) as (_, ctx):
        assert asyncio.run(model_or_default(ctx, HF_NO_MODEL, "txt2img")) == HF_NO_MODEL
        ctx.registry.retire(HF_NO_MODEL)
        assert asyncio.run(model_or_default(ctx, HF_NO_MODEL, "txt2img")) == MODEL
        assert asyncio.run(model_or_default(ctx, None, "txt2img")) == MODEL
        ctx.registry.retire(MODEL)
        with pytest.raises(NotFound) as none:  # models of the kind exist, none in service: it says so
            default_model(ctx, "txt2img")
        assert none.value.reason == "no_model"
        assert none.value.message.startswith(f"no model in service runs txt2img (retired: {HF_NO_MODEL}, {MODEL});")


def test_r16_r17_retiring_a_committed_model_releases_its_commitments(
    api: tuple[TestClient, ServerContext], settings: Settings
) -> None:
    """A commitment to a retired model keeps nothing warm that will run, yet it kept videos off
    the machine (R17): ``models retire`` releases it everywhere, in Redis and in the database."""
    client, ctx = api
    kept = client.put("/v1/machines/m1/residency", json={"models": [BAD, MODEL]})
    assert kept.status_code == 200, kept.text
    code, said = retire(settings, BAD)
    assert code == 0 and "released its residency commitment on: m1" in said, said
    assert sorted(client.get("/v1/machines/m1/residency").json()["models"]) == [MODEL]
    assert ctx.residency.commitments("m1") == frozenset({MODEL})
    assert ctx.residency.store.commitments()["m1"] == frozenset({MODEL})  # a Redis loss restores this
