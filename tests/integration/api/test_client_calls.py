"""One job per client call on the image routes (R20, case C10), on a real Redis and journal
through the real ASGI app. No worker runs: every job stays queued, so every request's wait
runs out and is answered before the timeout the client announced."""

from __future__ import annotations

import base64
import io
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from PIL import Image

from app.api.routes.images import announced_timeout_s, reply_margin_s
from app.api.server import create_app
from app.context import ServerContext, build_context
from app.core.config import Settings
from app.core.states import JobState
from tests.helpers import TEST_API_KEY, bring_online, make_fleet

MODEL = "tiny-sd"
EDIT_MODEL = "tiny-pix2pix"
OTHER_KEY = "another-test-key-0123456789"


@pytest.fixture
def api(settings: Settings, tiny_models_dir: Path) -> Iterator[tuple[TestClient, ServerContext]]:
    settings = settings.model_copy(update={"api_keys": [TEST_API_KEY, OTHER_KEY], "images_wait_s": 30})
    ctx = build_context(settings, make_fleet("m1"), migrate=True)
    ctx.registry.add(tiny_models_dir / MODEL, MODEL)
    ctx.registry.add(tiny_models_dir / EDIT_MODEL, EDIT_MODEL)
    bring_online(ctx, "server", {MODEL, EDIT_MODEL})
    with TestClient(create_app(settings, ctx), headers={"Authorization": f"Bearer {TEST_API_KEY}"}) as client:
        yield client, ctx


def sdk_headers(read_timeout_s: float, retry_count: int) -> dict[str, str]:
    """The headers the openai SDK sends with every request (openai/_base_client.py)."""
    return {"x-stainless-read-timeout": str(read_timeout_s), "x-stainless-retry-count": str(retry_count)}


def jpeg(width: int = 32, height: int = 32) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), "navy").save(buffer, format="JPEG")
    return buffer.getvalue()


def png(width: int = 32, height: int = 32) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (10, 200, 30)).save(buffer, format="PNG")
    return buffer.getvalue()


def test_c10_a_request_is_answered_before_the_timeout_it_announces_naming_its_job(
    api: tuple[TestClient, ServerContext],
) -> None:
    client, ctx = api
    client.post("/v1/jobs?dry_run=true", json={"model": MODEL, "kind": "txt2img", "params": {"prompt": "warm"}})
    for read_timeout_s in (2.0, 4.0):  # the tokenizer is loaded: a submission takes well under the margin
        start = time.monotonic()
        answer = client.post(
            "/v1/images/generations",
            json={"prompt": f"t{read_timeout_s}", "model": MODEL},
            headers=sdk_headers(read_timeout_s, 0),
        )
        took_s = time.monotonic() - start
        assert answer.status_code == 409, answer.text
        assert took_s < read_timeout_s and took_s >= read_timeout_s - reply_margin_s(read_timeout_s) - 0.05
        assert answer.headers["x-should-retry"] == "false"  # the SDK retries a 409 unless told not to
        error = answer.json()["error"]
        [job] = [j for j in ctx.journal.list([JobState.queued]) if j.params["prompt"] == f"t{read_timeout_s}"]
        assert (error["code"], error["job_ids"]) == ("job_pending", [job.id])
        assert job.id in error["message"] and "do not resubmit" in error["message"]
        assert answer.headers["location"] == f"/v1/jobs/{job.id}"


def test_c10_a_retried_request_gets_the_first_calls_jobs_and_a_new_call_gets_new_ones(
    api: tuple[TestClient, ServerContext],
) -> None:
    client, ctx = api
    body = {"prompt": "one call", "model": MODEL, "n": 2, "size": "64x64"}
    first = client.post("/v1/images/generations", json=body, headers=sdk_headers(0.5, 0)).json()["error"]
    assert len(first["job_ids"]) == 1  # one job makes the n images
    for retry in (1, 2):
        again = client.post("/v1/images/generations", json=body, headers=sdk_headers(0.5, retry)).json()["error"]
        assert again["job_ids"] == first["job_ids"]
    assert len(ctx.journal.list([JobState.queued])) == 1  # the retries created nothing
    # A retry of another body, or under another key, is another call; so is a first request.
    other = client.post("/v1/images/generations", json={**body, "prompt": "two"}, headers=sdk_headers(0.5, 1))
    other_key = client.post(
        "/v1/images/generations", json=body, headers={**sdk_headers(0.5, 1), "Authorization": f"Bearer {OTHER_KEY}"}
    )
    fresh = client.post("/v1/images/generations", json=body, headers=sdk_headers(0.5, 0))
    ids = [set(answer.json()["error"]["job_ids"]) for answer in (other, other_key, fresh)]
    assert all(len(found) == 1 and not found & set(first["job_ids"]) for found in ids)
    assert len(ctx.journal.list([JobState.queued])) == 4
    # Field order or spacing is not a different call: the body is compared as parsed.
    reordered = client.post(
        "/v1/images/generations",
        content=b'{"size":"64x64","n":2, "model":"tiny-sd","prompt":"one call"}',
        headers={**sdk_headers(0.5, 1), "content-type": "application/json"},
    )
    assert set(reordered.json()["error"]["job_ids"]) == ids[2]


