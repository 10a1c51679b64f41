"""upscale: x4 super-resolution guided by a prompt (StableDiffusionUpscalePipeline).

Params (``app/core/kinds.py``, defaults there): ``image`` (required: the id of an uploaded
file), ``prompt`` (optional: the upscaler works without one), ``negative_prompt``, ``steps``,
``guidance_scale``, ``noise_level`` (noise added to the low-resolution image,
0..max_noise_level=350), ``seed``. Output: one PNG of 4*width x 4*height pixels (16x16 in ->
64x64 out).

This pipeline has no ``callback_on_step_end``: progress uses the legacy
``callback=fn(step, timestep, latents), callback_steps=1`` (docs/operations.md).
No memory cap of any kind is set here (R18: the memory guard belongs to the MPS backend only).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from app.core.kinds import family_kind_spec as kind_spec
from tasks.kinds import Output, ProgressFn, drawn_input, family_arguments
from tasks.pipelines import decode_image, png_bytes

KIND = "upscale"


def run(
    pipeline: Any,
    params: Mapping[str, Any],
    progress: ProgressFn,
    provenance: dict[str, Any],
    inputs: Mapping[str, bytes],
    family: str = "",
) -> Output:
    import torch

    args = kind_spec(family, KIND).args(params)
    drawn = drawn_input(decode_image(inputs["image"]), family)
    steps = int(args["steps"])
    generator = torch.Generator("cpu").manual_seed(int(args["seed"]))

    def on_step(step: int, _timestep: Any, _latents: Any) -> None:
        progress(step + 1, steps)

    result = pipeline(
        prompt=str(args["prompt"]),
        image=drawn.image,
        negative_prompt=args.get("negative_prompt"),
        num_inference_steps=steps,
        guidance_scale=float(args["guidance_scale"]),
        generator=generator,
        callback=on_step,
        callback_steps=1,
        **{"noise_level": int(args["noise_level"]), **family_arguments(args, family)},
    )
    [upscaled] = drawn.restored(result.images[:1], scale=4)  # the x4 upscaler
    return drawn.noted(Output(data=png_bytes(upscaled, provenance), media_type="image/png"))
