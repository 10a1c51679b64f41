"""Each kind's ``PARAMS`` (tasks/kinds) is the list the server checks a submission against
(R22): every key a runner reads must be in it, and a key outside it is refused, naming it."""

from __future__ import annotations

import io
from types import SimpleNamespace
from typing import Any

import pytest
from PIL import Image

from app.core.errors import Rejected
from app.core.kinds import accepted_params, check_known_params
from tasks.kinds import kind_params, runner

KINDS = ("txt2img", "edit", "upscale", "video")


class ReadParams(dict[str, Any]):
    """A params dict that records every key a runner reads."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.read: set[str] = set()

    def __getitem__(self, key: str) -> Any:
        self.read.add(key)
        return super().__getitem__(key)

    def get(self, key: str, default: Any = None) -> Any:
        self.read.add(key)
        return super().get(key, default)

    def __contains__(self, key: object) -> bool:
        self.read.add(str(key))
        return super().__contains__(key)


def fake_pipeline(**kwargs: Any) -> Any:
    """Stands in for a diffusers pipeline: one 8x8 image (or a 2-frame clip)."""
    frame = Image.new("RGB", (8, 8))
    return SimpleNamespace(images=[frame], frames=[[frame, frame]])


def png() -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (8, 8)).save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.mark.parametrize("kind", KINDS)
def test_every_param_a_kind_reads_is_in_its_params(kind: str) -> None:
    params = ReadParams({"prompt": "x", "seed": 1, "format": "gif"} if kind == "video" else {"prompt": "x", "seed": 1})
    runner(kind)(fake_pipeline, params, lambda step, total: None, {}, {"image": png()})
    assert params.read and params.read <= set(kind_params(kind))


def test_server_set_output_size_is_accepted_only_where_the_server_sets_it() -> None:
    assert {"output_width", "output_height"} <= set(accepted_params("edit")) & set(accepted_params("upscale"))
    assert "output_width" not in accepted_params("txt2img") and "output_width" not in accepted_params("video")


@pytest.mark.parametrize(
    ("kind", "params", "message"),
    [
        ("txt2img", {"prompt": "x", "stepz": 4},
         "params.stepz is not a param of kind 'txt2img'; it takes prompt, negative_prompt, width, height, steps, "
         "guidance_scale, seed"),
        ("txt2img", {"output_width": 8, "batch": 2}, "params.output_width, params.batch are not params of kind 'txt2img'"),
        ("edit", {"width": 64}, "it takes image, prompt, negative_prompt, image_guidance_scale, steps, guidance_scale, seed"),
        ("upscale", {"frames": 2}, "it takes image, prompt, negative_prompt, noise_level, steps, guidance_scale, seed"),
        ("video", {"noise_level": 2}, "it takes prompt, negative_prompt, width, height, frames, fps, format, steps, "
                                      "guidance_scale, seed"),
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
        check_known_params(kind, dict.fromkeys(accepted_params(kind), 1))
    with pytest.raises(Rejected) as refused:
        check_known_params("inpaint", {})
    assert refused.value.reason == "kind_not_supported" and "txt2img, edit, upscale, video" in refused.value.message
