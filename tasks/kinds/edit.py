"""edit: instruction-based image editing (StableDiffusionInstructPix2PixPipeline).

Params (defaults): ``image`` (required: the id of an uploaded file, ``"blake3:<hex>"``),
``prompt`` (str, required: the instruction, e.g. "make it snowy"), ``negative_prompt``
(None), ``steps`` (4), ``guidance_scale`` (7.5: how strongly to follow the instruction),
``image_guidance_scale`` (1.5: how closely to keep the input image), ``seed``.
Output: one PNG with the input image's width x height pixels (the pipeline keeps the input
size; both must be multiples of 8, checked at submission).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tasks.kinds import DENOISING_PARAMS, Output, ProgressFn, denoising
from tasks.pipelines import decode_image, png_bytes

#: every param run() reads; the server refuses any other key at submission (app/core/kinds.py)
PARAMS: tuple[str, ...] = ("image", "prompt", "negative_prompt", "image_guidance_scale", *DENOISING_PARAMS)


def run(pipeline: Any, params: dict[str, Any], progress: ProgressFn, provenance: dict[str, Any],
        inputs: Mapping[str, bytes]) -> Output:
    result = pipeline(
        prompt=str(params["prompt"]),
        image=decode_image(inputs["image"]),
        negative_prompt=params.get("negative_prompt"),
        image_guidance_scale=float(params.get("image_guidance_scale", 1.5)),
        **denoising(params, progress),
    )
    return Output(data=png_bytes(result.images[0], provenance), media_type="image/png")
