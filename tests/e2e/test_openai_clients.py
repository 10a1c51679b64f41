"""What real clients send, through the official ``openai`` SDK against the session's running
fleet (real API process, real ``celery worker`` processes, tiny pipelines): Homefleet params
given as the SDK's ``extra_body`` on the image routes are honoured or refused, never ignored
(R22); errors name the field the client sent (docs/api.md, "OpenAI and Hugging Face routes")."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from PIL import Image

from app.core.tls import tls_context
from app.db.tables import Job
from app.devtools.train_shapes import MODEL_NAMES
from tests.e2e.conftest import SHAPES_MACHINE, RunningFleet
from tests.helpers import TEST_API_KEY, run_cli

pytestmark = pytest.mark.e2e


@pytest.fixture
def sdk(fleet: RunningFleet) -> Iterator[openai.OpenAI]:
    client = openai.OpenAI(base_url=f"{fleet.local.api_url}/v1", api_key=TEST_API_KEY, max_retries=0, timeout=120)
    yield client
    client.close()


def jobs_with_prompt(fleet: RunningFleet, prompt: str) -> list[Job]:
    return [job for job in fleet.ctx.journal.list() if job.params.get("prompt") == prompt]


def pixels(b64: str | None) -> bytes:
    assert b64 is not None
    return Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB").tobytes()


def test_image_extras_are_job_params_and_an_unknown_one_is_refused(fleet: RunningFleet, sdk: openai.OpenAI) -> None:
    """``extra_body={"seed": 11, "guidance_scale": 3}`` runs with them (journaled): the same seed
    twice gives identical pixels, another seed other pixels; a misspelt ``stepz`` is a 422
    naming it, before any job."""

    def generate(seed: int) -> bytes:
        done = sdk.images.generate(
            model=fleet.model,
            prompt="extras seeded",
            size="64x64",  # type: ignore[arg-type]
            extra_body={"seed": seed, "steps": 2, "guidance_scale": 3.0, "target": "m1"},
        )
        return pixels(done.data[0].b64_json if done.data else None)

    first, again, other = generate(11), generate(11), generate(12)
    assert first == again and first != other
    jobs = jobs_with_prompt(fleet, "extras seeded")
    assert [(job.params["seed"], job.params["guidance_scale"], job.state) for job in jobs] == [
        (11, 3.0, "succeeded"),
        (11, 3.0, "succeeded"),
        (12, 3.0, "succeeded"),
    ]
    with pytest.raises(openai.BadRequestError) as misspelt:
        sdk.images.generate(
            model=fleet.model,
            prompt="extras misspelt",
            size="64x64",  # type: ignore[arg-type]
            extra_body={"stepz": 2},
        )
    body = misspelt.value.body
    assert isinstance(body, dict) and body["param"] == "stepz" and body["code"] == "unknown_param"
    assert "`stepz`" in body["message"] and "guidance_scale" in body["message"]
    assert jobs_with_prompt(fleet, "extras misspelt") == []
    edited = sdk.images.edit(
        model="tiny-pix2pix",
        image=("in.png", png(32, 32), "image/png"),
        prompt="extras edit seeded",
        extra_body={"seed": 5, "steps": 1},
    )
    assert edited.data and edited.data[0].b64_json
    [edit] = jobs_with_prompt(fleet, "extras edit seeded")  # multipart extras: parsed as JSON, journaled
    assert (edit.params["seed"], edit.params["steps"], edit.state) == (5, 1, "succeeded")
    with pytest.raises(openai.BadRequestError) as edit_extra:
        sdk.images.edit(
            model="tiny-pix2pix",
            image=("in.png", png(32, 32), "image/png"),
            prompt="extras edit",
            extra_body={"stepz": "2"},
        )
    assert isinstance(edit_extra.value.body, dict) and edit_extra.value.body["param"] == "stepz"


def png(width: int, height: int) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (40, 90, 200)).save(buffer, format="PNG")
    return buffer.getvalue()


def test_a_size_refusal_names_size(fleet: RunningFleet, sdk: openai.OpenAI) -> None:
    """``size`` becomes the job's width and height: a side that is not a multiple of 8 is refused
    naming ``size`` (param and message), not ``width``; an extra's bad value names the extra."""
    with pytest.raises(openai.BadRequestError) as odd:
        sdk.images.generate(model=fleet.model, prompt="odd size", size="60x64")  # type: ignore[arg-type]
    body = odd.value.body
    assert isinstance(body, dict) and body["param"] == "size" and body["code"] == "invalid_width"
    assert body["message"].startswith("`size` (width) must be a multiple of 8"), body["message"]
    with pytest.raises(openai.BadRequestError) as guidance:
        sdk.images.generate(
            model=fleet.model,
            prompt="odd guidance",
            size="64x64",  # type: ignore[arg-type]
            extra_body={"guidance_scale": 500},
        )
    assert isinstance(guidance.value.body, dict) and guidance.value.body["param"] == "guidance_scale"
    assert "params." not in guidance.value.body["message"]