def test_c10_a_retry_of_a_refused_first_request_submits_afresh(api: tuple[TestClient, ServerContext]) -> None:
    client, ctx = api
    body = {"prompt": "x", "model": MODEL, "target": "m1"}  # m1 is offline: refused, nothing submitted
    refused = client.post("/v1/images/generations", json=body, headers=sdk_headers(0.5, 0))
    assert refused.status_code == 503 and "x-should-retry" not in refused.headers  # retrying is safe
    bring_online(ctx, "m1", {MODEL})
    retried = client.post("/v1/images/generations", json=body, headers=sdk_headers(0.5, 1))
    assert retried.status_code == 409 and len(retried.json()["error"]["job_ids"]) == 1
    assert len(ctx.journal.list([JobState.queued])) == 1


def test_c10_edits_are_one_call_whatever_the_multipart_boundary(api: tuple[TestClient, ServerContext]) -> None:
    client, ctx = api
    image = png()
    answers = []
    for retry in (0, 1):  # httpx draws a new random multipart boundary for each request
        files = {"image": ("in.png", image, "image/png")}
        answers.append(
            client.post(
                "/v1/images/edits",
                data={"prompt": "blue", "model": EDIT_MODEL},
                files=files,
                headers=sdk_headers(0.5, retry),
            )
        )
    first, retried = (answer.json()["error"] for answer in answers)
    assert answers[0].status_code == 409 and first["job_ids"] == retried["job_ids"]
    [job] = ctx.journal.list([JobState.queued])
    assert (job.kind, job.id) == ("edit", first["job_ids"][0])


