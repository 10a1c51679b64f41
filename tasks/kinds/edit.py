"""edit: instruction-based image editing (StableDiffusionInstructPix2PixPipeline).

Params (``app/core/kinds.py``, defaults there): ``image`` (required: the id of an uploaded
file, ``"blake3:<hex>"``), ``prompt`` (required: the instruction, e.g. "make it snowy"),
``negative_prompt``, ``steps``, ``guidance_scale`` (how strongly to follow the instruction),
``image_guidance_scale`` (how closely to keep the input image), ``seed``. Output: one PNG with
the input image's width x height pixels (the pipeline keeps the input size; both must be
multiples of 8, checked at submission).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from app.core.kinds import spec
from tasks.kinds import Output, ProgressFn, denoising
from tasks.pipelines import decode_image, png_bytes

SPEC = spec("edit")


def run(pipeline: Any, params: Mapping[str, Any], progress: ProgressFn, provenance: dict[str, Any],
        inputs: Mapping[str, bytes]) -> Output:
    args = SPEC.args(params)
    result = pipeline(
        prompt=str(args["prompt"]),
        image=decode_image(inputs["image"]),
        negative_prompt=args.get("negative_prompt"),
        image_guidance_scale=float(args["image_guidance_scale"]),
        **denoising(args, progress),
    )
    return Output(data=png_bytes(result.images[0], provenance), media_type="image/png")
