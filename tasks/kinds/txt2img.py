"""txt2img: text to one image with a StableDiffusion-style pipeline.

Params (defaults): ``prompt`` (str, required), ``negative_prompt`` (None), ``width`` and
``height`` (64 pixels, multiples of 8), ``steps`` (4), ``guidance_scale`` (7.5),
``seed`` (int; the server draws one when absent). Output: one PNG, width x height pixels.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tasks.kinds import DENOISING_PARAMS, Output, ProgressFn, denoising
from tasks.pipelines import png_bytes

#: every param run() reads; the server refuses any other key at submission (app/core/kinds.py)
PARAMS: tuple[str, ...] = ("prompt", "negative_prompt", "width", "height", *DENOISING_PARAMS)


def run(pipeline: Any, params: dict[str, Any], progress: ProgressFn, provenance: dict[str, Any],
        inputs: Mapping[str, bytes]) -> Output:
    result = pipeline(
        prompt=str(params["prompt"]),
        negative_prompt=params.get("negative_prompt"),
        width=int(params.get("width", 64)),
        height=int(params.get("height", 64)),
        **denoising(params, progress),
    )
    return Output(data=png_bytes(result.images[0], provenance), media_type="image/png")
