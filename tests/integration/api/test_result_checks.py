"""The server decodes every result before storing it (R2): a bomb, a truncated
file or a polyglot uploaded by a worker for its running job is refused, nothing is stored and
the job fails with reason ``result_invalid``; results and files are served with their stored
media type, ``nosniff`` and ``Content-Disposition``. Real Redis and journal, the real app."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from PIL import Image

from app.api.server import create_app
from app.context import ServerContext, build_context
from app.core.config import Settings
from app.core.digest import bytes_digest
from app.core.states import JobState
from tasks.kinds.video import mp4_bytes
from tests.helpers import (
    TEST_API_KEY,
    bring_online,
    files_under,
    make_fleet,
    png,
    png_claiming,
)

MODEL = "tiny-sd"
AUTH = {"Authorization": f"Bearer {TEST_API_KEY}"}
M1 = {"Authorization": f"Bearer {make_fleet('m1').machines['m1'].token}", "X-Homefleet-Machine": "m1"}


@pytest.fixture
def api(settings: Settings, tiny_models_dir: Path) -> Iterator[tuple[TestClient, ServerContext]]:
    ctx = build_context(settings, make_fleet("m1"), migrate=True)
    ctx.registry.add(tiny_models_dir / MODEL, MODEL)
    bring_online(ctx, "m1", {MODEL})
    with TestClient(create_app(settings, ctx), headers=AUTH) as client:
        yield client, ctx


def running_job(client: TestClient) -> str:
    job = client.post(
        "/v1/jobs",
        json={"model": MODEL, "kind": "txt2img", "target": "m1", "params": {"prompt": "a result", "steps": 2}},
    ).json()
    assert client.post(f"/internal/v1/jobs/{job['id']}/claim", headers=M1).status_code == 200
    return str(job["id"])


def upload(client: TestClient, job_id: str, data: bytes, name: str = "r.png") -> object:
    return client.post(
        f"/internal/v1/jobs/{job_id}/result",
        headers=M1,
        data={"digest": bytes_digest(data), "load_s": "0.1", "run_s": "0.2", "cold_load": "false"},
        files={"file": (name, data, "application/octet-stream")},
    )


def video(frames: int = 8) -> bytes:
    return mp4_bytes([Image.new("RGB", (64, 64), (index * 20, 0, 0)) for index in range(frames)], 8, {"test": 1})


INVALID = {
    "png_bomb_30000x30000": lambda: png_claiming(30000, 30000),
    "truncated_png": lambda: png(64, 64)[:60],
    "png_html_polyglot": lambda: b"\x89PNG\r\n\x1a\n<html><script>alert(document.cookie)</script></html>",
    "gif_html_polyglot": lambda: b"GIF89a<html><script>alert(document.cookie)</script></html>",
    "mp4_html_polyglot": lambda: b"\0\0\0\x18ftypisom<html><script>alert(1)</script></html>",
    "truncated_mp4": lambda: video()[:-50],
}


@pytest.mark.parametrize("kind", list(INVALID))
def test_a_result_that_does_not_decode_fails_the_job_result_invalid(
    api: tuple[TestClient, ServerContext], kind: str
) -> None:
    client, ctx = api
    job_id = running_job(client)
    answer = upload(client, job_id, INVALID[kind]())
    assert answer.status_code == 422, answer.text
    assert answer.json()["error"]["reason"] == "result_invalid"
    job = ctx.journal.get(job_id)
    assert job.state == JobState.failed and job.reason == "result_invalid"
    assert job.message.startswith("result: ")
    results = ctx.settings.results_dir
    assert not results.exists() or files_under(results) == set()  # nothing stored


def test_a_complete_mp4_result_is_stored_and_served_with_its_type_nosniff_and_a_disposition(
    api: tuple[TestClient, ServerContext],
) -> None:
    client, ctx = api
    job_id = running_job(client)
    data = video()
    assert upload(client, job_id, data, "r.mp4").status_code == 200
    assert ctx.journal.get(job_id).state == JobState.succeeded
    served = client.get(f"/v1/jobs/{job_id}/result")
    assert served.status_code == 200 and served.content == data
    assert served.headers["content-type"] == "video/mp4"
    assert served.headers["x-content-type-options"] == "nosniff"
    assert served.headers["content-disposition"] == f'attachment; filename="{job_id}.mp4"'
    assert served.headers["x-content-digest"] == bytes_digest(data)


def test_a_result_carries_its_digest_as_etag_and_a_client_holding_it_is_answered_304(
    api: tuple[TestClient, ServerContext],
) -> None:
    """A result's bytes never change (R2): it is served with its digest as a strong ``ETag`` and
    ``Cache-Control: private, max-age=31536000, immutable``, and a client that sends the ETag back
    (``If-None-Match``: a browser's cache, the page's gallery read again) gets 304 with no body;
    any other ETag, or none, gets the file. Byte ranges still answer 206."""
    client, _ctx = api
    job_id = running_job(client)
    image = png(64, 64)
    assert upload(client, job_id, image).status_code == 200
    first = client.get(f"/v1/jobs/{job_id}/result")
    etag = f'"{bytes_digest(image)}"'
    assert (first.status_code, first.headers["etag"]) == (200, etag)
    assert first.headers["cache-control"] == "private, max-age=31536000, immutable"
    again = client.get(f"/v1/jobs/{job_id}/result", headers={"If-None-Match": f'"other", {etag}'})
    assert (again.status_code, again.content, again.headers["etag"]) == (304, b"", etag)
    assert client.get(f"/v1/jobs/{job_id}/result", headers={"If-None-Match": "*"}).status_code == 304
    changed = client.get(f"/v1/jobs/{job_id}/result", headers={"If-None-Match": '"blake3:0"'})
    assert (changed.status_code, changed.content) == (200, image)
    part = client.get(f"/v1/jobs/{job_id}/result", headers={"Range": "bytes=0-9"})
    assert (part.status_code, part.content) == (206, image[:10])


def test_inputs_and_png_results_are_served_nosniff_as_attachments(api: tuple[TestClient, ServerContext]) -> None:
    client, _ctx = api
    job_id = running_job(client)
    image = png(64, 64)
    assert upload(client, job_id, image).status_code == 200
    result = client.get(f"/v1/jobs/{job_id}/result")
    assert result.headers["content-type"] == "image/png" and result.headers["x-content-type-options"] == "nosniff"
    assert result.headers["content-disposition"] == f'attachment; filename="{job_id}.png"'
    file_id = client.post("/v1/files", files={"file": ("in.png", png(64, 64, (1, 2, 3)), "text/html")}).json()["id"]
    served = client.get(f"/internal/v1/files/{file_id}", headers=M1)
    assert served.headers["content-type"] == "image/png"  # the stored type, not the client's claim
    assert served.headers["x-content-type-options"] == "nosniff"
    assert served.headers["content-disposition"].startswith("attachment; filename=")


def test_a_succeeded_jobs_result_file_gone_from_the_data_folder_is_a_404_naming_it_and_the_fix(
    api: tuple[TestClient, ServerContext],
) -> None:
    """An operator freed space on a full disk by deleting results (the 507's message says "free
    some space"), or restored the data folder from an older backup: the journal still names a
    result whose file is gone. Its download was a 500 with no body but "Internal Server Error";
    it is a 404 ``result_missing`` naming the file and the fixes."""
    client, ctx = api
    job_id = running_job(client)
    image = png(64, 64)
    assert upload(client, job_id, image).status_code == 200
    stored = Path(ctx.journal.get(job_id).result_path or "")
    stored.unlink()
    answer = client.get(f"/v1/jobs/{job_id}/result")
    assert answer.status_code == 404, answer.text
    error = answer.json()["error"]
    assert error["reason"] == "result_missing"
    assert str(stored) in error["message"] and bytes_digest(image) in error["message"]
    assert f"homefleet jobs requeue {job_id}" in error["message"]
    assert client.get(f"/v1/jobs/{job_id}").json()["state"] == "succeeded"  # the journal is unchanged


def test_a_result_gone_before_an_image_route_answered_with_it_is_404_result_missing(
    api: tuple[TestClient, ServerContext],
) -> None:
    """The OpenAI image route answers with the result's bytes (``b64_json``): a file gone from the
    data folder by then is 404 ``result_missing`` naming it, as ``GET /v1/jobs/{id}/result``
    answers, not a 500 (one home: ``app.api.routes.deps.result_file``)."""
    client, ctx = api
    headers = {"Idempotency-Key": "gone-1", "x-stainless-read-timeout": "1"}
    body = {"prompt": "gone", "model": MODEL, "size": "64x64", "target": "m1"}
    pending = client.post("/v1/images/generations", json=body, headers=headers)
    assert pending.status_code == 409, pending.text
    [job_id] = pending.json()["error"]["job_ids"]
    assert client.post(f"/internal/v1/jobs/{job_id}/claim", headers=M1).status_code == 200
    assert upload(client, job_id, png(64, 64)).status_code == 200
    Path(str(ctx.journal.get(job_id).result_path)).unlink()
    again = client.post("/v1/images/generations", json=body, headers=headers)  # the same call: its job
    assert again.status_code == 404, again.text
    error = again.json()["error"]
    assert error["code"] == "result_missing" and "is missing" in error["message"], error
