"""Each kind's spec (app/core/kinds.py) is the one list of what it accepts (R22): every param a
runner reads is in it (a runner cannot read another: ``KindSpec.args``), every param it lists is
read, and the server refuses a key outside it, naming it."""

from __future__ import annotations

import io
from types import SimpleNamespace
from typing import Any

import pytest
from PIL import Image

from app.core.errors import Rejected
from app.core.families import FAMILIES, TEXT_FAMILIES
from app.core.kinds import KINDS, family_kind_spec, job_request, spec
from app.jobs.validation import check_known_params
from routing.timings import job_size
from tasks.kinds import runner

# text: tests/unit/tasks/test_text_kind.py
DIFFUSION_FAMILIES = [name for name in FAMILIES if name not in TEXT_FAMILIES]


def fake_pipeline(**kwargs: Any) -> Any:
    """Stands in for a diffusers pipeline: one 8x8 image (or a 2-frame clip)."""
    frame = Image.new("RGB", (8, 8))
    return SimpleNamespace(images=[frame], frames=[[frame, frame]])


def png() -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (8, 8)).save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.mark.parametrize("family", DIFFUSION_FAMILIES)
def test_a_runner_reads_exactly_the_params_its_familys_spec_lists(family: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Per family (app/core/families.py), every param of the family's spec is read."""
    kind = FAMILIES[family].kind
    kind_spec = family_kind_spec(family, kind)
    seen: list[Any] = []
    real = type(kind_spec).args
    monkeypatch.setattr(type(kind_spec), "args", lambda self, params: seen.append(real(self, params)) or seen[-1])
    params = {"prompt": "x", "seed": 1, **({"format": "gif"} if kind == "video" else {})}
    runner(kind)(fake_pipeline, params, lambda step, total: None, {}, {"image": png()}, family=family)
    (args,) = seen
    inputs_read_as_bytes = set(kind_spec.inputs)  # the image comes as bytes, not from params
    assert args.read | inputs_read_as_bytes == set(kind_spec.params)


def test_a_runner_cannot_read_a_param_its_spec_does_not_list() -> None:
    args = spec("txt2img").args({"prompt": "x", "seed": 1})
    assert (args["steps"], args["width"], args.get("negative_prompt")) == (4, 64, None)  # defaults; absent
    with pytest.raises(KeyError, match="kind 'txt2img' reads 'noise_level', which its spec does not list"):
        args.get("noise_level")


def test_placement_reads_the_kinds_defaults() -> None:
    assert job_request("m", "sd1", "txt2img", "auto", {}).size == job_size(64 * 64)
    assert job_request("m", "animatediff", "video", "auto", {}).size == job_size(64 * 64, 8)
    assert job_request("m", "sd1", "upscale", "auto", {"output_width": 64, "output_height": 32}).size == 64 * 32
    assert job_request("m", "sd1", "txt2img", "auto", {"steps": 9}).steps == 9


def test_server_set_output_size_is_accepted_only_where_the_server_sets_it() -> None:
    assert {"output_width", "output_height"} <= set(spec("edit").accepted) & set(spec("upscale").accepted)
    assert "output_width" not in spec("txt2img").accepted and "output_width" not in spec("video").accepted


@pytest.mark.parametrize(
    ("kind", "params", "message"),
    [
        (
            "txt2img",
            {"prompt": "x", "stepz": 4},
            "params.stepz is not a param of kind 'txt2img'; it takes prompt, negative_prompt, width, height, steps, "
            "guidance_scale, seed, n, expand_prompt, adapters",  # what the client may send, the server's too
        ),
        (
            "txt2img",
            {"output_width": 8, "batch": 2},
            "params.output_width, params.batch are not params of kind 'txt2img'",
        ),
        (
            "edit",
            {"width": 64},
            "it takes image, prompt, negative_prompt, image_guidance_scale, steps, guidance_scale, seed",
        ),
        ("upscale", {"frames": 2}, "it takes image, prompt, negative_prompt, noise_level, steps, guidance_scale, seed"),
        (
            "video",
            {"noise_level": 2},
            "it takes prompt, negative_prompt, width, height, frames, fps, format, steps, guidance_scale, seed",
        ),
    ],
)
def test_a_key_the_kind_does_not_use_is_refused_naming_it_and_the_accepted_ones(
    kind: str, params: dict[str, Any], message: str
) -> None:
    with pytest.raises(Rejected) as refused:
        check_known_params(kind, params)
    assert refused.value.reason == "unknown_param"
    assert message in refused.value.message


def test_every_param_a_kind_takes_passes_and_an_unknown_kind_is_named() -> None:
    for kind in KINDS:
        check_known_params(kind, dict.fromkeys(spec(kind).accepted, 1))
    with pytest.raises(Rejected) as refused:
        check_known_params("outpaint", {})
    assert refused.value.reason == "kind_not_supported"
    assert "txt2img, edit, img2img, inpaint, upscale, video" in refused.value.message


def test_a_null_param_is_read_as_absent_by_the_runner() -> None:
    """The server reads null as absent for a kind's optional params (the schema allows null, R22):
    so does the runner, which takes the default. The fuzz run's ``"frames": null`` video job was
    accepted, then failed on the worker with ``int(None)``."""
    from app.core.kinds import family_kind_spec

    spec = family_kind_spec("animatediff", "video")
    args = spec.args({"prompt": "a", "frames": None, "seed": None})
    assert args["frames"] == spec.defaults["frames"] and args.get("frames") == spec.defaults["frames"]
    assert spec.value({"frames": None}, "frames") == spec.defaults["frames"]
    assert args.get("seed") is None  # no default: still None


def test_the_nth_seed_of_several_wraps_past_the_largest_seed_to_zero() -> None:
    """Image or job i of n asked with ``seed`` runs with ``seed + i``; from the largest seed the
    next is 0, never a seed the server itself refuses."""
    from app.core.kinds import MAX_SEED, nth_seed

    assert [nth_seed(40, i) for i in range(3)] == [40, 41, 42]
    assert [nth_seed(MAX_SEED - 1, i) for i in range(4)] == [MAX_SEED - 1, MAX_SEED, 0, 1]


def test_a_range_s_ends_show_whole_numbers_in_full() -> None:
    """A refusal's range reads ``from 1 to 1000000``, never ``1e+06``; fractions as they are."""
    from app.core.specs import NumberRange

    assert NumberRange("max_new_tokens", 1, 1_000_000, integer=True).refusal(0) == (
        "must be an integer from 1 to 1000000, got 0"
    )
    assert NumberRange("top_p", 1e-05, 1.0).refusal(2) == "must be a number from 1e-05 to 1, got 2"