def test_a_models_own_default_applies_when_the_job_does_not_set_it(fleet: RunningFleet, tiny_models_dir: Path) -> None:
    """The shapes models were registered with ``--default guidance_scale=4`` (and their 32 px; tests/e2e/conftest.py,
    as the demo does): GET /v1/models shows it; a job without guidance runs with 4 (journaled
    params and the result's provenance), the client's 7 wins. A default that is not a param of
    the model's kinds, or out of range, is refused at registration naming it; nothing registered."""
    model = MODEL_NAMES["filled"]
    assert fleet.client.model(model)["defaults"] == {"guidance_scale": 4, "width": 32, "height": 32}  # trained at 32
    assert fleet.client.model(fleet.model)["defaults"] == {}
    prompt = {"prompt": "a red circle on a black background", "steps": 2, "width": 32, "height": 32}
    plain = fleet.client.submit(model, "txt2img", prompt, target=SHAPES_MACHINE)
    own = fleet.client.submit(model, "txt2img", {**prompt, "guidance_scale": 7}, target=SHAPES_MACHINE)
    for job, guidance in ((plain, 4), (own, 7)):
        done = fleet.client.wait(job["id"], timeout_s=300)
        assert done["state"] == "succeeded", done
        record = fleet.ctx.journal.get(job["id"])
        assert record.params["guidance_scale"] == guidance
        assert record.provenance is not None and record.provenance["params"]["guidance_scale"] == guidance
    env = {
        "HOMEFLEET_DATA_DIR": str(fleet.local.settings.data_dir),
        "HOMEFLEET_FLEET_FILE": str(fleet.local.fleet_file),
        "HOMEFLEET_REDIS_URL": fleet.local.settings.redis_url,
    }
    for given, named in (
        ("stepz=3", "'stepz' is not a param of txt2img"),
        ("guidance_scale=500", "guidance_scale must be a number from 0 to 50, got 500"),
        ("steps=abc", "error (invalid_default): default `steps` must be an integer, got 'abc'"),
        ("width=63", "error (invalid_default): default `width` must be a multiple of 8"),
    ):
        refused = run_cli(
            "models",
            "add",
            str(tiny_models_dir / fleet.model),
            "--id",
            "tiny-sd-bad-default",
            "--default",
            given,
            env=env,
            check=False,
        )
        assert refused.returncode != 0 and named in refused.stdout + refused.stderr, refused.stdout + refused.stderr
    assert "tiny-sd-bad-default" not in {m["id"] for m in fleet.client.models()}


