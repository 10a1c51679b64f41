"""The serving front on a real Redis and journal, through the real ASGI app (R22, R23, R24,
API keys, the OpenAI error shape). No worker runs: jobs stay queued."""

from __future__ import annotations

import io
import json
import re
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families

from app.api.auth import OpenApiRefused
from app.api.server import create_app
from app.context import ServerContext, build_context
from app.core.config import Settings
from app.core.limits import FamilyLimits
from app.core.states import JobState
from app.core.tls import tls_context
from app.devtools.redis_server import start_redis_server
from tests.helpers import TEST_API_KEY, bring_online, make_fleet, served_api

MODEL = "tiny-sd"
AUTH = {"Authorization": f"Bearer {TEST_API_KEY}"}


def online(ctx: ServerContext, *machines: str) -> None:
    for machine in machines:
        bring_online(ctx, machine, {MODEL})


def edit_model_on_server(ctx: ServerContext, tiny_models_dir: Path) -> str:
    """tiny-pix2pix registered and verified on an online ``server``: its id."""
    edit_model = ctx.registry.add(tiny_models_dir / "tiny-pix2pix", "tiny-pix2pix").id
    online(ctx, "server")
    ctx.redis.sadd(ctx.keys.verified("server"), edit_model)
    return edit_model


def image_bytes(image_format: str = "PNG") -> bytes:
    """A black 64x48 picture in ``image_format``, as an upload holds it."""
    buffer = io.BytesIO()
    Image.new("RGB", (64, 48)).save(buffer, format=image_format)
    return buffer.getvalue()


def make_api(settings: Settings, tiny_models_dir: Path) -> tuple[TestClient, ServerContext]:
    ctx = build_context(settings, make_fleet("m1", "m2"), migrate=True)
    ctx.registry.add(tiny_models_dir / MODEL, MODEL)
    return TestClient(create_app(settings, ctx), headers=AUTH), ctx


@pytest.fixture
def api(settings: Settings, tiny_models_dir: Path) -> Iterator[tuple[TestClient, ServerContext]]:
    client, ctx = make_api(settings, tiny_models_dir)
    with client:
        yield client, ctx


def submit(client: TestClient, target: str = "m1", **params: object) -> object:
    return client.post(
        "/v1/jobs", json={"model": MODEL, "kind": "txt2img", "target": target, "params": {"prompt": "a cat", **params}}
    )


@pytest.mark.parametrize(
    ("params", "reason", "fragments"),
    [
        ({"width": 500}, "invalid_width", ["`width`", "multiple of 8", "500"]),
        ({"height": 0}, "invalid_height", ["`height`", "at least 8", "got 0"]),
        ({"width": 2048, "height": 2048}, "invalid_size", ["1048576 pixels", "2048 x 2048 = 4194304"]),
        ({"steps": 1000}, "invalid_steps", ["`steps`", "between 1 and 150", "1000"]),
        ({"steps": "many"}, "invalid_steps", ["`steps` must be an integer", "'many'"]),
        ({"prompt": 7}, "invalid_prompt", ["`prompt` must be a string"]),
        ({"prompt": "cat " * 60}, "invalid_prompt", ["`prompt`", "at most 77 tokens", "got "]),
    ],
)
def test_r22_invalid_params_are_refused_before_enqueue_naming_field_value_and_limit(
    api: tuple[TestClient, ServerContext], params: dict[str, object], reason: str, fragments: list[str]
) -> None:
    client, ctx = api
    online(ctx, "m1")
    response = submit(client, **params)
    assert response.status_code == 422
    error = response.json()["error"]
    assert error["reason"] == reason
    for fragment in fragments:
        assert fragment in error["message"]
    [journaled] = ctx.journal.list()
    assert (journaled.state, journaled.reason, journaled.machine) == (JobState.rejected, reason, None)
    assert ctx.redis.llen(ctx.keys.queue_list("m1")) == 0
    assert ctx.machines.view("m1").backlog == 0


TXT2IMG_TAKES = "it takes prompt, negative_prompt, width, height, steps, guidance_scale, seed"


@pytest.mark.parametrize(
    ("params", "named"),
    [
        ({"stepz": 4}, "params.stepz is not a param of kind 'txt2img'"),
        ({"batch": 2}, "params.batch is not a param"),  # checked by limits, but no kind makes a batch
        ({"num_frames": 65}, "params.num_frames is not a param"),  # video's own name is frames
        ({"output_width": 8, "output_height": 8}, "params.output_width, params.output_height are not params"),
    ],
)
def test_r22_a_param_the_kind_does_not_use_is_refused_and_journaled_naming_it_and_the_accepted_ones(
    api: tuple[TestClient, ServerContext], params: dict[str, object], named: str
) -> None:
    client, ctx = api
    online(ctx, "m1")
    dry = client.post(
        "/v1/jobs?dry_run=true",
        json={"model": MODEL, "kind": "txt2img", "target": "m1", "params": {"prompt": "a cat", **params}},
    )
    assert dry.status_code == 422 and dry.json()["error"]["reason"] == "unknown_param"
    response = submit(client, **params)
    assert response.status_code == 422
    error = response.json()["error"]
    assert error["reason"] == "unknown_param"
    assert named in error["message"] and TXT2IMG_TAKES in error["message"]
    [journaled] = ctx.journal.list()
    assert (journaled.state, journaled.reason, journaled.id) == (JobState.rejected, "unknown_param", error["job_id"])
    assert ctx.redis.llen(ctx.keys.queue_list("m1")) == 0
    assert (
        submit(client, seed=7, steps=2, guidance_scale=3.0, negative_prompt="dog", width=64, height=64).status_code
        == 202
    )