def test_c10_huggingface_routes_honour_prefer_wait_for_text_and_image_to_image(
    api: tuple[TestClient, ServerContext], tiny_models_dir: Path
) -> None:
    client, ctx = api
    client.post("/v1/jobs?dry_run=true", json={"model": MODEL, "kind": "txt2img", "params": {"prompt": "warm"}})
    start = time.monotonic()
    text = client.post(
        f"/hf/models/{MODEL}",
        json={"inputs": "a cat", "parameters": {"num_inference_steps": 1}},
        headers={"Prefer": "wait=10"},
    )
    waited_s = time.monotonic() - start
    # no worker runs it: the job is waited for, and answered reply_margin_s (2 s) before the 10 s
    assert 6 <= waited_s < 10, waited_s
    assert text.status_code == 409 and text.headers["x-should-retry"] == "false"
    [queued] = ctx.journal.list([JobState.queued])
    assert text.json()["error"]["job_ids"] == [queued.id] and queued.id in text.json()["error"]["message"]
    image = client.post(
        f"/hf/models/{EDIT_MODEL}",
        headers={"Prefer": "respond-async, wait=1"},
        json={"inputs": base64.b64encode(png()).decode(), "parameters": {"prompt": "make it blue"}},
    )
    assert image.status_code == 409, image.text
    [edit] = [j for j in ctx.journal.list([JobState.queued]) if j.kind == "edit"]
    assert image.json()["error"]["job_ids"] == [edit.id] and edit.params["prompt"] == "make it blue"
    assert ctx.inputs.get(edit.params["image"]).path.read_bytes() == png()
    not_base64 = client.post(
        f"/hf/models/{EDIT_MODEL}", json={"inputs": "not an image!", "parameters": {"prompt": "x"}}
    )
    assert (not_base64.status_code, not_base64.json()["error"]["param"]) == (400, "inputs")
    # a Stable Diffusion model runs image-to-image as img2img, as Hugging Face serves it, strength too
    img2img = client.post(
        f"/hf/models/{MODEL}",
        headers={"Prefer": "respond-async, wait=1"},
        json={"inputs": base64.b64encode(png()).decode(), "parameters": {"prompt": "at dusk", "strength": 0.5}},
    )
    assert img2img.status_code == 409, img2img.text
    [queued] = [j for j in ctx.journal.list([JobState.queued]) if j.kind == "img2img"]
    assert img2img.json()["error"]["job_ids"] == [queued.id]
    assert (queued.model_id, queued.params["prompt"], queued.params["strength"]) == (MODEL, "at dusk", 0.5)
    too_strong = client.post(
        f"/hf/models/{MODEL}",
        json={"inputs": base64.b64encode(png()).decode(), "parameters": {"prompt": "x", "strength": 2}},
    )
    assert (too_strong.status_code, too_strong.json()["error"]["param"]) == (400, "parameters.strength"), (
        too_strong.text
    )
    on_edit = client.post(
        f"/hf/models/{EDIT_MODEL}",
        json={"inputs": base64.b64encode(png()).decode(), "parameters": {"prompt": "x", "strength": 0.5}},
    )
    assert (on_edit.status_code, on_edit.json()["error"]["code"]) == (400, "unknown_param"), (
        on_edit.text
    )  # edit has none
    # without a prompt (the client's image_to_image(image) alone): still image-to-image, never a
    # txt2img job drawing the image's base64 as its prompt; img2img needs a prompt and says so
    for encoded in (base64.b64encode(png()).decode(), base64.b64encode(jpeg()).decode()):
        no_prompt = client.post(f"/hf/models/{MODEL}", json={"inputs": encoded, "parameters": {"strength": 0.5}})
        error = no_prompt.json()["error"]
        assert (no_prompt.status_code, error["param"]) == (400, "parameters.prompt"), no_prompt.text
        assert "`prompt` is required for kind img2img" in error["message"]
    assert not [
        j for j in ctx.journal.list() if j.kind == "txt2img" and str(j.params.get("prompt")).startswith("iVBOR")
    ]
    # an image over the pixel limit is refused naming the field that carried it
    bomb = io.BytesIO()
    Image.new("1", (10_000, 10_000)).save(bomb, format="PNG")
    too_many = client.post(
        f"/hf/models/{EDIT_MODEL}",
        json={"inputs": base64.b64encode(bomb.getvalue()).decode(), "parameters": {"prompt": "x"}},
    )
    edits = client.post(
        "/v1/images/edits",
        data={"model": EDIT_MODEL, "prompt": "x"},
        files={"image": ("big.png", bomb.getvalue(), "image/png")},
    )
    for refused, field in ((too_many, "inputs"), (edits, "image")):
        error = refused.json()["error"]
        assert (refused.status_code, error["code"], error["param"]) == (400, "input_too_large", field), refused.text
        assert error["message"] == "image is 10000 x 10000 = 100000000 pixels; the limit is 16777216 pixels"
    ctx.registry.add(tiny_models_dir / "tiny-animatediff", "tiny-video")
    bring_online(ctx, "server", {MODEL, EDIT_MODEL, "tiny-video"})
    no_image_kind = client.post(
        "/hf/models/tiny-video", json={"inputs": base64.b64encode(png()).decode(), "parameters": {"prompt": "x"}}
    )
    error = no_image_kind.json()["error"]
    assert (
        error["code"] == "unsupported_kind"
        and "runs video; image-to-image needs a model that runs edit, img2img, upscale" in error["message"]
    )


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        ({}, None),
        ({"x-stainless-read-timeout": "12.5"}, 12.5),
        ({"Prefer": "wait=7"}, 7.0),
        ({"x-stainless-read-timeout": "30", "Prefer": "handling=lenient, wait=4"}, 4.0),
        ({"x-stainless-read-timeout": "nan"}, None),
        ({"x-stainless-read-timeout": "-1"}, None),
        ({"x-stainless-read-timeout": "inf"}, None),
        ({"Prefer": "wait=soon"}, None),
    ],
)
def test_c10_the_announced_timeout_is_the_shortest_finite_one(headers: dict[str, str], expected: float | None) -> None:
    from starlette.requests import Request

    scope = {"type": "http", "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()]}
    assert announced_timeout_s(Request(scope)) == expected


def test_r20_a_requeue_retried_with_its_idempotency_key_makes_one_job(api: tuple[TestClient, ServerContext]) -> None:
    """``POST /v1/jobs/{id}/requeue`` makes a job as ``POST /v1/jobs`` does; a backend that
    retries it after a timeout or a 5xx sends the same ``Idempotency-Key`` (R20) and gets the
    first requeue's job (``Idempotency-Replayed: true``), not a second run. The same key with
    another body, or for another job, is 422 ``idempotency_key_reused``; another API key's same
    string is its own key; without a key each requeue is a new job, as before."""
    client, ctx = api
    old = client.post("/v1/jobs", json={"model": MODEL, "kind": "txt2img", "params": {"prompt": "a fox"}}).json()["id"]
    other = client.post("/v1/jobs", json={"model": MODEL, "kind": "txt2img", "params": {"prompt": "a cat"}}).json()
    first = client.post(f"/v1/jobs/{old}/requeue", json={"seed": None}, headers={"Idempotency-Key": "rq-1"})
    again = client.post(f"/v1/jobs/{old}/requeue", json={"seed": None}, headers={"Idempotency-Key": "rq-1"})
    assert first.status_code == again.status_code == 202, again.text
    assert again.json()["id"] == first.json()["id"] and again.headers["Idempotency-Replayed"] == "true"
    assert "Idempotency-Replayed" not in first.headers
    assert ctx.journal.get(first.json()["id"]).requeued_from == old
    reused = client.post(f"/v1/jobs/{other['id']}/requeue", json={"seed": None}, headers={"Idempotency-Key": "rq-1"})
    assert (reused.status_code, reused.json()["error"]["reason"]) == (422, "idempotency_key_reused")
    reseeded = client.post(f"/v1/jobs/{old}/requeue", json={"seed": 7}, headers={"Idempotency-Key": "rq-1"})
    assert (reseeded.status_code, reseeded.json()["error"]["reason"]) == (422, "idempotency_key_reused")
    theirs = client.post(
        f"/v1/jobs/{old}/requeue",
        json={"seed": None},
        headers={"Idempotency-Key": "rq-1", "Authorization": f"Bearer {OTHER_KEY}"},
    )
    assert theirs.status_code == 202 and theirs.json()["id"] != first.json()["id"]
    plain = [client.post(f"/v1/jobs/{old}/requeue").json()["id"] for _ in range(2)]
    assert len(set(plain)) == 2
    requeues = [job for job in ctx.journal.list() if job.requeued_from == old]
    assert len(requeues) == 4 and all(job.state == JobState.queued for job in requeues)


def test_r20_an_empty_idempotency_key_is_refused_naming_the_header(api: tuple[TestClient, ServerContext]) -> None:
    """``Idempotency-Key:`` sent empty (a backend's unset variable) is 422 naming the header, on
    submission and requeue, before any job: read as a key, every such request of the API key
    would replay the first one's job; read as none, the backend believes its retries are safe."""
    client, ctx = api
    body = {"model": MODEL, "kind": "txt2img", "params": {"prompt": "a fox"}}
    empty = client.post("/v1/jobs", json=body, headers={"Idempotency-Key": ""})
    assert empty.status_code == 422, empty.text
    assert "idempotency-key" in empty.text.lower() and ctx.journal.list() == []
    old = client.post("/v1/jobs", json=body).json()["id"]
    requeue = client.post(f"/v1/jobs/{old}/requeue", headers={"Idempotency-Key": ""})
    assert requeue.status_code == 422 and len(ctx.journal.list()) == 1, requeue.text


def test_r20_an_image_call_resent_with_its_idempotency_key_gets_its_first_jobs(
    api: tuple[TestClient, ServerContext],
) -> None:
    """A deliberate resend (a backend restarted, retry count 0) with the ``Idempotency-Key`` of an
    earlier image call gets that call's jobs, as ``POST /v1/jobs`` does (R20), where only the
    SDK's own retries were recognised; the same key with another body is 400
    ``idempotency_key_reused``; another key, or another API key's same key, is a new call; an
    empty key is refused naming the header."""
    client, ctx = api
    body = {"prompt": "one keyed call", "model": MODEL, "size": "64x64"}
    keyed = {**sdk_headers(0.5, 0), "Idempotency-Key": "img-1"}
    first = client.post("/v1/images/generations", json=body, headers=keyed).json()["error"]
    again = client.post("/v1/images/generations", json=body, headers=keyed).json()["error"]
    assert again["job_ids"] == first["job_ids"] and len(ctx.journal.list([JobState.queued])) == 1
    reused = client.post("/v1/images/generations", json={**body, "prompt": "another"}, headers=keyed)
    assert reused.status_code == 400, reused.text
    assert (reused.json()["error"]["code"], reused.json()["error"]["param"]) == (
        "idempotency_key_reused",
        "Idempotency-Key",
    )
    other_key = client.post(
        "/v1/images/generations", json=body, headers={**keyed, "Authorization": f"Bearer {OTHER_KEY}"}
    ).json()["error"]
    new_key = client.post("/v1/images/generations", json=body, headers={**keyed, "Idempotency-Key": "img-2"}).json()[
        "error"
    ]
    assert len({*first["job_ids"], *other_key["job_ids"], *new_key["job_ids"]}) == 3
    empty = client.post("/v1/images/generations", json=body, headers={**keyed, "Idempotency-Key": ""})
    assert empty.status_code == 400 and empty.json()["error"]["param"] == "Idempotency-Key", empty.text
    assert len(ctx.journal.list([JobState.queued])) == 3
