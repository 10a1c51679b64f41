"""txt2img: text to one image (StableDiffusionPipeline, StableDiffusionXLPipeline, FluxPipeline).

Params (``app/core/kinds.py``, each family's changes in ``app/core/families.py``): ``prompt``
(required), ``negative_prompt``, ``width`` and ``height`` (pixels, multiples of 8; Flux: 16),
``steps``, ``guidance_scale`` (Flux: the distilled guidance, default 3.5), ``seed``; Flux also
``true_cfg_scale`` (true CFG with the negative prompt above 1); ``n`` (images, default 1:
one call with ``num_images_per_prompt``, image i seeded ``seed + i``, ``tasks.kinds.image_output``).
Output: n PNGs, width x height pixels.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from app.core.kinds import family_kind_spec as kind_spec
from tasks.kinds import Output, ProgressFn, denoising, family_arguments, image_output
from tasks.pipelines import png_bytes

KIND = "txt2img"


def run(
    pipeline: Any,
    params: Mapping[str, Any],
    progress: ProgressFn,
    provenance: dict[str, Any],
    inputs: Mapping[str, bytes],
    family: str = "",
) -> Output:
    args = kind_spec(family, KIND).args(params)
    result = pipeline(
        prompt=str(args["prompt"]),
        negative_prompt=args.get("negative_prompt"),
        width=int(args["width"]),
        height=int(args["height"]),
        **denoising(args, progress),
        **family_arguments(args, family),
    )
    return image_output(
        list(result.images), args, provenance, png_bytes, getattr(result, "nsfw_content_detected", None)
    )
