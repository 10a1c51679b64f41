"""Every pipeline class the registry accepts runs a real job end to end: API -> queue
-> a real ``celery worker`` -> upload -> a verified result, on a tiny pipeline of that very
diffusers class built offline with random weights (``homefleet models make-tiny --family``).

The session's one-machine fleet (tests/e2e/conftest.py ``models_fleet``): the API and ONE
worker, machine ``m1``, holding the nine tiny models (each built once per session). Each job's params are the family's
own (Flux's distilled
guidance, Qwen-Image-Edit's true CFG, Wan's 4k+1 frames), and a submission breaking a family's
rule is refused by the real API with a 422 naming the family's limit (R22), never a TypeError on
the worker.
"""

from __future__ import annotations

import io
import json
from typing import Any

import httpx
import pytest
from PIL import Image

from app.core.digest import bytes_digest
from app.core.families import FAMILIES
from app.core.tls import tls_context
from app.devtools.tiny_models import TINY_MODELS
from tests.e2e.conftest import ModelsFleet

pytestmark = pytest.mark.e2e

MACHINE = "m1"
MODELS = {family: folder for folder, family in TINY_MODELS.items()}  # family -> model id (= its folder name)


FamiliesFleet = ModelsFleet


@pytest.fixture
def ffleet(models_fleet: ModelsFleet) -> ModelsFleet:
    """The session's one-machine fleet with every tiny family (tests/e2e/conftest.py)."""
    return models_fleet


def upload(fleet: FamiliesFleet, width: int, height: int) -> str:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (200, 30, 30)).save(buffer, format="PNG")
    response = httpx.post(
        f"{fleet.local.api_url}/v1/files",
        files={"file": ("in.png", buffer.getvalue(), "image/png")},
        headers=fleet.local.auth_headers,
        timeout=30,
        verify=tls_context(),
    )
    assert response.status_code == 201, response.text
    return str(response.json()["id"])


def run(fleet: FamiliesFleet, family: str, params: dict[str, Any]) -> tuple[dict[str, Any], bytes]:
    """Submit to m1, wait, download; the result's bytes match the digest the server recorded
    and the journaled provenance names the model, its kind and the params that ran."""
    model_id, kind = MODELS[family], FAMILIES[family].kind
    accepted = fleet.client.submit(model_id, kind, params, target=MACHINE)
    job = fleet.client.wait(accepted["id"], timeout_s=240)
    assert job["state"] == "succeeded", job
    data = fleet.client.download(accepted["id"])
    assert job["result"]["digest"] == bytes_digest(data)
    provenance = job["provenance"]
    assert (provenance["model_id"], provenance["kind"], provenance["machine"]) == (model_id, kind, MACHINE)
    assert provenance["model_files"] == {f.path: f.digest for f in fleet.ctx.registry.manifest(model_id).files}
    assert fleet.ctx.registry.get(model_id).pipeline_class == FAMILIES[family].pipeline_class
    return job, data


def image_of(data: bytes) -> Image.Image:
    image = Image.open(io.BytesIO(data))
    assert json.loads(image.info.get("homefleet") or image.info["xmp"])["seed"] == 3
    return image


@pytest.mark.parametrize(
    ("family", "params", "size"),
    [
        ("sd1", {"prompt": "a red circle", "steps": 2}, (64, 64)),
        ("sdxl", {"prompt": "a red circle", "width": 64, "height": 48, "steps": 2}, (64, 48)),
        ("flux", {"prompt": "a red circle", "guidance_scale": 3.5, "steps": 2}, (64, 64)),
        ("flux", {"prompt": "a red circle", "negative_prompt": "blur", "true_cfg_scale": 2.0, "steps": 1}, (64, 64)),
    ],
)
def test_txt2img_runs_on_every_txt2img_pipeline_class(
    ffleet: FamiliesFleet, family: str, params: dict[str, Any], size: tuple[int, int]
) -> None:
    job, data = run(ffleet, family, {**params, "seed": 3})
    image = image_of(data)
    assert (image.format, image.size) == ("PNG", size)
    assert job["params"] == {**params, "seed": 3}  # journaled as sent: the family's own names


@pytest.mark.parametrize(
    ("family", "params"),
    [
        ("sd1-pix2pix", {"prompt": "make it blue", "image_guidance_scale": 1.5, "steps": 2}),
        ("qwen-image", {"prompt": "make it blue", "true_cfg_scale": 1.0, "negative_prompt": "", "steps": 1}),
        ("flux-kontext", {"prompt": "make it blue", "guidance_scale": 2.5, "steps": 2}),
    ],
)
def test_edit_runs_on_every_edit_pipeline_class_and_keeps_the_input_size(
    ffleet: FamiliesFleet,
    family: str,
    params: dict[str, Any],
) -> None:
    file_id = upload(ffleet, 64, 48)
    _, data = run(ffleet, family, {**params, "image": file_id, "seed": 3})
    image = image_of(data)
    assert (image.format, image.size) == ("PNG", (64, 48))


