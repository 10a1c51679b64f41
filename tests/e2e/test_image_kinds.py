"""img2img and inpainting (issue 22) end to end on the shared fleet's tiny-sd (sd1): the
txt2img pipeline's components run both through ``from_pipe`` on a real worker; the inputs are
uploaded with ``POST /v1/files`` and fetched by digest. The tiny model's VAE is random, so its
round trip does not give the input back: img2img's effect is asserted as the input's weight in
the output (it falls with ``strength``), inpainting's as the pixels outside the mask (exactly
the input's) and inside it (changed)."""

from __future__ import annotations

import io
from typing import Any

import numpy as np
import pytest
from PIL import Image

from app.client import ApiError
from tests.e2e.conftest import RunningFleet
from tests.helpers import png

pytestmark = pytest.mark.e2e

MACHINE = "m1"


def pixels(data: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"), dtype=np.float64)


def mask_png(size: tuple[int, int], box: tuple[int, int, int, int]) -> bytes:
    mask = Image.new("L", size, 0)
    mask.paste(255, box)
    buffer = io.BytesIO()
    mask.save(buffer, format="PNG")
    return buffer.getvalue()


def run(fleet: RunningFleet, kind: str, params: dict[str, Any]) -> tuple[dict[str, Any], bytes]:
    accepted = fleet.client.submit(fleet.model, kind, params, target=MACHINE)
    job = fleet.client.wait(accepted["id"], timeout_s=180)
    assert job["state"] == "succeeded", job
    return job, fleet.client.download(accepted["id"])


def test_the_model_lists_the_kinds_its_family_runs(fleet: RunningFleet) -> None:
    models = {m["id"]: m for m in fleet.client.http.get("/v1/models").json()}
    assert models[fleet.model]["kinds"] == ["txt2img", "img2img", "inpaint"]


def test_img2img_keeps_the_input_size_and_its_weight_falls_with_strength(fleet: RunningFleet) -> None:
    red = fleet.client.upload(png(48, 40, (220, 30, 30)))["id"]
    blue = fleet.client.upload(png(48, 40, (30, 30, 220)))["id"]
    base = {"prompt": "a fox", "steps": 4, "seed": 11}
    out = {(colour, strength): run(fleet, "img2img", {**base, "image": image, "strength": strength})
           for colour, image in (("red", red), ("blue", blue)) for strength in (0.25, 1.0)}
    job, data = out["red", 0.25]
    assert Image.open(io.BytesIO(data)).size == (48, 40)
    assert job["params"]["output_width"] == 48 and job["provenance"]["inputs"] == {"image": red}
    # strength 0.25 of 4 steps: one denoising step, and progress counts that one
    progress = fleet.ctx.redis.hgetall(fleet.ctx.keys.progress(job["id"]))
    assert (progress["step"], progress["total"]) == ("1", "1")
    _, again = run(fleet, "img2img", {**base, "image": red, "strength": 0.25})
    assert again == data  # same seed, same machine: same bytes
    near = np.abs(pixels(out["red", 0.25][1]) - pixels(out["blue", 0.25][1])).mean()
    far = np.abs(pixels(out["red", 1.0][1]) - pixels(out["blue", 1.0][1])).mean()
    assert near > 3.0 and near > 4 * far, (near, far)  # low strength: the input shows; full strength: barely


def test_inpaint_changes_only_the_masked_pixels(fleet: RunningFleet) -> None:
    source = png(64, 48)
    image = fleet.client.upload(source)["id"]
    mask = fleet.client.upload(mask_png((64, 48), (16, 8, 48, 40)))["id"]
    job, data = run(fleet, "inpaint", {"prompt": "a fox", "steps": 2, "seed": 5, "image": image, "mask": mask})
    assert job["provenance"]["inputs"] == {"image": image, "mask": mask}
    out, before = pixels(data), pixels(source)
    inside = np.zeros(out.shape[:2], dtype=bool)
    inside[8:40, 16:48] = True
    assert out.shape == before.shape == (48, 64, 3)
    assert np.array_equal(out[~inside], before[~inside])  # outside the mask: the input's own pixels
    assert np.abs(out[inside] - before[inside]).mean() > 10.0  # inside: repainted


def test_a_mask_of_another_size_or_a_strength_without_steps_is_a_422_naming_the_field(fleet: RunningFleet) -> None:
    image = fleet.client.upload(png(64, 48))["id"]
    small = fleet.client.upload(mask_png((32, 32), (0, 0, 8, 8)))["id"]
    with pytest.raises(ApiError) as wrong_mask:
        fleet.client.submit(fleet.model, "inpaint", {"prompt": "x", "image": image, "mask": small}, target=MACHINE)
    assert wrong_mask.value.status_code == 422
    assert "params.mask must have the size of params.image (64x48 pixels), got 32x32" in wrong_mask.value.message
    with pytest.raises(ApiError) as no_step:
        fleet.client.submit(fleet.model, "img2img", {"prompt": "x", "image": image, "strength": 0.1, "steps": 4},
                            target=MACHINE)
    assert no_step.value.status_code == 422 and "params.strength must leave at least one denoising step" in (
        no_step.value.message)
    with pytest.raises(ApiError) as no_mask:
        fleet.client.submit(fleet.model, "inpaint", {"prompt": "x", "image": image}, target=MACHINE)
    assert no_mask.value.status_code == 422 and "params.mask is required for kind 'inpaint'" in no_mask.value.message