def test_r22_server_set_output_size_is_added_and_accepted_back_on_an_edit(
    api: tuple[TestClient, ServerContext], tiny_models_dir: Path
) -> None:
    client, ctx = api
    edit_model = edit_model_on_server(ctx, tiny_models_dir)
    image = client.post("/v1/files", files={"file": ("a.png", image_bytes(), "image/png")}).json()["id"]
    body = {"model": edit_model, "kind": "edit", "target": "server", "params": {"prompt": "blue", "image": image}}
    first = client.get(f"/v1/jobs/{client.post('/v1/jobs', json=body).json()['id']}").json()
    assert (first["params"]["output_width"], first["params"]["output_height"]) == (64, 48)
    again = client.post("/v1/jobs", json={**body, "params": first["params"]})  # params copied from the job
    assert again.status_code == 202, again.json()
    refused = client.post("/v1/jobs", json={**body, "params": {"prompt": "blue", "image": image, "width": 64}})
    assert refused.json()["error"]["reason"] == "unknown_param" and "params.width" in refused.json()["error"]["message"]


def test_r22_openai_n_is_checked_per_request_and_hf_parameters_are_not_ignored(
    settings: Settings, tiny_models_dir: Path
) -> None:
    client, ctx = make_api(settings.model_copy(update={"images_wait_s": 1}), tiny_models_dir)
    with client:
        online(ctx, "server")
        too_many = client.post("/v1/images/generations", json={"prompt": "x", "model": MODEL, "n": 5}).json()["error"]
        assert (too_many["param"], too_many["code"]) == ("n", "invalid_n")
        assert "(max_batch of family sd1)" in too_many["message"]
        client.post("/v1/images/generations", json={"prompt": "x", "model": MODEL, "n": 2, "steps": 1})
        # one job makes the n images (params.n), not one job per image
        assert [job.params.get("n") for job in ctx.journal.list([JobState.queued])] == [2]
        missing = client.post("/v1/images/generations", json={"prompt": "x", "model": "no-such-model", "n": 2})
        assert (missing.status_code, missing.json()["error"]["code"]) == (404, "unknown_model")
        assert missing.json()["error"]["param"] == "model"  # OpenAI's param: the field at fault
        # n is the request's, refused before any job exists; an unknown model is a job's refusal, journaled
        refused = ctx.journal.list([JobState.rejected])
        assert [(job.model_id, job.reason) for job in refused] == [("no-such-model", "unknown_model")]
        unknown = client.post(f"/hf/models/{MODEL}", json={"inputs": "x", "parameters": {"scheduler": "DDIM"}})
        assert unknown.status_code == 400
        assert (unknown.json()["error"]["code"], unknown.json()["error"]["param"]) == (
            "unknown_param",
            "parameters.scheduler",
        )
        assert "`parameters.scheduler`" in unknown.json()["error"]["message"]  # named, then what it takes:
        assert "guidance_scale" in unknown.json()["error"]["message"]
        client.post(
            f"/hf/models/{MODEL}", json={"inputs": "x", "parameters": {"guidance_scale": 3.5, "num_inference_steps": 1}}
        )
        hf_job = max(ctx.journal.list([JobState.queued]), key=lambda job: job.created_at)
        assert (hf_job.params["guidance_scale"], hf_job.params["steps"]) == (3.5, 1)


def test_r22_prompt_tokens_are_counted_with_the_models_own_tokenizer(
    api: tuple[TestClient, ServerContext], tiny_models_dir: Path
) -> None:
    from transformers import AutoTokenizer

    client, ctx = api
    online(ctx, "m1")
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_models_dir / MODEL / "tokenizer"))
    prompt = "zebra " * 20  # the tiny byte-level vocabulary spends one token per character
    expected = len(tokenizer(prompt, truncation=False)["input_ids"])
    assert expected > 77
    error = submit(client, prompt=prompt).json()["error"]
    assert f"got {expected}" in error["message"]
    fits = "x" * (77 - 2)  # start and end tokens included
    assert submit(client, prompt=fits).status_code == 202


def test_r22_limits_are_per_family_from_settings(settings: Settings, tiny_models_dir: Path) -> None:
    settings = settings.model_copy(update={"limits": {"sd1": FamilyLimits(max_steps=3), "default": FamilyLimits()}})
    client, ctx = make_api(settings, tiny_models_dir)
    with client:
        online(ctx, "m1")
        error = submit(client, steps=4).json()["error"]
        assert error["reason"] == "invalid_steps" and "between 1 and 3" in error["message"]
        assert submit(client, steps=3).status_code == 202


def test_r22_a_job_input_must_fit_its_model_familys_upload_limits(settings: Settings, tiny_models_dir: Path) -> None:
    settings = settings.model_copy(
        update={
            "limits": {
                "sd1-pix2pix": FamilyLimits(max_upload_bytes=100, upload_media_types=["image/png"]),
                "default": FamilyLimits(),
            }
        }
    )
    client, ctx = make_api(settings, tiny_models_dir)
    with client:
        edit_model = edit_model_on_server(ctx, tiny_models_dir)
        jpeg = client.post("/v1/files", files={"file": ("a.jpg", image_bytes("JPEG"), "image/jpeg")})
        assert jpeg.status_code == 201  # POST /v1/files knows no model: only max_input_bytes applies
        body = {
            "model": edit_model,
            "kind": "edit",
            "target": "server",
            "params": {"prompt": "blue", "image": jpeg.json()["id"]},
        }
        refused = client.post("/v1/jobs", json=body)
        assert refused.status_code == 422
        error = refused.json()["error"]
        assert error["reason"] == "invalid_image"
        assert error["message"] == (
            f"params.image: `image` must be at most 100 bytes (max_upload_bytes), got {jpeg.json()['size_bytes']}"
        )
        assert [job.reason for job in ctx.journal.list([JobState.rejected])] == ["invalid_image"]
        assert ctx.journal.list([JobState.queued]) == [] and ctx.redis.llen(ctx.keys.queue_list("server")) == 0


