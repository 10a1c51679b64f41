"""``params.adapters``: which kinds take it, and :func:`check_adapters`'s refusals,
each a 422 naming ``params.adapters``, ``params.adapters[i].id`` or ``.scale`` (R22)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from app.core.errors import Rejected
from app.core.families import kinds_of
from app.core.kinds import (
    ADAPTERS_PARAM,
    KINDS,
    adapter_ids,
    family_kind_spec,
    job_request,
)
from app.core.limits import FamilyLimits
from app.jobs.validation import (
    MAX_ADAPTER_SCALE,
    check_adapter_fit,
    check_adapters,
    check_known_params,
    model_context_width,
)

FAMILIES_OF = {"sd-lora": "sd1", "sd-lora-2": "sd1", "xl-lora": "sdxl"}


def refusal(adapters: Any, limits: FamilyLimits | None = None, family: str = "sd1") -> Rejected:
    with pytest.raises(Rejected) as caught:
        check_adapters({ADAPTERS_PARAM: adapters}, limits or FamilyLimits(), family, FAMILIES_OF)
    assert caught.value.status_code == 422
    return caught.value


def test_image_kinds_take_adapters_and_the_others_refuse_them() -> None:
    takes = {name for name, spec in KINDS.items() if ADAPTERS_PARAM in spec.accepted}
    assert takes == {"txt2img", "img2img", "inpaint", "edit"}
    assert ADAPTERS_PARAM in family_kind_spec("flux", "txt2img").accepted  # the family's spec keeps it
    for kind in ("video", "upscale", "text"):
        with pytest.raises(Rejected, match=r"params.adapters is not a param of kind") as caught:
            check_known_params(kind, {ADAPTERS_PARAM: []})
        assert caught.value.param == "params.adapters"


def test_checked_entries_are_journaled_with_their_scale_defaulting_to_one() -> None:
    checked = check_adapters(
        {ADAPTERS_PARAM: [{"id": "sd-lora"}, {"id": "sd-lora-2", "scale": -0.5}]}, FamilyLimits(), "sd1", FAMILIES_OF
    )
    assert checked == [{"id": "sd-lora", "scale": 1.0}, {"id": "sd-lora-2", "scale": -0.5}]
    assert check_adapters({ADAPTERS_PARAM: []}, FamilyLimits(), "sd1", FAMILIES_OF) == []
    assert (
        check_adapters(
            {ADAPTERS_PARAM: [{"id": "sd-lora", "scale": MAX_ADAPTER_SCALE}]}, FamilyLimits(), "sd1", FAMILIES_OF
        )[0]["scale"]
        == 4.0
    )


def test_an_adapter_of_another_family_is_refused_naming_its_id() -> None:
    error = refusal([{"id": "sd-lora"}, {"id": "xl-lora", "scale": 1}])
    assert (error.reason, error.param) == ("adapter_family_mismatch", "params.adapters[1].id")
    assert error.message.startswith(
        "params.adapters[1].id: adapter 'xl-lora' is of family sdxl, the model is of family sd1"
    )


@pytest.mark.parametrize("adapter_id", ["nope", "", 3, None])
def test_an_unknown_adapter_is_refused_naming_it(adapter_id: Any) -> None:
    error = refusal([{"id": adapter_id}])
    assert (error.reason, error.param) == ("unknown_adapter", "params.adapters[0].id")
    assert f"params.adapters[0].id {adapter_id!r} is not a registered adapter" in error.message
    assert "homefleet models add FOLDER --adapter-of FAMILY" in error.message


@pytest.mark.parametrize("scale", [4.5, -4.01, float("nan"), float("inf"), 10**400, True, "1", None])
def test_a_scale_out_of_range_or_not_a_number_is_refused(scale: Any) -> None:
    error = refusal([{"id": "sd-lora", "scale": scale}])
    assert (error.reason, error.param) == ("invalid_adapters", "params.adapters[0].scale")
    assert error.message.startswith("params.adapters[0].scale must be a number from -4 to 4, got ")


def test_more_adapters_than_the_family_takes_are_refused_naming_the_limit() -> None:
    error = refusal([{"id": "sd-lora"}, {"id": "sd-lora-2"}], FamilyLimits(max_adapters=1))
    assert (error.reason, error.param) == ("invalid_adapters", "params.adapters")
    assert error.message == "params.adapters holds 2 adapters; family sd1 takes at most 1 (max_adapters)"
    assert FamilyLimits().max_adapters == 4


@pytest.mark.parametrize(
    ("adapters", "param"),
    [
        ({"id": "sd-lora"}, "params.adapters"),  # not a list
        ("sd-lora", "params.adapters"),
        (["sd-lora"], "params.adapters[0]"),  # an entry that is not an object
        ([{"scale": 1.0}], "params.adapters[0]"),  # no id
        ([{"id": "sd-lora", "weight": 1.0}], "params.adapters[0]"),  # an unknown key
    ],
)
def test_a_malformed_list_is_refused_naming_the_entry(adapters: Any, param: str) -> None:
    error = refusal(adapters)
    assert (error.reason, error.param) == ("invalid_adapters", param)


def test_an_adapter_named_twice_is_refused() -> None:
    error = refusal([{"id": "sd-lora"}, {"id": "sd-lora", "scale": 0.5}])
    assert (error.reason, error.param) == ("invalid_adapters", "params.adapters[1].id")


def test_placement_learns_the_adapter_ids_and_an_adapter_runs_no_kind() -> None:
    params = {"prompt": "x", ADAPTERS_PARAM: [{"id": "sd-lora", "scale": 1.0}, {"id": "sd-lora-2"}]}
    assert job_request("m", "sd1", "txt2img", "server", params).adapters == ("sd-lora", "sd-lora-2")
    assert job_request("m", "sd1", "txt2img", "server", {"prompt": "x"}).adapters == ()
    assert adapter_ids({ADAPTERS_PARAM: [{"id": 3}, "x", {"id": "ok"}]}) == ("ok",)
    assert kinds_of("sd1", ["adapter"]) == ("adapter",)  # not the family's kinds


SD15_UNET = {  # the model's weights (component -> weight name without .weight -> shape)
    "unet": {
        "down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q": (320, 320),
        "down_blocks.0.attentions.0.transformer_blocks.0.attn2.to_k": (320, 768),
    }
}
ATTN1 = "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q"
ATTN2 = "unet.down_blocks.0.attentions.0.transformer_blocks.0.attn2.to_k"


def lora(width: int = 768, self_width: int = 320) -> dict[str, tuple[int, ...]]:
    return {
        f"{ATTN1}.lora_down.weight": (4, self_width),
        f"{ATTN1}.lora_up.weight": (self_width, 4),
        f"{ATTN1}.alpha": (),
        f"{ATTN2}.lora_A.weight": (4, width),
        f"{ATTN2}.lora_B.weight": (320, 4),
    }


def fit_refusal(adapters: list[dict[str, tuple[int, ...]] | None], model_width: int | None = 768) -> Rejected:
    entries = [{"id": f"lora-{i}", "scale": 1.0} for i in range(len(adapters))]
    with pytest.raises(Rejected) as caught:
        check_adapter_fit("sd15", model_width, SD15_UNET, adapters, entries)
    assert (caught.value.status_code, caught.value.reason) == (422, "adapter_base_mismatch")
    return caught.value


def test_adapters_that_fit_or_do_not_say_pass() -> None:
    entries = [{"id": "a", "scale": 1.0}, {"id": "b", "scale": 0.5}, {"id": "c", "scale": 1.0}]
    unknown = {"lora_unet_input_blocks_4_1_proj_in.lora_down.weight": (4, 999)}  # SDXL's kohya names: not mapped
    check_adapter_fit("sd15", 768, SD15_UNET, [lora(), None, unknown], entries)
    check_adapter_fit("flux-dev", None, {}, [lora(width=4096)], entries[:1])  # a model without a UNet: no check


def test_an_adapter_made_for_another_cross_attention_width_is_refused_naming_both() -> None:
    error = fit_refusal([lora(), lora(width=1024)])
    assert error.param == "params.adapters[1].id"
    assert error.message.startswith(
        "params.adapters[1].id: adapter 'lora-1' was made for a UNet of cross-attention width 1024 (SD 2.x); "
        "model 'sd15' attends at width 768 (SD 1.x) (cross_attention_dim in its unet/config.json)"
    )


def test_an_adapter_whose_other_tensors_do_not_fit_is_refused_naming_the_tensor_and_module() -> None:
    """Self-attention says nothing of the text encoder's width; its own width must still fit."""
    error = fit_refusal([lora(self_width=640)])
    assert error.param == "params.adapters[0].id"
    assert error.message == (
        f"params.adapters[0].id: adapter 'lora-0' does not fit model 'sd15': its {ATTN1}.lora_down.weight is "
        "[4, 640], for inputs of width 640, where the model's unet "
        "down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q has 320 (weight [320, 320]); use an adapter "
        "made for the model's base"
    )


@pytest.mark.parametrize(
    ("config", "width"),
    [
        ('{"cross_attention_dim": 1024}', 1024),
        ('{"cross_attention_dim": [768, 768, 768, 768]}', 768),  # per block, all equal
        ('{"cross_attention_dim": [768, 1024]}', None),  # per block, unequal: no single width
        ('{"cross_attention_dim": true}', None),
        ("{}", None),
        ("not json", None),
        (None, None),  # no unet/ (a diffusion transformer)
    ],
)
def test_a_model_s_cross_attention_width_comes_from_its_unet_config(
    tmp_path: Path, config: str | None, width: int | None
) -> None:
    if config is not None:
        (tmp_path / "unet").mkdir()
        (tmp_path / "unet" / "config.json").write_text(config)
    assert model_context_width(tmp_path) == width
