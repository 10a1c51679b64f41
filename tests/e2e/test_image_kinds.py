"""img2img and inpainting end to end on the shared fleet's tiny-sd (sd1): the
txt2img pipeline's components run both through ``from_pipe`` on a real worker; the inputs are
uploaded with ``POST /v1/files`` and fetched by digest. The tiny model's VAE is random, so its
round trip does not give the input back: img2img's effect is asserted as the input's weight in
the output (it falls with ``strength``), inpainting's as the pixels outside the mask (exactly
the input's) and inside it (changed)."""

from __future__ import annotations

import base64
import io
import json
from typing import Any

import numpy as np
import pytest
from PIL import Image

from app.client import ApiError
from app.core.digest import bytes_digest
from app.core.states import JobState
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
    models = {m["id"]: m for m in fleet.client.models()}
    assert models[fleet.model]["kinds"] == ["txt2img", "img2img", "inpaint"]


def test_img2img_keeps_the_input_size_and_its_weight_falls_with_strength(fleet: RunningFleet) -> None:
    red = fleet.client.upload(png(48, 40, (220, 30, 30)))["id"]
    blue = fleet.client.upload(png(48, 40, (30, 30, 220)))["id"]
    base = {"prompt": "a fox", "steps": 4, "seed": 11}
    out = {
        (colour, strength): run(fleet, "img2img", {**base, "image": image, "strength": strength})
        for colour, image in (("red", red), ("blue", blue))
        for strength in (0.25, 1.0)
    }
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


@pytest.mark.parametrize(("width", "height"), [(64, 48), (61, 45)])
def test_inpaint_changes_only_the_masked_pixels(fleet: RunningFleet, width: int, height: int) -> None:
    """At any size: 61 x 45 is drawn at 64 x 48 and the result resized back before the input's
    own pixels are pasted outside the mask (docs/api.md, "Input images")."""
    source = png(width, height)
    image = fleet.client.upload(source)["id"]
    mask = fleet.client.upload(mask_png((width, height), (16, 8, 48, 40)))["id"]
    job, data = run(fleet, "inpaint", {"prompt": "a fox", "steps": 2, "seed": 5, "image": image, "mask": mask})
    assert job["provenance"]["inputs"] == {"image": image, "mask": mask}
    assert job["provenance"].get("pipeline_size") == (None if (width, height) == (64, 48) else [64, 48])
    out, before = pixels(data), pixels(source)
    inside = np.zeros(out.shape[:2], dtype=bool)
    inside[8:40, 16:48] = True
    assert out.shape == before.shape == (height, width, 3)
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
        fleet.client.submit(
            fleet.model, "img2img", {"prompt": "x", "image": image, "strength": 0.1, "steps": 4}, target=MACHINE
        )
    assert no_step.value.status_code == 422 and "params.strength must leave at least one denoising step" in (
        no_step.value.message
    )
    with pytest.raises(ApiError) as no_mask:
        fleet.client.submit(fleet.model, "inpaint", {"prompt": "x", "image": image}, target=MACHINE)
    assert no_mask.value.status_code == 422 and "params.mask is required for kind 'inpaint'" in no_mask.value.message


def png_seed(data: bytes) -> int:
    return int(json.loads(Image.open(io.BytesIO(data)).info["homefleet"])["seed"])


def test_n_images_are_one_job_with_consecutive_seeds_listed_in_order(fleet: RunningFleet) -> None:
    params = {"prompt": "a lighthouse", "steps": 2, "seed": 40}
    job, first = run(fleet, "txt2img", {**params, "n": 3})
    results = job["results"]
    assert [r["seed"] for r in results] == [40, 41, 42] and job["result"] == results[0]
    files = [first] + [
        fleet.client.http.get(f"/v1/jobs/{job['id']}/result", params={"index": i}).content for i in (1, 2)
    ]
    assert [bytes_digest(data) for data in files] == [r["digest"] for r in results]
    assert [png_seed(data) for data in files] == [40, 41, 42] and len(set(files)) == 3
    assert job["provenance"]["seeds"] == [40, 41, 42]
    # image i of the batch is the image of seed + i alone (one generator per image; batched kernels
    # may differ in the last bits, never in the picture)
    for i, data in enumerate(files):
        _, alone = run(fleet, "txt2img", {**params, "seed": 40 + i})
        assert np.abs(pixels(data) - pixels(alone)).max() <= 2.0
    missing = fleet.client.http.get(f"/v1/jobs/{job['id']}/result", params={"index": 3})
    assert missing.status_code == 404 and "has 3 results (index 0 to 2), not index 3" in missing.text
    with pytest.raises(ApiError) as too_many:
        fleet.client.submit(fleet.model, "txt2img", {**params, "n": 5}, target=MACHINE)
    assert too_many.value.status_code == 422
    assert "`n` must be between 1 and 4 (max_batch of family sd1), got 5" in too_many.value.message
    with pytest.raises(ApiError) as not_edit:
        fleet.client.submit("tiny-pix2pix", "edit", {"prompt": "x", "image": "blake3:" + "0" * 64, "n": 2})
    assert not_edit.value.status_code == 422 and "params.n is not a param of kind 'edit'" in not_edit.value.message