def test_huggingface_image_tasks_at_the_servers_root_say_where_images_are_served(fleet: RunningFleet) -> None:
    """``InferenceClient(base_url=SERVER)``, as docs/api.md shows for ``text_generation``, asked for
    ``text_to_image`` or ``image_to_image``: the client posts to ``POST /``, TGI's text route. It
    was told ``parameters.width`` is no TGI parameter, or (no parameter given) that no model runs
    text; the answer now says that ``POST /`` generates text and that images are served at
    ``/hf/models/<model>`` and ``/hf``, naming the models, before any job (R22)."""
    from huggingface_hub import InferenceClient
    from huggingface_hub.errors import HfHubHTTPError

    root = InferenceClient(base_url=fleet.local.api_url, api_key=TEST_API_KEY)
    source = io.BytesIO()
    Image.new("RGB", (32, 32), (40, 90, 200)).save(source, format="PNG")
    for name, call in (
        ("sized", lambda: root.text_to_image("root sized", width=64, height=64, num_inference_steps=2)),
        ("plain", lambda: root.text_to_image("root plain")),
        ("image", lambda: root.image_to_image(source.getvalue(), prompt="root image")),
        ("raw", lambda: root.image_to_image(source.getvalue())),  # the image's bytes as the whole body
    ):
        with pytest.raises(HfHubHTTPError) as refused:
            call()
        response = refused.value.response
        assert response is not None and response.status_code == 422, (name, response)
        error = response.json()
        assert (error["reason"], error["error_type"]) == ("unsupported_kind", "validation"), (name, error)
        assert "POST / generates text" in error["error"], (name, error)
        assert f"/hf/models/{fleet.model}" in error["error"] and "/hf" in error["error"], (name, error)
    assert [job for job in fleet.ctx.journal.list() if str(job.params.get("prompt", "")).startswith("root ")] == []
    # the route the message names answers the same call
    there = InferenceClient(base_url=f"{fleet.local.api_url}/hf/models/{fleet.model}", api_key=TEST_API_KEY)
    assert there.text_to_image("root there", width=64, height=64, num_inference_steps=2).size == (64, 64)


def test_result_urls_open_without_the_api_key_until_they_expire(fleet: RunningFleet, sdk: openai.OpenAI) -> None:
    """``images.generate(response_format="url")`` answered URLs that only opened with
    ``Authorization: Bearer <key>``: a browser, an ``<img>`` tag or ``urllib`` got 401, where
    OpenAI's URLs open as they are for an hour. Each URL now carries its expiry and a signature
    made with the caller's key (app/api/result_urls.py; docs/api.md, "What the OpenAPI document
    promises"): it opens without a key, image i is image i of the job, an altered or expired
    one is refused 401 naming why, and the key still opens the plain URL."""
    from app.api.result_urls import signed_result_url

    done = sdk.images.generate(
        model=fleet.model,
        prompt="url without key",
        n=2,
        size="64x32",  # type: ignore[arg-type]
        response_format="url",
        extra_body={"steps": 1, "seed": 3},
    )
    urls = [item.url for item in done.data or []]
    assert len(urls) == 2 and all(url and "signature=" in url and "expires=" in url for url in urls), urls
    [job] = jobs_with_prompt(fleet, "url without key")
    with httpx.Client(verify=tls_context()) as plain:  # no Authorization header
        for index, url in enumerate(urls):
            assert url is not None
            opened = plain.get(url)
            assert opened.status_code == 200, opened.text
            assert opened.headers["x-content-digest"] == (job.results or [])[index]["digest"]
            assert Image.open(io.BytesIO(opened.content)).size == (64, 32)
        first, second = (url or "" for url in urls)
        altered = plain.get(second.replace("index=1", "index=0"))  # another image under image 1's signature
        assert (altered.status_code, altered.json()["error"]["reason"]) == (401, "invalid_signature"), altered.text
        expired_url = signed_result_url(fleet.local.settings, TEST_API_KEY, job.id, 0, now=0)
        expired = plain.get(expired_url)
        assert (expired.status_code, expired.json()["error"]["reason"]) == (401, "result_url_expired"), expired.text
        assert "Authorization: Bearer" in expired.json()["error"]["message"]
        unsigned = plain.get(first.split("?")[0])
        assert unsigned.status_code == 401
        keyed = plain.get(expired_url, headers={"Authorization": f"Bearer {TEST_API_KEY}"})  # the key wins
        assert keyed.status_code == 200
