"""The serving front against the running fleet: Server-Sent Events, the OpenAI Images API
through the real ``openai`` package, Hugging Face's ``InferenceClient`` (R20, R24)."""

from __future__ import annotations

import base64
import io
import json
import threading
import time
from typing import Any

import httpx
import pytest
from PIL import Image

from app.core.states import JobState
from app.core.tls import tls_context
from tests.e2e.conftest import EDIT_MODEL, UPSCALE_MODEL, RunningFleet
from tests.helpers import TEST_API_KEY, run_cli

pytestmark = pytest.mark.e2e


def read_events(url: str, timeout_s: float = 120) -> list[tuple[str, Any]]:
    """Every (event, data) of an SSE stream until the server closes it."""
    events: list[tuple[str, Any]] = []
    name = "message"
    with httpx.stream(
        "GET", url, headers={"Authorization": f"Bearer {TEST_API_KEY}"}, timeout=timeout_s, verify=tls_context()
    ) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line.startswith("event:"):
                name = line.removeprefix("event:").strip()
            elif line.startswith("data:"):
                events.append((name, json.loads(line.removeprefix("data:").strip())))
    return events


def test_r24_job_events_stream_states_steps_and_the_result_url(fleet: RunningFleet) -> None:
    accepted = fleet.client.submit(fleet.model, "txt2img", {"prompt": "sse", "steps": 3}, "m1")
    url = f"{fleet.local.api_url}/v1/jobs/{accepted['id']}/events"
    events = read_events(url)
    states = [data["state"] for name, data in events if name == "state"]
    assert states[-1] == "succeeded" and states == sorted(set(states), key=states.index)  # each change once
    assert "running" in states
    steps = [(data["step"], data["total"]) for name, data in events if name == "progress"]
    assert steps and steps[-1] == (3, 3) and steps == sorted(steps)
    name, end = events[-1]
    assert name == "end" and end["result_url"] == f"/v1/jobs/{accepted['id']}/result"
    # A job that has already ended: its state and end event at once (no past progress), then
    # the stream closes.
    again = read_events(url, timeout_s=10)
    assert [name for name, _ in again] == ["state", "end"], again
    assert again[-2][1]["state"] == "succeeded" and again[-1][1]["result_url"] == end["result_url"]


def test_r24_events_of_an_unknown_job_are_404(fleet: RunningFleet) -> None:
    response = httpx.get(
        f"{fleet.local.api_url}/v1/jobs/nope/events", headers=fleet.local.auth_headers, verify=tls_context()
    )
    assert response.status_code == 404 and "nope" in response.json()["error"]["message"]


def test_openai_sdk_generates_images_and_reads_openai_errors(fleet: RunningFleet) -> None:
    import openai

    client = openai.OpenAI(base_url=f"{fleet.local.api_url}/v1", api_key=TEST_API_KEY, max_retries=2)
    result = client.images.generate(
        model=fleet.model,
        prompt="a red fox",
        n=2,
        size="64x64",  # type: ignore[arg-type]
        response_format="b64_json",
        extra_body={"steps": 2},
    )
    assert result.data is not None and len(result.data) == 2
    for item in result.data:
        image = Image.open(io.BytesIO(base64.b64decode(item.b64_json or "")))
        assert (image.format, image.size) == ("PNG", (64, 64))
    by_url = client.images.generate(
        model=fleet.model,
        prompt="a fox",
        size="64x64",  # type: ignore[arg-type]
        response_format="url",
        extra_body={"steps": 1},
    )
    assert by_url.data is not None and by_url.data[0].url is not None
    # absolute, the server's own address (no public_base_url set), never from Host: fetched as given
    assert by_url.data[0].url.startswith(f"{fleet.local.api_url}/v1/jobs/")
    assert httpx.get(by_url.data[0].url, headers=fleet.local.auth_headers, verify=tls_context()).content.startswith(
        b"\x89PNG"
    )
    with pytest.raises(openai.BadRequestError) as refused:
        client.images.generate(model=fleet.model, prompt="x", size="60x64")  # type: ignore[arg-type]
    assert refused.value.code == "invalid_width" and "multiple of 8" in refused.value.message
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{fleet.local.api_url}/v1", api_key="wrong").images.generate(prompt="x")


def test_openai_sdk_edits_an_uploaded_image(fleet: RunningFleet) -> None:
    import openai

    source = io.BytesIO()
    Image.new("RGB", (48, 40), (200, 120, 30)).save(source, format="PNG")
    client = openai.OpenAI(base_url=f"{fleet.local.api_url}/v1", api_key=TEST_API_KEY, max_retries=0)
    result = client.images.edit(
        model=EDIT_MODEL,
        image=("in.png", source.getvalue(), "image/png"),
        prompt="make it blue (sdk edit)",
        response_format="b64_json",
        extra_body={"steps": 2},
    )
    assert result.data is not None and len(result.data) == 1
    image = Image.open(io.BytesIO(base64.b64decode(result.data[0].b64_json or "")))
    assert (image.format, image.size) == ("PNG", (48, 40))  # an edit keeps the input's size
    # one job for the call (other tests of the shared fleet run edits of their own)
    edits = [j for j in fleet.ctx.journal.list() if j.params.get("prompt") == "make it blue (sdk edit)"]
    assert [(j.kind, j.state, j.model_id) for j in edits] == [("edit", JobState.succeeded, EDIT_MODEL)]