def test_openai_generations_with_n_make_one_job_and_list_its_images_in_order(fleet: RunningFleet) -> None:
    before = {job.id for job in fleet.ctx.journal.list()}
    answer = fleet.client.http.post(
        "/v1/images/generations",
        json={"prompt": "a red circle", "model": fleet.model, "n": 2, "steps": 2, "size": "64x64", "target": MACHINE},
    )
    assert answer.status_code == 200, answer.text
    new = [job for job in fleet.ctx.journal.list() if job.id not in before]
    assert len(new) == 1 and new[0].params["n"] == 2 and len(new[0].results or []) == 2
    images = [base64.b64decode(item["b64_json"]) for item in answer.json()["data"]]
    assert [bytes_digest(data) for data in images] == [r["digest"] for r in new[0].results or []]
    seed = new[0].params["seed"]
    assert [png_seed(data) for data in images] == [seed, seed + 1]


def test_requeue_repeats_the_params_and_seed_linked_to_the_old_job(fleet: RunningFleet) -> None:
    image = fleet.client.upload(png(48, 40, (20, 160, 60)))["id"]
    params = {"prompt": "a fox", "steps": 2, "seed": 77, "image": image, "strength": 0.5}
    old, data = run(fleet, "img2img", params)
    again = fleet.client.requeue(old["id"])
    requeued = fleet.client.wait(again["id"], timeout_s=180)
    assert requeued["state"] == "succeeded" and requeued["requeued_from"] == old["id"]
    assert requeued["params"] == old["params"] and requeued["seed"] == 77 and requeued["machine"] == MACHINE
    assert requeued["provenance"]["requeued_from"] == old["id"] and old["requeued_from"] is None
    assert fleet.client.download(again["id"]) == data  # same params, seed and machine: the same bytes
    fresh = fleet.client.get(fleet.client.requeue(old["id"], seed=None)["id"])
    chosen = fleet.client.get(fleet.client.requeue(old["id"], seed=5)["id"])
    assert (
        fresh["seed"] != 77 and chosen["seed"] == 5 and fresh["requeued_from"] == chosen["requeued_from"] == old["id"]
    )
    for job in (fresh, chosen):
        assert fleet.client.wait(job["id"], timeout_s=180)["state"] == "succeeded"
    missing = fleet.client.http.post(f"/v1/jobs/{'0' * 32}/requeue")
    assert missing.status_code == 404 and "job_not_found" in missing.text
    unknown = fleet.client.http.post(f"/v1/jobs/{old['id']}/requeue", json={"seeed": 1})
    assert unknown.status_code == 422 and "seeed" in unknown.text


def test_requeue_of_a_size_that_ran_out_of_memory_is_refused(fleet: RunningFleet) -> None:
    old, _ = run(fleet, "txt2img", {"prompt": "a fox", "steps": 1, "width": 72, "height": 40})
    size = 72 * 40
    fleet.ctx.residency.record_oom(MACHINE, fleet.model, "txt2img", size, old["id"])  # R21, as a worker's OOM does
    try:
        with pytest.raises(ApiError) as refused:
            fleet.client.requeue(old["id"])
        assert refused.value.status_code == 422 and refused.value.reason == "remembered_oom"
        assert f"ran out of memory on machine '{MACHINE}' at size {size}" in refused.value.message
        rejected = [job for job in fleet.ctx.journal.list([JobState.rejected]) if job.requeued_from == old["id"]]
        assert [job.reason for job in rejected] == ["remembered_oom"]  # journaled, linked to the old job
    finally:
        fleet.ctx.residency.clear_ooms(MACHINE, fleet.model, "txt2img")
    assert fleet.client.wait(fleet.client.requeue(old["id"])["id"], timeout_s=180)["state"] == "succeeded"


def portrait_photo(upright: Image.Image) -> bytes:
    """``upright`` as a phone stores a portrait photo: turned a quarter to landscape, with EXIF
    orientation 6 (turn 90 degrees clockwise to view); a PNG (lossless), so the view is exact."""
    exif = Image.Exif()
    exif[0x0112] = 6
    buffer = io.BytesIO()
    upright.transpose(Image.Transpose.ROTATE_90).save(buffer, format="PNG", exif=exif.tobytes())
    return buffer.getvalue()


def test_a_phone_photo_is_drawn_upright_as_viewers_show_it(fleet: RunningFleet) -> None:
    """EXIF orientation 6: the image is journaled and drawn at its displayed size (45 x 61, not
    61 x 45) and turned as viewers turn it, as diffusers' ``load_image`` does (it came back
    sideways): the result is the same image, pixel for pixel, as of the photo stored upright."""
    rng = np.random.default_rng(5)
    upright = Image.fromarray(rng.integers(0, 256, (61, 45, 3), dtype=np.uint8))
    plain = io.BytesIO()
    upright.save(plain, format="PNG")
    params = {"prompt": "a fox", "steps": 2, "strength": 0.5, "seed": 3}
    turned, data = run(fleet, "img2img", {**params, "image": fleet.client.upload(portrait_photo(upright))["id"]})
    _, expected = run(fleet, "img2img", {**params, "image": fleet.client.upload(plain.getvalue())["id"]})
    assert (turned["params"]["output_width"], turned["params"]["output_height"]) == (45, 61)
    assert pixels(data).shape == (61, 45, 3)
    assert np.array_equal(pixels(data), pixels(expected))