def test_r23_a_full_machine_answers_429_with_retry_after_and_auto_skips_it(
    settings: Settings, tiny_models_dir: Path
) -> None:
    settings = settings.model_copy(update={"max_queued_per_machine": 2, "retry_after_s": 7})
    client, ctx = make_api(settings, tiny_models_dir)
    with client:
        online(ctx, "m1", "m2")
        assert [submit(client).status_code for _ in range(2)] == [202, 202]
        refused = submit(client)
        assert refused.status_code == 429
        assert refused.headers["Retry-After"] == "7"
        error = refused.json()["error"]
        assert error["reason"] == "queue_full" and "max_queued_per_machine = 2" in error["message"]
        assert ctx.redis.llen(ctx.keys.queue_list("m1")) == 2
        assert ctx.journal.list([JobState.rejected])[0].reason == "queue_full"
        # Auto skips m1 (full) and names why in the dry run.
        accepted = submit(client, target="auto").json()
        assert accepted["machine"] == "m2"
        decision = client.post(
            "/v1/jobs?dry_run=true",
            json={"model": MODEL, "kind": "txt2img", "target": "auto", "params": {"prompt": "x"}},
        ).json()
        assert decision["machines"]["m1"]["reason"] == "queue_full"
        submit(client, target="m2")
        everything_full = submit(client, target="auto")
        assert everything_full.status_code == 429 and everything_full.json()["error"]["reason"] == "queue_full"


def test_r23_past_max_pending_total_submissions_are_refused_with_429(settings: Settings, tiny_models_dir: Path) -> None:
    settings = settings.model_copy(update={"max_pending_total": 3})
    client, ctx = make_api(settings, tiny_models_dir)
    with client:
        online(ctx, "m1", "m2")
        assert [submit(client, target=t).status_code for t in ("m1", "m2", "m1")] == [202, 202, 202]
        refused = submit(client, target="m2")
        assert refused.status_code == 429 and refused.headers["Retry-After"] == "5"
        error = refused.json()["error"]
        assert error["reason"] == "fleet_full" and "max_pending_total = 3" in error["message"]
        assert ctx.redis.llen(ctx.keys.queue_list("m2")) == 1


def test_r24_health_is_503_with_reason_until_a_machine_is_online(api: tuple[TestClient, ServerContext]) -> None:
    client, ctx = api
    unready = client.get("/health", headers={"Authorization": ""})
    assert unready.status_code == 503
    assert unready.json()["error"]["reason"] == "no_machine_online"
    assert unready.json()["redis"] == unready.json()["journal"] == "ok"
    online(ctx, "m2")
    ready = client.get("/health")
    assert ready.status_code == 200 and ready.json()["machines_online"] == ["m2"]


def test_r24_health_is_503_when_redis_does_not_answer(
    settings: Settings, tiny_models_dir: Path, tmp_path: Path
) -> None:
    own = start_redis_server(tmp_path / "redis")  # a Redis this test can stop
    client, ctx = make_api(settings.model_copy(update={"redis_url": own.url}), tiny_models_dir)
    with client:
        online(ctx, "m1")
        assert client.get("/health").status_code == 200
        own.stop()
        unready = client.get("/health")
        assert unready.status_code == 503 and unready.json()["error"]["reason"] == "redis_down"
        assert own.url.rsplit("/", 1)[0] in unready.json()["error"]["message"]


def test_r24_info_names_version_machines_models_and_limits(api: tuple[TestClient, ServerContext]) -> None:
    client, ctx = api
    online(ctx, "m1")
    info = client.get("/info").json()
    assert info["version"] == "0.1.0"
    assert {m["name"]: m["online"] for m in info["machines"]} == {"server": False, "m1": True, "m2": False}
    assert [m["id"] for m in info["models"]] == [MODEL]
    assert info["limits"]["families"]["default"]["max_pixels"] == 1024 * 1024
    assert info["limits"]["max_queued_per_machine"] == 32