def test_r20_openai_sdk_does_not_retry_a_request_whose_job_ended_badly(fleet: RunningFleet) -> None:
    import openai

    # m3 has no worker now; advertise it for this test so that the job waits there.
    fleet.ctx.redis.set(fleet.ctx.keys.heartbeat("m3"), json.dumps({"machine": "m3", "at": time.time()}), ex=60)
    fleet.ctx.redis.sadd(fleet.ctx.keys.verified("m3"), fleet.model)
    client = openai.OpenAI(base_url=f"{fleet.local.api_url}/v1", api_key=TEST_API_KEY, max_retries=3)
    errors: list[Exception] = []

    def generate() -> None:
        try:
            client.images.generate(model=fleet.model, prompt="never drawn", extra_body={"target": "m3", "steps": 1})
        except openai.APIError as error:
            errors.append(error)

    thread = threading.Thread(target=generate)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not (queued := fleet.ctx.journal.list([JobState.queued], machine="m3")):
            assert time.monotonic() < deadline, "the image request's job never appeared"
            time.sleep(0.05)
        fleet.ctx.dispatcher.cancel(queued[0].id)  # the job ends without an image
        thread.join(timeout=30)
    finally:
        fleet.ctx.redis.delete(fleet.ctx.keys.heartbeat("m3"), fleet.ctx.keys.verified("m3"))
    [error] = errors
    # cancelled by a caller, not a fault of the server: 409 with the job's reason, never a 5xx
    assert isinstance(error, openai.ConflictError), error
    assert error.response.headers["x-should-retry"] == "false"
    body = error.response.json()["error"]
    assert (body["code"], body["type"], body["job_ids"]) == ("cancelled", "conflict_error", [queued[0].id])
    assert "cancelled" in error.message
    mine = [j for j in fleet.ctx.journal.list() if j.params.get("prompt") == "never drawn"]
    assert len(mine) == 1  # the SDK did not retry into a second job


def test_huggingface_inference_client_text_to_image(fleet: RunningFleet) -> None:
    from huggingface_hub import InferenceClient
    from huggingface_hub.errors import HfHubHTTPError

    client = InferenceClient(base_url=f"{fleet.local.api_url}/hf/models/{fleet.model}", api_key=TEST_API_KEY)
    image = client.text_to_image("a lighthouse", num_inference_steps=2, width=64, height=64)
    assert image.size == (64, 64)
    # image_to_image on a Stable Diffusion model: img2img of that picture, as Hugging Face serves it
    source = io.BytesIO()
    image.save(source, format="PNG")
    redrawn = client.image_to_image(
        source.getvalue(), prompt="the lighthouse at dusk", num_inference_steps=2, strength=0.5
    )
    assert redrawn.size == (64, 64)
    [job] = [j for j in fleet.ctx.journal.list() if j.params.get("prompt") == "the lighthouse at dusk"]
    assert (job.kind, job.state, job.params["strength"], job.params["steps"]) == ("img2img", "succeeded", 0.5, 2)
    assert fleet.ctx.inputs.get(job.params["image"]).path.read_bytes() == source.getvalue()
    # with no parameter at all the client sends the image's bytes as the body, not JSON: an
    # upscaler runs it; a model whose image-to-image needs a prompt says so
    upscaler = InferenceClient(base_url=f"{fleet.local.api_url}/hf/models/{UPSCALE_MODEL}", api_key=TEST_API_KEY)
    assert upscaler.image_to_image(source.getvalue()).size == (256, 256)
    with pytest.raises(HfHubHTTPError) as no_prompt:
        client.image_to_image(source.getvalue())
    error = no_prompt.value.response.json()["error"]
    assert (no_prompt.value.response.status_code, error["param"]) == (400, "parameters.prompt"), error


def test_bench_sweep_reports_queue_and_run_time_per_machine_and_rejections(fleet: RunningFleet) -> None:
    from app.devtools.bench import sweep

    [one, two] = sweep(fleet.client, fleet.model, [1, 2], jobs=2, params={"prompt": "bench", "steps": 1}, target="auto")
    assert (one.concurrency, two.concurrency) == (1, 2)
    for report in (one, two):
        assert report.ended == {"succeeded": 2} and not report.rejections
        rows = report.rows()
        assert sum(row["jobs"] for row in rows) == 2
        assert all(row["queue_p50_s"] >= 0 and row["run_p50_s"] > 0 for row in rows)
    [refused] = sweep(fleet.client, fleet.model, [2], jobs=3, params={"prompt": "bench", "width": 12}, target="auto")
    assert refused.rejections == {"invalid_width": 3} and refused.rows() == []


def test_bench_command_prints_the_sweep(fleet: RunningFleet) -> None:
    done = run_cli(
        "bench",
        "--url",
        fleet.local.api_url,
        "--api-key",
        TEST_API_KEY,
        "--model",
        fleet.model,
        "--concurrency",
        "1",
        "--jobs",
        "1",
        "--steps",
        "1",
        "--target",
        "m2",
    )
    assert "concurrency=1 machine=m2 jobs=1 queue_p50_s=" in done.stdout
    assert "concurrency=1 " in done.stdout and "succeeded=1" in done.stdout and "rejections: none" in done.stdout
