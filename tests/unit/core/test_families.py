"""Per-family rules (R22): one home, ``app/core/families.py``, read by the server's
validation and by the worker's kind code. Each family's params reach its pipeline under that
pipeline's own argument names (checked against the real diffusers ``__call__`` signatures:
never a TypeError on a worker), and a submission breaking a family's rule is refused with a 422
naming the family's limit."""

from __future__ import annotations

import inspect
import io
from typing import Any

import pytest
from PIL import Image

from app.core.errors import Rejected
from app.core.families import FAMILIES, PIPELINE_FAMILIES, TEXT_FAMILIES
from app.core.kinds import KINDS, family_kind_spec, job_request
from app.core.limits import FamilyLimits, default_limits, limits_for
from app.jobs.validation import (
    check_family_params,
    check_known_params,
    check_numbers,
    check_submission,
)
from tasks.kinds import runner

# text: tests/unit/tasks/test_text_kind.py
DIFFUSION_FAMILIES = [name for name in FAMILIES if name not in TEXT_FAMILIES]


class RecordingPipeline:
    """Stands in for a diffusers pipeline and keeps the keyword arguments it was called with."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def __call__(self, **kwargs: Any) -> Any:
        self.calls.append(kwargs)
        frame = Image.new("RGB", (kwargs.get("width", 16), kwargs.get("height", 16)))
        return type("Result", (), {"images": [frame], "frames": [[frame, frame]]})()


def png(width: int = 32, height: int = 32) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height)).save(buffer, format="PNG")
    return buffer.getvalue()


def call_arguments(family: str, params: dict[str, Any], kind: str | None = None) -> dict[str, Any]:
    kind = kind or FAMILIES[family].kind
    # named as the class that runs the kind: tasks.kinds.kind_pipeline takes it as it is
    pipeline = type(FAMILIES[family].pipeline_class_of(kind), (RecordingPipeline,), {})()
    runner(kind)(
        pipeline, {"seed": 1, **params}, lambda step, total: None, {}, {"image": png(), "mask": png()}, family=family
    )
    (call,) = pipeline.calls
    return call


FAMILY_KINDS = [(name, kind) for name in DIFFUSION_FAMILIES for kind in FAMILIES[name].kinds]


def test_the_registry_accepts_exactly_the_families_pipeline_classes() -> None:
    from app.store.registry import PIPELINE_FAMILIES as registry_table

    assert registry_table is PIPELINE_FAMILIES  # one home
    assert set(PIPELINE_FAMILIES) == {
        "StableDiffusionPipeline",
        "StableDiffusionXLPipeline",
        "FluxPipeline",
        "QwenImageEditPipeline",
        "StableDiffusionInstructPix2PixPipeline",
        "StableDiffusionUpscalePipeline",
        "AnimateDiffPipeline",
        "WanPipeline",
        "FluxKontextPipeline",
        "LlamaForCausalLM",
        "Qwen2ForCausalLM",
        "GPT2LMHeadModel",
    }


@pytest.mark.parametrize(("family", "kind"), FAMILY_KINDS)
def test_every_argument_a_runner_passes_is_one_its_diffusers_pipeline_takes(family: str, kind: str) -> None:
    """What each runner passes, with every param of the family's spec set, is in the real
    pipeline class's ``__call__`` signature (a wrong name would be a TypeError on a worker);
    the derived kinds' (img2img, inpaint) too."""
    import diffusers

    rules = FAMILIES[family]
    kind_spec = family_kind_spec(family, kind)
    params: dict[str, Any] = {"prompt": "a red circle", "negative_prompt": "blur", "steps": 2}
    params.update({name: kind_spec.defaults[name] for name in kind_spec.params if name in kind_spec.defaults})
    params["negative_prompt"] = "blur"
    call = call_arguments(family, params, kind)
    class_name = rules.pipeline_class_of(kind)
    accepted = set(inspect.signature(getattr(diffusers, class_name).__call__).parameters)
    assert set(call) <= accepted, f"{class_name} takes no {sorted(set(call) - accepted)}"


def test_qwen_edit_gets_true_cfg_and_the_input_size_never_image_guidance() -> None:
    call = call_arguments("qwen-image", {"prompt": "make it blue", "image": "x", "true_cfg_scale": 2.5})
    assert call["true_cfg_scale"] == 2.5 and call["negative_prompt"] == " "  # the model card's default
    assert (call["width"], call["height"]) == (32, 32)  # the input's size, not ~1024x1024
    assert "image_guidance_scale" not in call and "guidance_scale" not in call


def test_flux_kontext_keeps_the_input_size_and_its_distilled_guidance() -> None:
    call = call_arguments("flux-kontext", {"prompt": "make it blue", "image": "x"})
    assert (call["width"], call["height"], call["max_area"], call["_auto_resize"]) == (32, 32, 32 * 32, False)
    assert (call["guidance_scale"], call["true_cfg_scale"]) == (2.5, 1.0) and "image_guidance_scale" not in call


def test_pix2pix_keeps_its_image_guidance_and_video_families_get_num_frames() -> None:
    call = call_arguments("sd1-pix2pix", {"prompt": "snow", "image": "x", "image_guidance_scale": 1.25})
    assert call["image_guidance_scale"] == 1.25 and "true_cfg_scale" not in call
    for family, frames in (("wan", 9), ("animatediff", 4)):
        call = call_arguments(family, {"prompt": "waves", "frames": frames, "format": "gif"})
        assert call["num_frames"] == frames and "frames" not in call


def test_flux_guidance_is_distilled_by_default_and_true_cfg_is_its_own_param() -> None:
    call = call_arguments("flux", {"prompt": "a cat"})
    assert (call["guidance_scale"], call["true_cfg_scale"]) == (3.5, 1.0)
    assert family_kind_spec("sd1", "txt2img").defaults["guidance_scale"] == 7.5


