"""img2img: an input image redrawn from a prompt (StableDiffusionImg2ImgPipeline,
StableDiffusionXLImg2ImgPipeline: built from the resident txt2img pipeline's components with
``from_pipe``, ``tasks.kinds.kind_pipeline``).

Params (``app/core/kinds.py``, each family's changes in ``app/core/families.py``): ``image``
(required: the id of an uploaded file, ``"blake3:<hex>"``), ``prompt`` (required),
``negative_prompt``, ``strength`` (0..1, default 0.8: how much noise is added to the input;
near 0 keeps it, 1 redraws it), ``steps``, ``guidance_scale``, ``seed``. The pipeline runs
``int(steps * strength)`` denoising steps (at least 1, checked at submission); progress counts
those; ``n`` images in one call as txt2img's. Output: n PNGs with the input image's width x
height pixels (drawn at the nearest multiples of 8 and resized back: ``DrawnInput``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from app.core.kinds import denoised_steps
from app.core.kinds import family_kind_spec as kind_spec
from tasks.kinds import (
    Output,
    ProgressFn,
    denoising,
    drawn_input,
    family_arguments,
    image_output,
    kind_pipeline,
)
from tasks.pipelines import decode_image, png_bytes

KIND = "img2img"


def run(
    pipeline: Any,
    params: Mapping[str, Any],
    progress: ProgressFn,
    provenance: dict[str, Any],
    inputs: Mapping[str, bytes],
    family: str = "",
) -> Output:
    args = kind_spec(family, KIND).args(params)
    drawn = drawn_input(decode_image(inputs["image"]), family)
    strength = float(args["strength"])
    result = kind_pipeline(pipeline, family, KIND)(
        prompt=str(args["prompt"]),
        image=drawn.image,
        negative_prompt=args.get("negative_prompt"),
        strength=strength,
        **denoising(args, progress, total=denoised_steps(int(args["steps"]), strength)),
        **family_arguments(args, family),
    )
    return drawn.noted(
        image_output(
            drawn.restored(result.images), args, provenance, png_bytes, getattr(result, "nsfw_content_detected", None)
        )
    )
