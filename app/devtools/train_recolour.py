"""Train the demo edit model on this CPU (docs/operations.md, "The trained demo models"):
``shapes-recolour``, a tiny ``StableDiffusionInstructPix2PixPipeline`` that recolours a flat
shape ("make it blue") and keeps its shape, size, place and background.

    homefleet models train-recolour app/devtools/demo_models   # ~7 min on 2 shared cores

It reuses the VAE of ``DIR/shapes-filled`` (trained by :mod:`app.devtools.train_shapes`) and
trains a new ``CLIPTextModel`` (the shapes words plus "make" and "it") and a UNet with 8 input
channels (4 noisy latents + 4 latents of the input picture, unscaled, as InstructPix2Pix
reads them), with the same v-prediction objective; the text is dropped 10% of the time and the
input picture 10% (zeros), so both guidance scales work. Data: a filled shape of one colour ->
the same shape in another colour, captioned ``"make it <colour>"``. 32 x 32 pixels, the
scheduler and sampling of the txt2img models (``SAMPLING``, plus ``image_guidance_scale``).
"""

from __future__ import annotations

import json
import random
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from app.devtools.shapes import BACKGROUNDS, COLOURS, PIXELS, SHAPES, draw

__all__ = ["EDIT_SAMPLING", "RECOLOUR_MODEL", "train_recolour"]

RECOLOUR_MODEL = "shapes-recolour"
#: how the demo and the tests run it (edit job params besides ``image`` and ``prompt``)
EDIT_SAMPLING: dict[str, Any] = {"steps": 8, "guidance_scale": 4.0, "image_guidance_scale": 1.5}


def _pair(rng: random.Random) -> tuple[Any, Any, str]:
    """(input picture, the recoloured picture, ``"make it <colour>"``)."""
    first, second = rng.sample(list(COLOURS), 2)
    shape, background = rng.choice(SHAPES), rng.choice(list(BACKGROUNDS))
    size = rng.randrange(16, 25, 2)
    centre = (PIXELS // 2 + rng.randint(-4, 4), PIXELS // 2 + rng.randint(-4, 4))
    before = draw(first, shape, background, "filled", size=size, centre=centre)
    after = draw(second, shape, background, "filled", size=size, centre=centre)
    return before, after, f"make it {second}"


def train_recolour(
    out_dir: Path,
    *,
    seed: int = 23,
    threads: int = 1,
    steps: int = 1000,
    batch: int = 32,
    dataset: int = 4000,
    log: Callable[[str], None] = print,
) -> dict[str, float]:
    """Train and save ``out_dir/shapes-recolour`` (needs ``out_dir/shapes-filled`` for its VAE);
    its figures (``train_s``, ``loss``, ``size_bytes``), also written to
    ``out_dir/training-recolour.json``.

    Raises:
        FileNotFoundError: no ``out_dir/shapes-filled/vae``.
    """
    import copy

    import torch
    from diffusers import (
        AutoencoderKL,
        DDPMScheduler,
        StableDiffusionInstructPix2PixPipeline,
    )

    from app.core.quiet import quiet_libraries
    from app.devtools.train_shapes import (
        _MAX_TOKENS,
        _SCHEDULE,
        _TRAIN_TIMESTEPS,
        _WORDS,
        _ema_update,
        _pixels,
        _scheduler,
        _steps,
        _text_encoder,
        _unet,
        build_tokenizer,
    )

    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    rng = random.Random(seed)
    started = time.monotonic()
    with quiet_libraries():
        vae = AutoencoderKL.from_pretrained(str(out_dir / "shapes-filled" / "vae"), dtype=torch.float32).eval()
        with tempfile.TemporaryDirectory() as scratch:
            tokenizer = build_tokenizer(Path(scratch), (*_WORDS, "make", "it"))
        pairs = [_pair(rng) for _ in range(dataset)]
        with torch.no_grad():

            def encode(images: list[Any]) -> Any:
                return torch.cat(
                    [vae.encode(_pixels(images[i : i + 256])).latent_dist.mean for i in range(0, len(images), 256)]
                )

            inputs = encode([p[0] for p in pairs])  # unscaled: InstructPix2Pix's image latents
            targets = encode([p[1] for p in pairs]) * vae.config.scaling_factor
        ids = tokenizer(
            [p[2] for p in pairs], padding="max_length", max_length=_MAX_TOKENS, truncation=True, return_tensors="pt"
        ).input_ids
        empty = tokenizer([""], padding="max_length", max_length=_MAX_TOKENS, return_tensors="pt").input_ids
        text_encoder, unet = _text_encoder(tokenizer).train(), _unet(in_channels=8).train()
        noise_scheduler = DDPMScheduler(num_train_timesteps=_TRAIN_TIMESTEPS, **_SCHEDULE)
        params = [*unet.parameters(), *text_encoder.parameters()]
        ema_unet, ema_text = copy.deepcopy(unet).eval(), copy.deepcopy(text_encoder).eval()
        ema_params = [*ema_unet.parameters(), *ema_text.parameters()]
        optimiser = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.0)
        generator = torch.Generator().manual_seed(seed)
        losses = []
        for step in _steps(steps, log, "recolour"):
            index = torch.randint(0, dataset, (batch,), generator=generator)
            clean, image = targets[index], inputs[index].clone()
            tokens = ids[index].clone()
            drop = torch.rand(batch, generator=generator)
            tokens[drop < 0.1] = empty[0]  # no instruction
            image[(drop >= 0.05) & (drop < 0.15)] = 0.0  # no input picture (overlapping 5%: neither)
            noise = torch.randn(clean.shape, generator=generator)
            timesteps = torch.randint(0, _TRAIN_TIMESTEPS, (batch,), generator=generator)
            noisy = noise_scheduler.add_noise(clean, noise, timesteps)
            target = noise_scheduler.get_velocity(clean, noise, timesteps)
            states = text_encoder(tokens).last_hidden_state
            predicted = unet(torch.cat([noisy, image], dim=1), timesteps, encoder_hidden_states=states).sample
            loss = torch.nn.functional.mse_loss(predicted, target)
            optimiser.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimiser.step()
            _ema_update(ema_params, params, min(0.999, (1 + step) / (10 + step)))
            losses.append(loss.item())
        pipeline = StableDiffusionInstructPix2PixPipeline(
            vae=vae,
            text_encoder=ema_text,
            tokenizer=tokenizer,
            unet=ema_unet,
            scheduler=_scheduler(),
            safety_checker=None,
            feature_extractor=None,
            requires_safety_checker=False,
        ).to(torch.float16)
        folder = out_dir / RECOLOUR_MODEL
        pipeline.save_pretrained(str(folder), safe_serialization=True)
    figures = {
        "seed": seed,
        "threads": threads,
        "steps": steps,
        "train_s": round(time.monotonic() - started, 1),
        "loss": round(sum(losses[-100:]) / len(losses[-100:]), 5),
        "size_bytes": sum(path.stat().st_size for path in folder.rglob("*") if path.is_file()),
    }
    (out_dir / "training-recolour.json").write_text(json.dumps(figures, indent=2) + "\n")
    return figures
