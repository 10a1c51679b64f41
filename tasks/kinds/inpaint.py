"""inpaint: repaint the masked part of an input image from a prompt
(StableDiffusionInpaintPipeline, StableDiffusionXLInpaintPipeline: built from the resident
txt2img pipeline's components with ``from_pipe``, ``tasks.kinds.kind_pipeline``).

Params (``app/core/kinds.py``): ``image`` and ``mask`` (required: ids of uploaded files of the
same size, checked at submission; the mask is read as greyscale and binarized at half: white
repaints, black keeps), ``prompt`` (required), ``negative_prompt``, ``strength`` (0..1, default
1.0: how much noise is added inside the mask), ``steps``, ``guidance_scale``, ``seed``. The
pipeline runs ``int(steps * strength)`` denoising steps (at least 1). A txt2img UNet (4 input
channels) inpaints by putting the input's latents back outside the mask after every step
(diffusers' legacy inpainting); a 9-channel inpainting UNet reads the mask itself.

Output: ``n`` PNGs (one call, as txt2img's) with the input's width x height pixels; outside the mask the pixels ARE the
input's (the result is pasted in through the binarized mask, as diffusers'
``VaeImageProcessor.apply_overlay`` does: the VAE's round trip would otherwise change them).
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
from tasks.pipelines import decode_image, decode_mask, png_bytes

KIND = "inpaint"


def run(
    pipeline: Any,
    params: Mapping[str, Any],
    progress: ProgressFn,
    provenance: dict[str, Any],
    inputs: Mapping[str, bytes],
    family: str = "",
) -> Output:
    from PIL import Image

    args = kind_spec(family, KIND).args(params)
    image = decode_image(inputs["image"])
    mask = decode_mask(inputs["mask"])  # the image's size (checked at submission)
    drawn = drawn_input(image, family)
    drawn_mask = mask.resize(drawn.image.size, Image.Resampling.NEAREST) if drawn.resized else mask
    strength = float(args["strength"])
    result = kind_pipeline(pipeline, family, KIND)(
        prompt=str(args["prompt"]),
        image=drawn.image,
        mask_image=drawn_mask,
        negative_prompt=args.get("negative_prompt"),
        width=drawn.image.width,  # else the pipeline draws at the UNet's sample size
        height=drawn.image.height,
        strength=strength,
        **denoising(args, progress, total=denoised_steps(int(args["steps"]), strength)),
        **family_arguments(args, family),
    )
    # white: the result; black: the input, at the input's own size
    painted = [Image.composite(out.convert("RGB"), image, mask) for out in drawn.restored(result.images)]
    return drawn.noted(
        image_output(painted, args, provenance, png_bytes, getattr(result, "nsfw_content_detected", None))
    )