def test_r24_metrics_count_queue_size_rejections_and_request_durations(api: tuple[TestClient, ServerContext]) -> None:
    client, ctx = api
    online(ctx, "m1")
    submit(client)
    submit(client)
    submit(client, width=12)
    text = client.get("/metrics", headers={"Authorization": ""}).text
    assert 'homefleet_queue_size{machine="m1"} 2.0' in text
    assert 'homefleet_running_jobs{machine="m1"} 0.0' in text
    assert 'homefleet_rejections_total{reason="invalid_width"} 1.0' in text
    assert 'homefleet_request_duration_seconds_count{method="POST",route="/v1/jobs",status="202"} 2.0' in text
    samples = {
        (s.name, s.labels.get("machine")): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    assert samples[("homefleet_verified_bytes", "m1")] == ctx.registry.get(MODEL).total_bytes > 0
    assert samples[("homefleet_verified_bytes", "m2")] == 0


def test_api_keys_guard_public_routes_but_not_health_metrics_or_worker_routes(
    api: tuple[TestClient, ServerContext],
) -> None:
    client, _ctx = api
    missing = client.get("/v1/machines", headers={"Authorization": ""})
    assert missing.status_code == 401 and missing.json()["error"]["reason"] == "missing_api_key"
    wrong = client.get("/v1/machines", headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401 and wrong.json()["error"]["reason"] == "invalid_api_key"
    assert client.get("/v1/machines").status_code == 200
    assert client.get("/metrics", headers={"Authorization": ""}).status_code == 200
    # An API key is not a machine token: the internal routes refuse it.
    assert client.get("/internal/v1/manifest").status_code == 401


def test_every_public_route_needs_an_api_key(api: tuple[TestClient, ServerContext]) -> None:
    """Every route under /v1, whatever router it lives in (jobs, files, events, images,
    sync, residency, OOMs), answers 401 without a key, before reading its input."""
    client, _ctx = api
    checked = []
    for path, operations in client.app.openapi()["paths"].items():  # type: ignore[attr-defined]
        if not path.startswith("/v1/"):
            continue
        url = re.sub(r"\{[^}]+\}", "x", path)
        for method in operations:
            answer = client.request(method.upper(), url, headers={"Authorization": ""})
            assert answer.status_code == 401, (method, path, answer.status_code, answer.text[:200])
            checked.append(f"{method.upper()} {path}")
    assert {"PUT /v1/machines/{machine}/residency", "GET /v1/ooms", "DELETE /v1/ooms", "POST /v1/jobs"} <= set(checked)


def test_without_api_keys_the_server_refuses_to_start_unless_open_access_is_explicit(settings: Settings) -> None:
    with pytest.raises(OpenApiRefused, match="HOMEFLEET_API_KEYS"):
        create_app(settings.model_copy(update={"api_keys": []}))
    ctx = build_context(settings, make_fleet(), migrate=True)
    with TestClient(create_app(settings.model_copy(update={"api_keys": [], "allow_open_api": True}), ctx)) as client:
        assert client.get("/v1/machines").status_code == 200


def test_openai_route_errors_have_openai_shape(api: tuple[TestClient, ServerContext]) -> None:
    client, ctx = api
    online(ctx, "m1")
    body = client.post("/v1/images/generations", json={"prompt": "x", "model": MODEL, "size": "500x512"}).json()
    assert body["error"] == {
        "message": "`size` (width) must be a multiple of 8 and at least 8 pixels, got 500",
        "type": "invalid_request_error",
        "param": "size",  # the client's field
        "code": "invalid_width",
    }
    large = client.post("/v1/images/generations", json={"prompt": "x", "model": MODEL, "size": "4096x4096"}).json()
    assert (large["error"]["param"], large["error"]["code"]) == ("size", "invalid_size")
    assert large["error"]["message"].startswith(  # both sides named as the client's one field
        "`size` (width x height) must be at most 1048576 pixels, got 4096 x 4096 = 16777216"
    ), large
    shape = client.post("/v1/images/generations", json={"prompt": "x", "size": "big"}).json()["error"]
    assert (shape["param"], shape["code"]) == ("size", "invalid_size")
    missing = client.post("/v1/images/generations", json={"n": 1}).json()["error"]
    assert (missing["param"], missing["type"]) == ("prompt", "invalid_request_error") and "prompt" in missing["message"]
    # the value is shown as the client sent it: the number 0, not the string '0'
    none = client.post("/v1/images/generations", json={"prompt": "x", "n": 0}).json()["error"]
    assert none["param"] == "n" and none["message"].endswith(", got 0"), none
    many = client.post("/v1/images/generations", json={"prompt": "x", "n": 1000}).json()["error"]
    assert (none["code"], many["code"]) == ("invalid_n", "invalid_n"), (none, many)  # one code at either end
    text = client.post("/v1/images/generations", json={"prompt": "x", "n": "two"}).json()["error"]
    assert text["param"] == "n" and text["message"].endswith(", got 'two'"), text
    unauthorized = client.post("/v1/images/generations", json={"prompt": "x"}, headers={"Authorization": ""})
    assert unauthorized.status_code == 401 and unauthorized.json()["error"]["type"] == "authentication_error"


def test_r20_an_openai_error_after_a_job_was_submitted_says_do_not_retry(
    settings: Settings, tiny_models_dir: Path
) -> None:
    """``POST /v1/images/edits`` with ``n`` runs one edit job per image (the edit kind takes no
    ``n``; generations make one job for n images): the second job's refusal comes after the
    first exists."""
    settings = settings.model_copy(update={"max_queued_per_machine": 1})
    client, ctx = make_api(settings, tiny_models_dir)
    with client:
        edit_model = edit_model_on_server(ctx, tiny_models_dir)
        files = {"image": ("a.png", image_bytes(), "image/png")}
        response = client.post("/v1/images/edits", data={"prompt": "x", "model": edit_model, "n": "2"}, files=files)
        assert response.status_code == 429
        assert response.headers["x-should-retry"] == "false"
        assert response.json()["error"]["code"] == "queue_full"
        assert (
            ctx.redis.llen(ctx.keys.queue_list("server")) == 1
        )  # the first image's job was created: a retry would duplicate it
        before = client.post("/v1/images/edits", data={"prompt": "x", "model": edit_model}, files=files)
        assert before.status_code == 429 and "x-should-retry" not in before.headers  # nothing submitted: retry is safe


def test_r20_the_default_image_wait_ends_well_before_the_openai_sdk_gives_up() -> None:
    """The SDK's read timeout (600 s) ending first would make it resend the request itself,
    before the server's answer with ``x-should-retry: false`` arrives: up to 3 jobs."""
    import openai

    sdk_timeout_s = openai.DEFAULT_TIMEOUT.read
    assert sdk_timeout_s is not None
    assert Settings.model_fields["images_wait_s"].default <= sdk_timeout_s - 60


def succeed_without_result(ctx: ServerContext, missing: Path, stop: threading.Event) -> None:
    """Play a worker whose stored result is gone when the route reads it: every queued job is
    claimed and journaled ``succeeded`` with ``missing`` as its result path."""
    while not stop.is_set():
        for job in ctx.journal.list([JobState.queued]):
            assert job.machine is not None
            ctx.journal.claim(job.id, job.machine)
            ctx.journal.succeed(job.id, job.machine, result_path=str(missing), result_media_type="image/png")
        time.sleep(0.05)


def test_r20_a_result_gone_after_its_job_was_submitted_is_named_and_not_to_be_resent(
    settings: Settings, tiny_models_dir: Path, tmp_path: Path
) -> None:
    ctx = build_context(settings.model_copy(update={"images_wait_s": 30}), make_fleet("m1", "m2"), migrate=True)
    ctx.registry.add(tiny_models_dir / MODEL, MODEL)
    client = TestClient(create_app(ctx.settings, ctx), headers=AUTH, raise_server_exceptions=False)
    stop = threading.Event()
    worker = threading.Thread(target=succeed_without_result, args=(ctx, tmp_path / "gone.png", stop), daemon=True)
    with client:
        online(ctx, "server")
        worker.start()
        try:
            generated = client.post("/v1/images/generations", json={"prompt": "a", "model": MODEL, "steps": 1})
            hf = client.post(f"/hf/models/{MODEL}", json={"inputs": "b", "parameters": {"num_inference_steps": 1}})
        finally:
            stop.set()
            worker.join()
    jobs = {job.params["prompt"]: job.id for job in ctx.journal.list()}
    assert len(jobs) == 2  # one job per call: nothing was resubmitted
    for prompt, response in (("a", generated), ("b", hf)):  # the result gone: named, with its fix
        assert response.status_code == 404 and response.headers["x-should-retry"] == "false"
        error = response.json()["error"]
        assert (error["code"], error["job_ids"]) == ("result_missing", [jobs[prompt]]), error
        assert f"homefleet jobs requeue {jobs[prompt]}" in str(error)


def test_r20_any_other_error_once_a_job_exists_is_500_naming_the_jobs_and_not_to_resubmit() -> None:
    """What fails after a call's jobs were submitted, and is not Homefleet's own error (a bug, a
    file that cannot be read), is answered 500 ``internal_error`` naming the jobs and saying not
    to resubmit (``app.api.routes.images.submitted``), so no client makes a second job (R20)."""
    from app.api.routes.images import AfterSubmit, submitted

    with pytest.raises(AfterSubmit) as after, submitted(["job-1"]):
        raise IsADirectoryError("results/job-1.png")
    assert (after.value.reason, after.value.status_code, after.value.job_ids) == ("internal_error", 500, ["job-1"])
    message = after.value.message
    assert "IsADirectoryError after jobs job-1 were submitted" in message and "do not resubmit" in message
    with pytest.raises(IsADirectoryError), submitted([]):  # before any job: the error as raised
        raise IsADirectoryError("results/none.png")


def test_r22_openai_edits_validate_the_upload_then_run_an_edit_job_on_it(
    settings: Settings, tiny_models_dir: Path
) -> None:
    client, ctx = make_api(settings.model_copy(update={"images_wait_s": 1}), tiny_models_dir)
    with client:
        assert (
            client.post("/v1/images/edits", data={"prompt": "x"}, files={"image": ("a.png", b"x", "image/png")}).json()[
                "error"
            ]["code"]
            == "no_model"
        )
        edit_model = edit_model_on_server(ctx, tiny_models_dir)
        fields = {"prompt": "make it blue"}
        wrong_type = client.post(
            "/v1/images/edits", data=fields, files={"image": ("a.png", b"GIF89a....", "image/png")}
        )
        assert wrong_type.status_code == 400
        error = wrong_type.json()["error"]
        assert error["param"] == "image" and "got 'image/gif'" in error["message"]  # sniffed: not what it claims
        png = image_bytes()
        big = client.post(
            "/v1/images/edits", data=fields, files={"image": ("a.png", png + b"\x00" * (16 * 1024 * 1024), "image/png")}
        ).json()["error"]
        assert big["code"] == "invalid_image" and "at most 16777216 bytes" in big["message"]
        assert f"got {len(png) + 16 * 1024 * 1024}" in big["message"]  # the upload's size, not the limit + 1 read
        # No worker runs here: the edit job is queued on the stored input, the wait runs out,
        # and the answer names the job and says not to retry (the job exists, R20, C10).
        waited = client.post("/v1/images/edits", data=fields, files={"image": ("a.png", png, "image/png")})
        assert waited.status_code == 409 and waited.headers["x-should-retry"] == "false"
        [job] = ctx.journal.list([JobState.queued])
        assert (waited.json()["error"]["code"], waited.json()["error"]["job_ids"]) == ("job_pending", [job.id])
        assert (job.kind, job.model_id, job.params["prompt"]) == ("edit", edit_model, "make it blue")
        assert ctx.inputs.get(job.params["image"]).path.read_bytes() == png


def test_r22_openai_edits_refuse_a_mask_or_a_second_file_never_dropping_it(
    settings: Settings, tiny_models_dir: Path
) -> None:
    import openai

    client, ctx = make_api(settings.model_copy(update={"images_wait_s": 0}), tiny_models_dir)
    with client:
        edit_model = edit_model_on_server(ctx, tiny_models_dir)
        png = ("a.png", image_bytes(), "image/png")
        sdk = openai.OpenAI(api_key=TEST_API_KEY, base_url=f"{client.base_url}/v1", http_client=client, max_retries=0)
        asked = {"model": edit_model, "prompt": "make it blue"}
        with pytest.raises(openai.BadRequestError) as masked:  # the SDK's mask: an inpaint, not run here
            sdk.images.edit(image=png, mask=png, **asked)
        assert (masked.value.code, masked.value.param) == ("unknown_param", "mask")
        assert "`inpaint` job" in masked.value.message and "params.mask" in masked.value.message
        with pytest.raises(openai.BadRequestError) as two:  # a list: the SDK sends image[] twice
            sdk.images.edit(image=[png, png], **asked)
        assert (two.value.code, two.value.param) == ("invalid_image", "image")
        assert "must be one file, the image to edit; got 2" in two.value.message
        other = client.post("/v1/images/edits", data=asked, files=[("image", png), ("extra", png)], headers=AUTH)
        assert other.status_code == 400 and other.json()["error"]["param"] == "extra"
        nothing = client.post("/v1/images/edits", data=asked, headers=AUTH)
        assert nothing.status_code == 400 and "got 0" in nothing.json()["error"]["message"]
        assert ctx.journal.list([JobState.queued]) == []  # none of these made a job
        with pytest.raises(openai.ConflictError):  # a list of one is the image: its job is queued (no worker)
            sdk.images.edit(image=[png], **asked)
        [job] = ctx.journal.list([JobState.queued])
        assert ctx.inputs.get(job.params["image"]).path.read_bytes() == png[1]


def test_openai_edits_take_nested_extras_as_the_sdk_encodes_them_in_a_form(
    settings: Settings, tiny_models_dir: Path, tmp_path: Path
) -> None:
    """The openai SDK sends ``images.edit``'s ``extra_body`` as multipart fields, a list of
    objects in its bracket encoding (``adapters[][id]``, ``adapters[][scale]``): rebuilt into
    the list the job's params take, in order, each scale a number (R22's checks then apply)."""
    import openai

    from app.devtools.tiny_models import make_tiny_lora

    client, ctx = make_api(settings.model_copy(update={"images_wait_s": 0}), tiny_models_dir)
    with client:
        edit_model = edit_model_on_server(ctx, tiny_models_dir)
        lora = make_tiny_lora(tiny_models_dir / "tiny-pix2pix", tmp_path / "pix2pix-lora")
        for adapter in ("p2p-a", "p2p-b"):
            ctx.registry.add(lora, adapter, adapter_of="sd1-pix2pix")
            ctx.redis.sadd(ctx.keys.verified("server"), adapter)
        png = ("a.png", image_bytes(), "image/png")
        sdk = openai.OpenAI(api_key=TEST_API_KEY, base_url=f"{client.base_url}/v1", http_client=client, max_retries=0)
        asked = {"image": png, "model": edit_model, "prompt": "make it blue"}
        adapters = [{"id": "p2p-a", "scale": 0.5}, {"id": "p2p-b", "scale": -1}]
        with pytest.raises(openai.ConflictError):  # queued (no worker runs here)
            sdk.images.edit(**asked, extra_body={"adapters": adapters, "steps": 2})
        [job] = ctx.journal.list([JobState.queued])
        assert job.params["adapters"] == [{"id": "p2p-a", "scale": 0.5}, {"id": "p2p-b", "scale": -1.0}]
        assert job.params["steps"] == 2
        # One object without a field the other has: the SDK's form cannot say whose the scale is.
        with pytest.raises(openai.BadRequestError) as unclear:
            sdk.images.edit(**asked, extra_body={"adapters": [{"id": "p2p-a"}, {"id": "p2p-b", "scale": 0.5}]})
        assert (unclear.value.code, unclear.value.param) == ("invalid_params", "adapters")
        assert "2 adapters[][id], 1 adapters[][scale]" in unclear.value.message
        assert "json.dumps" in unclear.value.message
        with pytest.raises(openai.ConflictError):  # as the message says: one JSON string
            sdk.images.edit(
                **asked, extra_body={"adapters": json.dumps([{"id": "p2p-a"}, {"id": "p2p-b", "scale": 0.5}])}
            )
        assert ctx.journal.list([JobState.queued])[-1].params["adapters"] == [
            {"id": "p2p-a", "scale": 1.0},
            {"id": "p2p-b", "scale": 0.5},
        ]
        with pytest.raises(openai.BadRequestError) as refused:  # the rebuilt list is checked as ever
            sdk.images.edit(**asked, extra_body={"adapters": [{"id": "p2p-a", "scale": 9}]})
        assert (
            refused.value.code == "invalid_adapters" and "scale must be a number from -4 to 4" in refused.value.message
        )


def test_a_request_while_redis_is_down_gets_a_503_naming_it_not_a_bare_500(
    settings: Settings, tiny_models_dir: Path
) -> None:
    from app.devtools.redis_server import free_port

    before, up = make_api(settings, tiny_models_dir)  # the model is registered in the journal's database
    online(up, "m1")  # and two jobs journaled on m1: one queued, one running
    queued, running = (
        before.post(
            "/v1/jobs", json={"model": MODEL, "kind": "txt2img", "params": {"prompt": "x"}, "target": "m1"}
        ).json()["id"]
        for _ in range(2)
    )
    up.endings.claim(running, "m1")
    up.close()
    down = settings.model_copy(update={"redis_url": f"redis://:s3cret@127.0.0.1:{free_port()}/0"})
    ctx = build_context(down, make_fleet("m1"), migrate=True)
    try:
        client = TestClient(create_app(down, ctx), headers=AUTH)  # no lifespan: its reconciliation needs Redis
        answer = client.post("/v1/jobs", json={"model": MODEL, "kind": "txt2img", "params": {"prompt": "x"}})
        assert answer.status_code == 503, answer.text
        error = answer.json()["error"]
        assert error["reason"] == "redis_down" and "redis://:***@127.0.0.1" in error["message"]
        assert "s3cret" not in answer.text  # the password never reaches a client
        assert answer.headers["retry-after"] == str(down.retry_after_s)
        openai = client.post("/v1/images/generations", json={"model": MODEL, "prompt": "x"})
        assert openai.status_code == 503 and openai.json()["error"]["code"] == "redis_down"
        health = client.get("/health")
        assert health.status_code == 503 and "s3cret" not in health.text
        # reading jobs needs only the journal: answered, without what only Redis knows (progress, machines)
        listed = client.get("/v1/jobs")
        assert listed.status_code == 200, listed.text
        assert [(job["id"], job["state"], job["progress"]) for job in listed.json()] == [
            (running, "running", None),  # newest first
            (queued, "queued", None),
        ]
        one = client.get(f"/v1/jobs/{queued}")
        assert one.status_code == 200 and one.json()["note"].startswith("Redis does not answer (redis_down)")
    finally:
        ctx.close()


def test_a_submission_while_the_journals_disk_is_full_is_a_503_saying_so_not_a_database_down(
    api: tuple[TestClient, ServerContext],
) -> None:
    """The journal's SQLite file cannot grow (its disk full; here SQLite's own limit,
    ``max_page_count``, which fails its writes with the same ``SQLITE_FULL``): a submission was
    answered "the journal's database does not answer (OperationalError)", while /health said the
    journal is fine, so the operator looked for a database outage. It is still 503 ``journal_down``
    with Retry-After (a worker's claim waits it out, docs/operations.md "A full disk"), but the
    message says the disk that holds the journal is full and to free space there."""
    from sqlalchemy import event

    client, ctx = api
    online(ctx, "m1")

    def no_room_to_grow(connection: Any, _record: object) -> None:
        pages = connection.execute("PRAGMA page_count").fetchone()[0]
        connection.execute(f"PRAGMA max_page_count = {pages}")

    event.listen(ctx.engine, "connect", no_room_to_grow)
    ctx.engine.dispose()  # every connection from now on is opened with the limit
    answers = []
    for _ in range(500):  # rows fill the pages there are; then a write needs one more
        answers.append(submit(client, steps=2, seed=len(answers)))
        if answers[-1].status_code != 202:
            break
    refused = answers[-1]
    assert refused.status_code == 503, refused.text
    error = refused.json()["error"]
    assert error["reason"] == "journal_down"
    assert "cannot write: the disk or quota that holds it is full" in error["message"], error["message"]
    assert "database or disk is full" in error["message"] and "free some space" in error["message"]
    assert str(ctx.settings.data_dir / "journal.db") in error["message"]
    assert refused.headers["retry-after"] == str(ctx.settings.retry_after_s)


def png_bytes(side: int, noise: bool = False) -> bytes:
    image = Image.effect_noise((side, side), 64).convert("RGB") if noise else Image.new("RGB", (side, side))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def test_r22_a_request_body_over_max_request_bytes_is_413_before_anything_is_stored(
    settings: Settings, tiny_models_dir: Path
) -> None:
    """One request with a huge prompt was read whole, then kept whole in the journal as a
    refused job (20 MB each). Past ``max_request_bytes`` a body is refused from its
    Content-Length, or while it streams in (chunked); nothing is journaled. Uploads have their
    own limits (multipart passes); the OpenAI routes answer in their own shape."""
    client, ctx = make_api(settings.model_copy(update={"max_request_bytes": 4096}), tiny_models_dir)
    online(ctx, "m1")
    with client:
        jobs_before = len(ctx.journal.list())
        big = {"model": MODEL, "kind": "txt2img", "target": "m1", "params": {"prompt": "x" * 10_000}}
        answer = client.post("/v1/jobs", json=big)
        assert answer.status_code == 413, answer.text
        assert answer.json()["error"]["reason"] == "request_too_large"
        assert "at most 4096 bytes (max_request_bytes), got 100" in answer.json()["error"]["message"]

        def chunks() -> Iterator[bytes]:  # no Content-Length: sent chunked
            body = json.dumps(big).encode()
            for start in range(0, len(body), 1000):
                yield body[start : start + 1000]

        answer = client.post("/v1/jobs", content=chunks(), headers={"content-type": "application/json"})
        assert answer.status_code == 413 and "got more than 4096 bytes" in answer.json()["error"]["message"]
        for claimed in ("text/plain", "multipart/form-data; boundary=x"):  # whatever it claims to be
            answer = client.post("/v1/jobs", content=json.dumps(big).encode(), headers={"content-type": claimed})
            assert answer.status_code == 413, (claimed, answer.text)
        answer = client.post("/v1/images/generations", json={"model": MODEL, "prompt": "x" * 10_000})
        assert answer.status_code == 413
        assert answer.json()["error"]["code"] == "request_too_large" and answer.json()["error"]["type"]
        assert len(ctx.journal.list()) == jobs_before  # nothing journaled

        upload = png_bytes(64, noise=True)
        assert len(upload) > 4096
        stored = client.post("/v1/files", files={"file": ("in.png", upload, "image/png")})
        assert stored.status_code == 201, stored.text  # an upload route: max_input_bytes applies
        huge = b"\x89PNG" + bytes(ctx.settings.max_input_bytes + 1024 * 1024)
        answer = client.post("/v1/files", files={"file": ("in.png", huge, "image/png")})
        assert answer.status_code == 413 and "(max_input_bytes + 1 MiB)" in answer.json()["error"]["message"]
        assert submit(client, "m1").status_code == 202  # a small body still passes


def test_r19_a_refused_job_keeps_its_reason_but_not_a_huge_param_whole(api: tuple[TestClient, ServerContext]) -> None:
    client, ctx = api
    online(ctx, "m1")
    answer = submit(client, "m1", prompt="y" * 100_000, style=["z" * 50] * 100)
    assert answer.status_code == 422
    job = client.get(f"/v1/jobs/{answer.json()['error']['job_id']}").json()
    assert job["state"] == "rejected" and job["reason"] == answer.json()["error"]["reason"]
    assert job["params"]["prompt"] == "y" * 200 + "… (100000 characters; abridged)"
    assert job["params"]["style"].endswith("characters; abridged)") and len(job["params"]["style"]) < 300
    assert job["params"]["seed"] == ctx.journal.get(job["id"]).params["seed"]  # short params are kept whole


def test_r19_r24_a_server_whose_redis_was_paired_with_another_journal_stops_placing_and_says_why(
    settings: Settings, tiny_models_dir: Path
) -> None:
    """The pairing is checked at start and by every reconciliation pass. Paired with another
    journal later (``homefleet db pair`` elsewhere): the server places nothing (503
    ``journal_mismatch``, nothing journaled) and /health says why, until the pairing is its
    own again."""
    client, ctx = make_api(settings.model_copy(update={"reconcile_interval_s": 0.2}), tiny_models_dir)
    online(ctx, "m1")
    with client:
        deadline = time.monotonic() + 10
        while ctx.redis.get(ctx.keys.journal()) is None:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        mine = ctx.redis.get(ctx.keys.journal())
        assert submit(client, "m1").status_code == 202
        ctx.redis.set(ctx.keys.journal(), "another-journal")
        deadline = time.monotonic() + 10
        while client.get("/health").status_code != 503:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert client.get("/health").json()["error"]["reason"] == "journal_mismatch"
        jobs = len(ctx.journal.list())
        refused = submit(client, "m1")
        assert refused.status_code == 503 and refused.json()["error"]["reason"] == "journal_mismatch"
        assert "Retry-After" in refused.headers and len(ctx.journal.list()) == jobs
        ctx.redis.set(ctx.keys.journal(), mine)
        deadline = time.monotonic() + 10
        while client.get("/health").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert submit(client, "m1").status_code == 202


@pytest.mark.parametrize(
    ("field", "value", "allowed"),
    [("output_format", "jpeg", '"png"'), ("output_format", "webp", '"png"'), ("background", "transparent", '"auto"')],
)
def test_an_openai_image_field_asking_for_another_file_is_refused_not_ignored(
    api: tuple[TestClient, ServerContext], field: str, value: str, allowed: str
) -> None:
    """A client asking for a JPEG (or a transparent background) was handed a PNG it believed
    was what it asked for: such values are 400 (OpenAI's status) naming the field, before any job exists."""
    client, ctx = api
    online(ctx, "m1")
    answer = client.post("/v1/images/generations", json={"prompt": "x", "model": MODEL, field: value})
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert (error["param"], error["code"]) == (field, "unknown_param"), error
    assert f"`{field}` is not supported by Homefleet" in error["message"] and allowed in error["message"], error
    assert "(in OpenAI's image fields: Homefleet returns PNG files)" in error["message"], error  # no extra
    assert f"accepted only as null or {allowed}" in error["message"], error  # null named once
    assert ctx.journal.list() == [] or all(j.state == JobState.rejected for j in ctx.journal.list())


def test_an_openai_route_this_server_does_not_answer_is_openais_404_naming_the_ones_it_does(
    api: tuple[TestClient, ServerContext],
) -> None:
    """``client.embeddings.create`` against Homefleet: the SDK's NotFoundError carries OpenAI's
    shape and says which routes the server answers (it was Homefleet's bare "Not Found")."""
    import openai

    client, _ctx = api
    sdk = openai.OpenAI(api_key=TEST_API_KEY, base_url=f"{client.base_url}/v1", http_client=client, max_retries=0)
    with pytest.raises(openai.NotFoundError) as missing:
        sdk.embeddings.create(model="tiny-llama", input="hi")
    body = missing.value.body
    assert isinstance(body, dict) and body["type"] == "not_found_error" and body["param"] is None, body
    assert body["message"].startswith("Invalid URL (POST /v1/embeddings): this server answers OpenAI's")
    assert "/v1/chat/completions" in missing.value.message
    ours = client.get("/v1/jobz")  # Homefleet's own paths keep Homefleet's shape
    assert ours.status_code == 404 and ours.json()["error"]["reason"] == "not_found"


def job_events(url: str, job_id: str, on_event: Callable[[str, Any], None] | None = None) -> list[tuple[str, Any]]:
    """Every (event, data) of ``GET /v1/jobs/{job_id}/events`` on the API served at ``url``, until
    the server closes the stream; ``on_event`` is called with each as it arrives."""
    events: list[tuple[str, Any]] = []
    name = "message"
    with httpx.stream(
        "GET", f"{url}/v1/jobs/{job_id}/events", headers=AUTH, timeout=30, verify=tls_context()
    ) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line.startswith("event:"):
                name = line.removeprefix("event:").strip()
            elif line.startswith("data:"):
                events.append((name, json.loads(line.removeprefix("data:").strip())))
                if on_event is not None:
                    on_event(*events[-1])
    return events


def test_r24_an_ended_jobs_events_are_its_state_then_its_end_with_no_past_progress(
    ctx: ServerContext, tiny_models_dir: Path, tmp_path: Path
) -> None:
    """A job that has ended (succeeded, or failed) after reporting its steps: its event stream
    is its ``state`` then its ``end`` at once, not the last ``progress`` first (docs/api.md,
    Events). A job followed while it runs still gets its new steps, the last one read before
    its end. Through the real API served by uvicorn, on a real Redis and journal."""
    ctx.registry.add(tiny_models_dir / MODEL, MODEL)
    online(ctx, "m1")
    result = tmp_path / "result.png"
    result.write_bytes(image_bytes())

    def submitted() -> str:
        job_id = str(ctx.dispatcher.submit(MODEL, "txt2img", {"prompt": "a cat", "steps": 4}, "m1").job.id)
        ctx.endings.claim(job_id, "m1")
        return job_id

    def succeed(job_id: str) -> None:
        ctx.endings.succeed(job_id, "m1", result_path=str(result), result_media_type="image/png", result_digest="d")

    done, failed = submitted(), submitted()
    for job_id in (done, failed):
        ctx.progress.report(job_id, 4, 4)
    succeed(done)
    ctx.endings.fail(failed, "m1", "error", "boom")
    with served_api(ctx) as url:
        for job_id, state in ((done, "succeeded"), (failed, "failed")):
            events = job_events(url, job_id)
            assert [name for name, _ in events] == ["state", "end"], events
            assert events[0][1]["state"] == events[1][1]["state"] == state
        assert events[0][1]["reason"] == "error"
        assert job_events(url, done)[1][1]["result_url"] == f"/v1/jobs/{done}/result"

        running = submitted()
        ctx.progress.report(running, 1, 4)

        def drive(name: str, data: Any) -> None:  # the worker's next reports, once the stream shows each
            if (name, data) == ("progress", {"step": 1, "total": 4}):
                ctx.progress.report(running, 3, 4)
            elif (name, data) == ("progress", {"step": 3, "total": 4}):
                ctx.progress.report(running, 4, 4)
                succeed(running)

        followed = job_events(url, running, drive)
    assert [(name, data.get("step") or data.get("state")) for name, data in followed] == [
        ("state", "running"),
        ("progress", 1),
        ("progress", 3),
        ("progress", 4),  # reported just before the end: read before it
        ("state", "succeeded"),
        ("end", "succeeded"),
    ], followed