def test_family_defaults_price_the_job() -> None:
    assert (
        job_request("m", "wan", "video", "auto", {}).size
        == job_request("m", "animatediff", "video", "auto", {"frames": 33}).size
    )


@pytest.mark.parametrize(
    ("family", "params", "message", "reason"),
    [
        (
            "flux",
            {"width": 72},
            (
                "`width` must be a multiple of 16 pixels for family flux (FluxPipeline: the VAE "
                "downsamples by 8, then 2x2 patches), got 72"
            ),
            "invalid_width",
        ),
        (
            "wan",
            {"height": 40},
            "`height` must be a multiple of 16 pixels for family wan (WanPipeline",
            "invalid_height",
        ),
        (
            "wan",
            {"frames": 8},
            (
                "`frames` must be 4k+1 (1, 5, 9, 13, ...) for family wan (WanPipeline: the VAE packs "
                "4 frames into each latent frame after the first), got 8; ask for 5 or 9"
            ),
            "invalid_frames",
        ),
        (
            "flux",
            {"negative_prompt": "blurry"},
            (
                "params.negative_prompt is used only with params.true_cfg_scale above "
                "1 for family flux (FluxPipeline: true classifier-free guidance), got "
                "true_cfg_scale=1.0"
            ),
            "invalid_params",
        ),
        (
            "qwen-image",
            {"negative_prompt": "blurry", "true_cfg_scale": 1},
            ("params.negative_prompt is used only with params.true_cfg_scale above 1 for family qwen-image"),
            "invalid_params",
        ),
    ],
)
def test_r22_a_family_rule_is_refused_naming_the_familys_limit(
    family: str,
    params: dict[str, Any],
    message: str,
    reason: str,
) -> None:
    with pytest.raises(Rejected) as refused:
        check_family_params(family, FAMILIES[family].kind, {"prompt": "x", **params})
    assert refused.value.status_code == 422
    assert refused.value.message.startswith(message), refused.value.message
    assert refused.value.reason == reason


def test_r22_what_a_family_allows_passes() -> None:
    check_family_params("wan", "video", {"prompt": "x", "frames": 81, "width": 832, "height": 480})
    check_family_params("wan", "video", {"prompt": "x"})  # its default, 33 frames
    check_family_params("flux", "txt2img", {"prompt": "x", "negative_prompt": "blur", "true_cfg_scale": 2.0})
    check_family_params("animatediff", "video", {"prompt": "x", "frames": 8, "width": 72})  # 8s and any count
    check_family_params("qwen-image", "edit", {"prompt": "x", "image": "y"})  # blank default negative prompt


@pytest.mark.parametrize(
    ("family", "params", "message"),
    [
        (
            "qwen-image",
            {"image_guidance_scale": 1.5},
            (
                "params.image_guidance_scale is not a param of kind 'edit' on family qwen-image "
                "(QwenImageEditPipeline); "
                "it takes image, prompt, negative_prompt, steps, seed, true_cfg_scale"
            ),
        ),
        (
            "qwen-image",
            {"guidance_scale": 4.0},
            "params.guidance_scale is not a param of kind 'edit' on family qwen-image",
        ),
        (
            "sd1-pix2pix",
            {"true_cfg_scale": 4.0},
            (
                "params.true_cfg_scale is not a param of kind 'edit' on family "
                "sd1-pix2pix (StableDiffusionInstructPix2PixPipeline)"
            ),
        ),
        ("sdxl", {"true_cfg_scale": 4.0}, "params.true_cfg_scale is not a param of kind 'txt2img' on family sdxl"),
    ],
)
def test_r22_a_param_the_familys_pipeline_does_not_take_is_refused(
    family: str, params: dict[str, Any], message: str
) -> None:
    with pytest.raises(Rejected) as refused:
        check_known_params(FAMILIES[family].kind, {"prompt": "x", **params}, family)
    assert refused.value.message.startswith(message), refused.value.message
    assert (refused.value.status_code, refused.value.reason) == (422, "unknown_param")


def test_r22_a_familys_own_range_is_checked() -> None:
    with pytest.raises(Rejected, match=r"params.guidance_scale must be a number from 0 to 20, got 30"):
        check_numbers(family_kind_spec("flux", "txt2img"), {"guidance_scale": 30})
    check_numbers(family_kind_spec("sd1", "txt2img"), {"guidance_scale": 30})  # CFG: up to 50
    with pytest.raises(Rejected, match=r"params.true_cfg_scale must be a number from 1 to 50, got 0.5"):
        check_numbers(family_kind_spec("qwen-image", "edit"), {"true_cfg_scale": 0.5})


def test_r22_prompt_tokens_and_frames_follow_the_familys_encoder_and_model() -> None:
    limits = default_limits()
    assert limits_for(limits, "sd1").max_prompt_tokens == 77  # CLIP
    assert limits_for(limits, "flux").max_prompt_tokens == 512  # T5
    assert limits_for(limits, "qwen-image").max_prompt_tokens == 1024  # Qwen2.5-VL
    assert (limits_for(limits, "wan").max_prompt_tokens, limits_for(limits, "wan").max_frames) == (512, 81)
    with pytest.raises(Rejected, match="at most 512 tokens"):
        check_submission(
            {"prompt": "x" * 513}, limits_for(limits, "flux"), count_tokens=len, kind="txt2img", family="flux"
        )
    check_submission({"prompt": "x" * 512}, limits_for(limits, "flux"), count_tokens=len, kind="txt2img", family="flux")
    assert FamilyLimits().max_prompt_tokens == 77 and set(KINDS) == {k for f in FAMILIES.values() for k in f.kinds}