def test_upscale_runs_on_the_x4_upscaler(ffleet: FamiliesFleet) -> None:
    file_id = upload(ffleet, 16, 24)
    _, data = run(ffleet, "sd-upscale", {"image": file_id, "noise_level": 30, "steps": 2, "seed": 3})
    assert image_of(data).size == (64, 96)


@pytest.mark.parametrize(
    ("family", "params", "frames", "size"),
    [
        ("animatediff", {"frames": 4, "steps": 2}, 4, (64, 64)),
        ("wan", {"frames": 5, "width": 32, "height": 32, "steps": 2}, 5, (32, 32)),
    ],
)
def test_video_runs_on_every_video_pipeline_class_with_its_frame_rule(
    ffleet: FamiliesFleet,
    family: str,
    params: dict[str, Any],
    frames: int,
    size: tuple[int, int],
) -> None:
    _, data = run(ffleet, family, {"prompt": "waves", "format": "webp", "seed": 3, **params})
    image = image_of(data)
    assert (image.format, image.n_frames, image.size) == ("WEBP", frames, size)


@pytest.mark.parametrize(
    ("family", "params", "message"),
    [
        (
            "wan",
            {"prompt": "waves", "frames": 8},
            "`frames` must be 4k+1 (1, 5, 9, 13, ...) for family wan (WanPipeline",
        ),
        ("flux", {"prompt": "x", "width": 72}, "`width` must be a multiple of 16 pixels for family flux (FluxPipeline"),
        (
            "qwen-image",
            {"prompt": "x", "image_guidance_scale": 1.5},
            "params.image_guidance_scale is not a param of kind 'edit' on family qwen-image (QwenImageEditPipeline)",
        ),
    ],
)
def test_r22_the_api_refuses_a_family_rule_with_422_naming_the_limit(
    ffleet: FamiliesFleet,
    family: str,
    params: dict[str, Any],
    message: str,
) -> None:
    if FAMILIES[family].kind == "edit":
        params = {**params, "image": upload(ffleet, 64, 48)}
    response = httpx.post(
        f"{ffleet.local.api_url}/v1/jobs",
        headers=ffleet.local.auth_headers,
        timeout=30,
        json={"model": MODELS[family], "kind": FAMILIES[family].kind, "params": params, "target": MACHINE},
        verify=tls_context(),
    )
    assert response.status_code == 422, response.text
    assert response.json()["error"]["message"].startswith(message), response.json()


@pytest.mark.parametrize(
    ("family", "kind", "params", "size", "drawn", "output"),
    [
        (
            "qwen-image",
            "edit",
            {"prompt": "make it blue", "true_cfg_scale": 1.0, "steps": 1},
            (40, 40),
            (48, 48),
            (40, 40),
        ),
        ("sd1-pix2pix", "edit", {"prompt": "make it blue", "steps": 1}, (61, 45), (64, 48), (61, 45)),
        ("sd1", "img2img", {"prompt": "a red circle", "steps": 2, "strength": 0.5}, (50, 37), (48, 40), (50, 37)),
        ("sd-upscale", "upscale", {"noise_level": 30, "steps": 1}, (17, 13), (16, 16), (68, 52)),
    ],
)
def test_an_input_of_any_size_is_drawn_at_the_familys_multiples_and_keeps_its_own_size(
    ffleet: FamiliesFleet,
    family: str,
    kind: str,
    params: dict[str, Any],
    size: tuple[int, int],
    drawn: tuple[int, int],
    output: tuple[int, int],
) -> None:
    """A photo or screenshot whose sides are not multiples of the VAE's 8 (16 for Qwen-Image)
    runs: the worker draws it at the nearest multiples and resizes the output back to the
    input's size (x4 for the upscaler), the size journaled at submission; the record says what
    size the pipeline drew (docs/api.md, "Input images")."""
    file_id = upload(ffleet, *size)
    accepted = ffleet.client.submit(MODELS[family], kind, {**params, "image": file_id, "seed": 3}, target=MACHINE)
    job = ffleet.client.wait(accepted["id"], timeout_s=240)
    assert job["state"] == "succeeded", job
    assert (job["params"]["output_width"], job["params"]["output_height"]) == output
    assert job["provenance"]["pipeline_size"] == list(drawn)
    image = image_of(ffleet.client.download(accepted["id"]))
    assert (image.format, image.size) == ("PNG", output)
