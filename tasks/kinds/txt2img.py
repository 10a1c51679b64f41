"""txt2img: text to one image with a StableDiffusion-style pipeline.

Params (``app/core/kinds.py``, defaults there): ``prompt`` (required), ``negative_prompt``,
``width`` and ``height`` (pixels, multiples of 8), ``steps``, ``guidance_scale``, ``seed``.
Output: one PNG, width x height pixels.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from app.core.kinds import spec
from tasks.kinds import Output, ProgressFn, denoising
from tasks.pipelines import png_bytes

SPEC = spec("txt2img")


def run(pipeline: Any, params: Mapping[str, Any], progress: ProgressFn, provenance: dict[str, Any],
        inputs: Mapping[str, bytes]) -> Output:
    args = SPEC.args(params)
    result = pipeline(
        prompt=str(args["prompt"]),
        negative_prompt=args.get("negative_prompt"),
        width=int(args["width"]),
        height=int(args["height"]),
        **denoising(args, progress),
    )
    return Output(data=png_bytes(result.images[0], provenance), media_type="image/png")
