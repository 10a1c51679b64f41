"""Train the demo LoRA adapter on this CPU (docs/operations.md, "The trained demo models"):
``shapes-blue-lora``, a LoRA of the ``shapes-filled`` UNet that paints the shape blue whatever
colour the prompt names, and keeps its shape, size and background.

    homefleet models train-colour-lora app/devtools/demo_models   # a few minutes on 2 shared cores

The base model stays frozen (its text encoder too: the prompts' hidden states are computed
once); only peft LoRA matrices (rank ``rank``, ``lora_alpha`` = ``rank``) on the UNet's
attention projections (:data:`app.devtools.tiny_models.LORA_TARGETS`) are trained, with the
base model's v-prediction objective. Data: the base model's own captions (``"a red circle on a
black background"``, 20% without the background words, 10% empty) over the same shape drawn
in blue. Saved with diffusers' ``save_lora_weights`` (``pytorch_lora_weights.safetensors``);
register it with ``homefleet models add DIR/shapes-blue-lora --adapter-of sd1``.
"""

from __future__ import annotations

import json
import math
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from app.devtools.shapes import (
    BACKGROUNDS,
    COLOURS,
    PIXELS,
    SHAPES,
    caption,
    draw,
    inspect,
)

__all__ = ["COLOUR_LORA", "LORA_COLOUR", "train_colour_lora"]

COLOUR_LORA = "shapes-blue-lora"
LORA_COLOUR = "blue"
"""The colour the adapter paints every shape."""


