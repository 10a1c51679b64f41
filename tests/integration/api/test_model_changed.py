"""A registered digest never changes by itself (R5): a file of the server's own copy that
changed (bits flipped, a damaged safetensors header, a file gone) makes its model refused at
submission with 409 ``model_changed`` naming the file, on every route, never a 500, while
other models are accepted; ``models update`` takes the new content. Real Redis, real journal,
the real ASGI app; no worker runs (jobs stay queued)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sqlmodel import Session, select

from app.context import ServerContext
from app.core.config import Settings
from app.core.digest import file_digest
from app.core.errors import Rejected
from app.core.pricing import loaded_bytes
from app.core.states import JobState
from app.db.tables import Job, ModelFile, ModelRecord
from tests.helpers import api_with_copies

MODEL, OTHER = "tiny-sd", "other-sd"
UNET = "unet/diffusion_pytorch_model.safetensors"


@pytest.fixture
def api(settings: Settings, tiny_models_dir: Path) -> Iterator[tuple[TestClient, ServerContext]]:
    with api_with_copies(settings, tiny_models_dir / MODEL, MODEL, OTHER) as (client, ctx):
        yield client, ctx


def submit(client: TestClient, model: str, target: str = "auto") -> object:
    return client.post(
        "/v1/jobs",
        json={"model": model, "kind": "txt2img", "target": target, "params": {"prompt": "a cat", "steps": 2}},
    )


def flip(path: Path, offset: int, count: int = 4, keep_stat: bool = False) -> None:
    """XOR ``count`` bytes of ``path`` at ``offset`` in place (same inode and size); with
    ``keep_stat`` the mtime is put back, so only a full rehash can see it (C07)."""
    stat = path.stat()
    with open(path, "r+b") as handle:
        handle.seek(offset)
        data = handle.read(count)
        handle.seek(offset)
        handle.write(bytes(b ^ 0xA5 for b in data))
    if keep_stat:
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))


def test_r5_flipped_bytes_in_the_servers_copy_refuse_its_submissions_409_naming_the_file_until_update(
    api: tuple[TestClient, ServerContext],
) -> None:
    client, ctx = api
    path = ctx.registry.folder(MODEL) / UNET
    registered = file_digest(path)
    flip(path, path.stat().st_size // 2)
    actual = file_digest(path)
    for answer in (submit(client, MODEL), submit(client, MODEL, "m1")):
        assert answer.status_code == 409, answer.text
        error = answer.json()["error"]
        assert error["reason"] == "model_changed"
        assert f"{UNET}: digest {actual}, registered {registered}" in error["message"]
        assert "`homefleet models update tiny-sd`" in error["message"]
        refused = ctx.journal.get(error["job_id"]) if "job_id" in error else None
        if refused is not None:
            assert (refused.state, refused.reason) == (JobState.rejected, "model_changed")
    openai = client.post("/v1/images/generations", json={"prompt": "a cat", "model": MODEL})
    assert openai.status_code == 409, openai.text
    assert openai.json()["error"]["code"] == "model_changed" and UNET in openai.json()["error"]["message"]
    with Session(ctx.engine) as session:  # nothing queued for it; every refusal journaled with its reason
        jobs = session.exec(select(Job).where(Job.model_id == MODEL)).all()
    assert {(j.state, j.reason) for j in jobs} == {(JobState.rejected, "model_changed")} and len(jobs) == 3
    assert submit(client, OTHER).status_code == 202  # the other model is untouched

    ctx.registry.update(MODEL)
    accepted = submit(client, MODEL, "server")
    assert accepted.status_code == 202, accepted.text
    assert {f.path: f.digest for f in ctx.registry.manifest(MODEL).files}[UNET] == actual


def test_r5_a_damaged_safetensors_header_is_409_not_500_and_other_models_are_still_accepted(
    api: tuple[TestClient, ServerContext],
) -> None:
    """Pricing reads every model's safetensors headers: a header whose bytes were flipped
    made every submission answer 500 (UnicodeDecodeError). The fresh server process here has
    priced nothing yet, as after a restart."""
    client, ctx = api
    path = ctx.registry.folder(MODEL) / UNET
    flip(path, 8 + 2, count=16)  # inside the JSON header, after its 8-byte length
    answer = submit(client, MODEL)
    assert answer.status_code == 409 and answer.json()["error"]["reason"] == "model_changed", answer.text
    assert UNET in answer.json()["error"]["message"]
    other = submit(client, OTHER)
    assert other.status_code == 202, other.text
    assert (
        client.post(
            "/v1/images/generations",
            json={"prompt": "a cat", "model": OTHER, "n": 1},
            headers={"x-stainless-read-timeout": "1"},
        ).status_code
        != 500
    )
    listed = {m["id"]: m for m in client.get("/v1/models").json()["data"]}  # the prices registered, never re-read
    assert listed[MODEL]["weights_bytes"] == ctx.registry.get(MODEL).weights_bytes > 0
    assert listed[OTHER]["weights_bytes"] > 0


def test_r5_update_refuses_an_unreadable_header_and_an_old_record_with_one_is_never_a_500(
    api: tuple[TestClient, ServerContext],
) -> None:
    """``models update`` refuses a folder whose safetensors headers no loader can read (nothing
    recorded). An old record (no weights_bytes priced at registration) whose registered bytes
    carry such a header is priced from its configs (app/core/pricing.py reads no weight header
    of a pipeline), so its submission is never a 500 and the other model is still accepted."""
    client, ctx = api
    path = ctx.registry.folder(MODEL) / UNET
    flip(path, 8 + 2, count=16)
    with pytest.raises(Rejected, match="cannot be priced") as refused:
        ctx.registry.update(MODEL)
    assert refused.value.reason == "model_unreadable" and UNET in str(refused.value)
    with Session(ctx.engine) as session:  # as registered long ago, damaged header and all
        row = session.get(ModelFile, (MODEL, UNET))
        record = session.get(ModelRecord, MODEL)
        assert row is not None and record is not None
        stat = path.stat()
        row.digest, row.size, row.mtime_ns, row.inode = file_digest(path), stat.st_size, stat.st_mtime_ns, stat.st_ino
        record.weights_bytes = None
        session.add(row)
        session.add(record)
        session.commit()
    ctx.registry._records.clear()
    answer = submit(client, MODEL)
    assert answer.status_code == 202, answer.text
    assert ctx.registry.weights_bytes(MODEL) == loaded_bytes(
        ctx.registry.folder(MODEL), ctx.registry.get(MODEL).variant
    )
    assert submit(client, OTHER).status_code == 202


def test_c07_a_change_that_keeps_size_and_mtime_is_found_by_verify_not_by_the_stat_cache(
    api: tuple[TestClient, ServerContext],
) -> None:
    client, ctx = api
    path = ctx.registry.folder(MODEL) / UNET
    registered = file_digest(path)
    flip(path, path.stat().st_size - 4, keep_stat=True)
    assert submit(client, MODEL, "m1").status_code == 202  # the cache cannot see it (documented limit)
    changed = [c for c in ctx.registry.verify([MODEL]) if c.status != "ok"]
    assert [(c.path, c.recorded, c.actual) for c in changed] == [(UNET, registered, file_digest(path))]
    assert {f.path: f.digest for f in ctx.registry.registered_manifest(MODEL).files}[UNET] == registered
