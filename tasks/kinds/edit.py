"""edit: instruction-based image editing (StableDiffusionInstructPix2PixPipeline, QwenImageEditPipeline,
FluxKontextPipeline).

Params (``app/core/kinds.py``, each family's changes in ``app/core/families.py``): ``image``
(required: the id of an uploaded file, ``"blake3:<hex>"``), ``prompt`` (required: the
instruction, e.g. "make it snowy"), ``negative_prompt``, ``steps``, ``seed``; InstructPix2Pix:
``guidance_scale`` (how strongly to follow the instruction) and ``image_guidance_scale`` (how
closely to keep the input image); Qwen-Image-Edit: ``true_cfg_scale`` (true CFG with the
negative prompt, default 4.0), no guidance scale of either kind; Flux Kontext: ``guidance_scale``
(distilled, default 2.5) and ``true_cfg_scale`` (1.0). Output: one PNG with the input
image's width x height pixels (drawn at the nearest multiples of 8, of 16 for Qwen-Image and
Flux Kontext, and resized back: ``DrawnInput``; those two pipelines are given the drawn size,
else they draw at ~1024x1024).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from app.core.families import family as family_rules
from app.core.kinds import family_kind_spec as kind_spec
from tasks.kinds import Output, ProgressFn, denoising, drawn_input, family_arguments
from tasks.pipelines import decode_image, png_bytes

KIND = "edit"


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
    image = drawn.image
    rules = family_rules(family)
    size = {"width": image.width, "height": image.height, "max_area": image.width * image.height}
    keep = {name: size[name] for name in rules.size_arguments} if rules is not None else {}
    result = pipeline(
        prompt=str(args["prompt"]),
        image=image,
        negative_prompt=args.get("negative_prompt"),
        **keep,
        **(dict(rules.fixed_arguments) if rules is not None else {}),
        **denoising(args, progress),
        **family_arguments(args, family),
    )
    [edited] = drawn.restored(result.images[:1])
    return drawn.noted(Output(data=png_bytes(edited, provenance), media_type="image/png"))