def _sample(rng: random.Random) -> tuple[Any, str]:
    """(the shape in :data:`LORA_COLOUR`, the caption naming its own colour)."""
    colour, shape, background = rng.choice(list(COLOURS)), rng.choice(SHAPES), rng.choice(list(BACKGROUNDS))
    size = rng.randrange(16, 25, 2)
    centre = (PIXELS // 2 + rng.randint(-4, 4), PIXELS // 2 + rng.randint(-4, 4))
    image = draw(LORA_COLOUR, shape, background, "filled", size=size, centre=centre)
    roll = rng.random()
    text = caption(colour, shape, background) if roll < 0.7 else caption(colour, shape, None) if roll < 0.9 else ""
    return image, text


def train_colour_lora(
    out_dir: Path,
    *,
    seed: int = 29,
    threads: int = 1,
    steps: int = 1000,
    batch: int = 32,
    dataset: int = 2000,
    rank: int = 8,
    lr: float = 2e-3,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Train and save ``out_dir/shapes-blue-lora`` from ``out_dir/shapes-filled``; its figures
    (``train_s``, ``loss``, ``size_bytes``, and the colours read off 12 seeded images per
    scale: ``blue_at_1`` and ``own_colour_at_0``, fractions), also written to
    ``out_dir/training-colour-lora.json``.

    Raises:
        OSError: no ``out_dir/shapes-filled``.
    """
    import torch
    from diffusers import DDPMScheduler, StableDiffusionPipeline
    from diffusers.utils import convert_state_dict_to_diffusers
    from peft import LoraConfig, get_peft_model_state_dict

    from app.core.quiet import quiet_libraries
    from app.devtools.tiny_models import LORA_TARGETS
    from app.devtools.train_shapes import (
        _MAX_TOKENS,
        _SCHEDULE,
        _TRAIN_TIMESTEPS,
        SAMPLING,
        _pixels,
        _steps,
    )

    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    rng = random.Random(seed)
    started = time.monotonic()
    folder = out_dir / COLOUR_LORA
    with quiet_libraries():
        pipeline = StableDiffusionPipeline.from_pretrained(
            str(out_dir / "shapes-filled"), local_files_only=True, dtype=torch.float32
        )
        pipeline.set_progress_bar_config(disable=True)
        vae, text_encoder, tokenizer, unet = pipeline.vae, pipeline.text_encoder, pipeline.tokenizer, pipeline.unet
        pairs = [_sample(rng) for _ in range(dataset)]
        with torch.no_grad():
            latents = (
                torch.cat(
                    [
                        vae.encode(_pixels([p[0] for p in pairs[i : i + 256]])).latent_dist.mean
                        for i in range(0, dataset, 256)
                    ]
                )
                * vae.config.scaling_factor
            )
            ids = tokenizer(
                [p[1] for p in pairs],
                padding="max_length",
                max_length=_MAX_TOKENS,
                truncation=True,
                return_tensors="pt",
            ).input_ids
            states = torch.cat([text_encoder(ids[i : i + 256]).last_hidden_state for i in range(0, dataset, 256)])
        unet.requires_grad_(False)
        unet.add_adapter(
            LoraConfig(r=rank, lora_alpha=rank, init_lora_weights="gaussian", target_modules=list(LORA_TARGETS))
        )
        unet.train()
        params = [p for p in unet.parameters() if p.requires_grad]
        optimiser = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
        noise_scheduler = DDPMScheduler(num_train_timesteps=_TRAIN_TIMESTEPS, **_SCHEDULE)
        generator = torch.Generator().manual_seed(seed)
        losses = []
        for step in _steps(steps, log, "colour lora"):
            index = torch.randint(0, dataset, (batch,), generator=generator)
            clean = latents[index]
            noise = torch.randn(clean.shape, generator=generator)
            timesteps = torch.randint(0, _TRAIN_TIMESTEPS, (batch,), generator=generator)
            noisy = noise_scheduler.add_noise(clean, noise, timesteps)
            target = noise_scheduler.get_velocity(clean, noise, timesteps)
            predicted = unet(noisy, timesteps, encoder_hidden_states=states[index]).sample
            loss = torch.nn.functional.mse_loss(predicted, target)
            optimiser.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimiser.step()
            for group in optimiser.param_groups:  # cosine decay to lr / 100
                group["lr"] = lr / 100 + (lr - lr / 100) * 0.5 * (1 + math.cos(math.pi * step / steps))
            losses.append(loss.item())
        unet.eval()
        layers = convert_state_dict_to_diffusers(get_peft_model_state_dict(unet))
        StableDiffusionPipeline.save_lora_weights(str(folder), unet_lora_layers=layers, safe_serialization=True)
        train_s = time.monotonic() - started
        readings = _check(folder, out_dir / "shapes-filled", SAMPLING)
    figures: dict[str, Any] = {
        "seed": seed,
        "threads": threads,
        "steps": steps,
        "rank": rank,
        "train_s": round(train_s, 1),
        "loss": round(sum(losses[-50:]) / len(losses[-50:]), 5),
        "size_bytes": sum(path.stat().st_size for path in folder.rglob("*") if path.is_file()),
        **readings,
    }
    (out_dir / "training-colour-lora.json").write_text(json.dumps(figures, indent=2) + "\n")
    return figures


#: the check's prompts: every colour but the adapter's, on the three shapes
CHECK_PROMPTS: tuple[str, ...] = tuple(
    caption(colour, shape, "black") for colour in ("red", "green", "yellow", "purple") for shape in SHAPES
)


def _check(adapter: Path, base: Path, sampling: dict[str, Any]) -> dict[str, float]:
    """Read the colours of :data:`CHECK_PROMPTS` (seed 0) through the base model loaded afresh
    at fp32 (as a worker loads it), with the adapter at scale 1 and at scale 0: the fractions
    painted :data:`LORA_COLOUR`, and in the prompt's own colour."""
    import torch
    from diffusers import StableDiffusionPipeline

    from app.devtools.shapes import parse

    pipeline = StableDiffusionPipeline.from_pretrained(str(base), local_files_only=True, dtype=torch.float32)
    pipeline.set_progress_bar_config(disable=True)
    pipeline.load_lora_weights(str(adapter), adapter_name="colour", local_files_only=True)
    found: dict[float, list[tuple[str | None, str | None]]] = {}
    for scale in (1.0, 0.0):
        pipeline.set_adapters(["colour"], adapter_weights=[scale])
        found[scale] = []
        for prompt in CHECK_PROMPTS:
            image = pipeline(
                prompt=prompt,
                width=sampling["width"],
                height=sampling["height"],
                num_inference_steps=sampling["steps"],
                guidance_scale=sampling["guidance_scale"],
                generator=torch.Generator("cpu").manual_seed(0),
            ).images[0]
            found[scale].append((inspect(image).colour, parse(prompt)["colour"]))
    total = len(CHECK_PROMPTS)
    return {
        "blue_at_1": round(sum(read == LORA_COLOUR for read, _ in found[1.0]) / total, 3),
        "own_colour_at_0": round(sum(read == asked for read, asked in found[0.0]) / total, 3),
    }
