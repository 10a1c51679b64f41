"""img2img and inpainting: their specs per family, the strength that must leave a
denoising step, the mask that must have the image's size, each refused with a 422 naming the
field (R22)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from PIL import Image

from app.core.errors import Rejected
from app.core.families import FAMILIES, PIPELINE_FAMILIES, kinds_of
from app.core.kinds import denoised_steps, family_kind_spec, job_request
from app.jobs.validation import check_kind_params, check_known_params
from app.store.files import InputStore


def image_bytes(size: tuple[int, int], mode: str = "RGB") -> bytes:
    buffer = io.BytesIO()
    Image.new(mode, size, 200).save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.fixture
def store(tmp_path: Path) -> InputStore:
    return InputStore(tmp_path, max_input_bytes=1_000_000)


def test_sd1_and_sdxl_run_img2img_and_inpaint_with_their_own_pipeline_classes() -> None:
    assert PIPELINE_FAMILIES["StableDiffusionPipeline"] == ("sd1", ("txt2img", "img2img", "inpaint"))
    assert PIPELINE_FAMILIES["StableDiffusionXLPipeline"] == ("sdxl", ("txt2img", "img2img", "inpaint"))
    assert FAMILIES["sd1"].pipeline_class_of("inpaint") == "StableDiffusionInpaintPipeline"
    assert FAMILIES["sdxl"].pipeline_class_of("img2img") == "StableDiffusionXLImg2ImgPipeline"
    with pytest.raises(KeyError, match="family flux runs kinds txt2img, not 'img2img'"):
        FAMILIES["flux"].pipeline_class_of("img2img")
    # a model registered before its family gained the kinds runs them too
    assert kinds_of("sd1", ["txt2img"]) == ("txt2img", "img2img", "inpaint")
    assert kinds_of("flux", ["txt2img"]) == ("txt2img",) and kinds_of("nope", ["x"]) == ("x",)
    # the family's defaults apply to its derived kinds (SDXL's guidance 5.0)
    assert family_kind_spec("sdxl", "img2img").defaults["guidance_scale"] == 5.0
    assert family_kind_spec("sd1", "inpaint").inputs == ("image", "mask")


def test_strength_leaving_no_step_is_refused_naming_the_smallest_strength(store: InputStore) -> None:
    image = store.add(image_bytes((16, 16))).id
    with pytest.raises(Rejected, match=r"int\(4 x 0.2\) = 0 steps\); ask for strength >= 0.25") as refused:
        check_kind_params("img2img", {"prompt": "x", "image": image, "strength": 0.2}, store, family="sd1")
    assert (refused.value.param, refused.value.status_code) == ("params.strength", 422)
    with pytest.raises(Rejected, match=r"params.strength must be a number from 0 to 1, got 1.5"):
        check_kind_params("img2img", {"prompt": "x", "image": image, "strength": 1.5}, store, family="sd1")
    check_kind_params("img2img", {"prompt": "x", "image": image, "strength": 0.2, "steps": 5}, store, family="sd1")
    assert denoised_steps(10, 0.3) == 3 and denoised_steps(4, 1.0) == 4 and denoised_steps(4, 0.2) == 0


def test_inpaint_needs_a_mask_of_the_image_size(store: InputStore) -> None:
    image = store.add(image_bytes((32, 16))).id
    with pytest.raises(Rejected, match=r"params.mask is required for kind 'inpaint'") as missing:
        check_kind_params("inpaint", {"prompt": "x", "image": image}, store, family="sd1")
    assert missing.value.param == "params.mask"
    wrong = store.add(image_bytes((16, 16), "L")).id
    with pytest.raises(
        Rejected, match=r"params.mask must have the size of params.image \(32x16 pixels\), got 16x16"
    ) as refused:
        check_kind_params("inpaint", {"prompt": "x", "image": image, "mask": wrong}, store, family="sd1")
    assert (refused.value.param, refused.value.reason) == ("params.mask", "invalid_mask")
    odd = store.add(image_bytes((63, 61))).id  # drawn at 64x64 and resized back (tasks/kinds DrawnInput)
    check_kind_params("img2img", {"prompt": "x", "image": odd}, store, family="sd1")
    right = store.add(image_bytes((32, 16), "L")).id
    check_kind_params("inpaint", {"prompt": "x", "image": image, "mask": right}, store, family="sd1")


def test_strength_is_no_param_of_txt2img_and_mask_none_of_img2img() -> None:
    with pytest.raises(Rejected, match=r"params.strength is not a param of kind 'txt2img'"):
        check_known_params("txt2img", {"prompt": "x", "strength": 0.5}, "sd1")
    with pytest.raises(
        Rejected,
        match=r"params.mask is not a param of kind 'img2img' on family sd1 "
        r"\(StableDiffusionImg2ImgPipeline\)",
    ):
        check_known_params("img2img", {"prompt": "x", "mask": "blake3:00"}, "sd1")


def test_placement_prices_the_steps_that_strength_leaves() -> None:
    params = {"prompt": "x", "steps": 10, "strength": 0.3, "output_width": 64, "output_height": 64}
    assert job_request("m", "sd1", "img2img", "server", params).steps == 3
    assert job_request("m", "sd1", "img2img", "server", {"steps": 10}).steps == 8  # default strength 0.8
    assert job_request("m", "sd1", "inpaint", "server", {"steps": 10}).steps == 10  # default strength 1.0


def test_a_result_upload_must_carry_the_n_minus_1_other_images() -> None:
    from app.jobs.endings import more_results

    digests = ["blake3:" + "1" * 64, "blake3:" + "2" * 64]
    assert more_results({"n": 3}, json.dumps(digests), 2) == digests
    assert more_results({}, "[]", 0) == []
    with pytest.raises(Rejected, match=r"the job asks n=3 images: the upload must carry 2 more .* got 1 files and 2"):
        more_results({"n": 3}, json.dumps(digests), 1)
    with pytest.raises(Rejected, match="must carry 0 more") as refused:
        more_results({"n": 1}, json.dumps(digests[:1]), 1)
    assert refused.value.reason == "invalid_results"
    with pytest.raises(Rejected, match="more_digests must be a JSON list"):
        more_results({"n": 2}, "{", 1)
