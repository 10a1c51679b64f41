"""upscale: x4 super-resolution guided by a prompt (StableDiffusionUpscalePipeline).

Params (defaults): ``image`` (required: the id of an uploaded file), ``prompt`` ("": the
upscaler works without one), ``negative_prompt`` (None), ``steps`` (4), ``guidance_scale``
(9.0), ``noise_level`` (20: noise added to the low-resolution image, 0..max_noise_level=350),
``seed``. Output: one PNG of 4*width x 4*height pixels (16x16 in -> 64x64 out).

This pipeline has no ``callback_on_step_end``: progress uses the legacy
``callback=fn(step, timestep, latents), callback_steps=1`` (shared/notes/diffusers-offline.md).
No memory cap of any kind is set here (R18: the memory guard belongs to the MPS backend only).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tasks.kinds import DENOISING_PARAMS, Output, ProgressFn
from tasks.pipelines import decode_image, png_bytes

#: every param run() reads; the server refuses any other key at submission (app/core/kinds.py).
#: steps, guidance_scale and seed as every kind, read here rather than by denoising() (no callback_on_step_end)
PARAMS: tuple[str, ...] = ("image", "prompt", "negative_prompt", "noise_level", *DENOISING_PARAMS)


def run(pipeline: Any, params: dict[str, Any], progress: ProgressFn, provenance: dict[str, Any],
        inputs: Mapping[str, bytes]) -> Output:
    import torch

    image = decode_image(inputs["image"])
    steps = int(params.get("steps", 4))
    generator = torch.Generator("cpu").manual_seed(int(params["seed"]))

    def on_step(step: int, _timestep: Any, _latents: Any) -> None:
        progress(step + 1, steps)

    result = pipeline(
        prompt=str(params.get("prompt", "")),
        image=image,
        negative_prompt=params.get("negative_prompt"),
        num_inference_steps=steps,
        guidance_scale=float(params.get("guidance_scale", 9.0)),
        noise_level=int(params.get("noise_level", 20)),
        generator=generator,
        callback=on_step,
        callback_steps=1,
    )
    return Output(data=png_bytes(result.images[0], provenance), media_type="image/png")
