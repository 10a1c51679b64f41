"""Train the two demo txt2img models on this CPU (docs/operations.md, "The trained demo models"):
tiny text-to-image pipelines that draw what they are asked, on a synthetic data set of flat
shapes (:mod:`app.devtools.shapes`).

``shapes-filled`` paints solid shapes, ``shapes-outlined`` draws only their edges, so a
result shows which model made it. Each is a real diffusers ``StableDiffusionPipeline`` folder
(``UNet2DConditionModel`` + ``AutoencoderKL`` + ``CLIPTextModel`` + ``CLIPTokenizer`` +
``DDIMScheduler``), 32 x 32 pixels (latents 4 x 8 x 8), 2.8 MB of float16 safetensors; it
loads like any registered model::

    homefleet models train-shapes app/devtools/demo_models   # ~14 min on 2 shared cores
    DiffusionPipeline.from_pretrained("app/devtools/demo_models/shapes-filled", local_files_only=True)

The recipe, all offline and seeded:

1. A word-level ``CLIPTokenizer``: CLIP's byte-level vocabulary (any text still tokenizes)
   plus BPE merges that make each of the data set's words one token.
2. One ``AutoencoderKL`` (3 blocks: 32 x 32 pixels -> 8 x 8 latents), trained first on
   both styles to reconstruct (L1 + MSE + a tiny KL term) and shared by both models; its
   ``scaling_factor`` is set to 1 / the latents' standard deviation.
3. Per style, a ``CLIPTextModel`` (hidden 64, 2 layers) and a ``UNet2DConditionModel``
   (channels 32/64; the pooled prompt joins the timestep embedding), trained jointly with the DDPM objective in its
   v-prediction form
   (zero terminal SNR), captions dropped 10% of the time so that classifier-free guidance
   works; the saved weights are an exponential moving average of the trained ones.
4. The scheduler: DDIM with ``trailing`` timesteps, so 4-8 steps start from pure noise.

``torch`` threads are capped (``threads``, default 1 per process; the two styles train in two
processes at once): the training shares the machine. Same seed, same torch and thread
count: the same bytes (two 3-step runs gave identical safetensors).
"""

from __future__ import annotations

import json
import math
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from app.devtools.shapes import (
    BACKGROUNDS,
    COLOURS,
    PIXELS,
    SHAPES,
    STYLES,
    caption,
    draw,
)

__all__ = ["DEMO_MODELS_DIR", "MODEL_NAMES", "SAMPLING", "TrainingReport", "build_tokenizer", "train_shapes"]

DEMO_MODELS_DIR = Path(__file__).parent / "demo_models"
#: style -> the folder name (and the demo's model id)
MODEL_NAMES: dict[str, str] = {"filled": "shapes-filled", "outlined": "shapes-outlined"}

#: how the demo and the tests sample the trained models (job params): their trained size, pixels
SAMPLING: dict[str, Any] = {"width": PIXELS, "height": PIXELS, "steps": 8, "guidance_scale": 4.0}

_WORDS = ("a", "on", "background", *COLOURS, *SHAPES, *BACKGROUNDS)
_TEXT_HIDDEN = 64
_MAX_TOKENS = 77  # CLIP's; the server's max_prompt_tokens for the sd1 family
_LATENT = PIXELS // 4
_TRAIN_TIMESTEPS = 1000
_SCHEDULE = {
    "beta_start": 0.00085,
    "beta_end": 0.012,
    "beta_schedule": "scaled_linear",
    "prediction_type": "v_prediction",
    "rescale_betas_zero_snr": True,
}


@dataclass
class TrainingReport:
    """What a training run did: steps, seconds (wall, this process), final losses (mean of the
    last 100 steps) and the saved folders' sizes, bytes."""

    seed: int
    threads: int
    vae_steps: int
    vae_s: float
    vae_loss: float
    unet_steps: int
    styles: dict[str, dict[str, float]]
    total_s: float


def _sample(rng: random.Random, style: str) -> tuple[Any, str]:
    """One (image, caption) pair: a random shape, colour, background, size and position.
    Captions: 70% full, 20% without the background words (the background is still drawn),
    10% empty (classifier-free guidance's unconditional case)."""
    colour, shape, background = rng.choice(list(COLOURS)), rng.choice(SHAPES), rng.choice(list(BACKGROUNDS))
    size = rng.randrange(16, 25, 2)
    centre = (PIXELS // 2 + rng.randint(-4, 4), PIXELS // 2 + rng.randint(-4, 4))
    image = draw(colour, shape, background, style, size=size, centre=centre)
    roll = rng.random()
    text = caption(colour, shape, background) if roll < 0.7 else caption(colour, shape, None) if roll < 0.9 else ""
    return image, text


def _pixels(images: list[Any]) -> Any:
    """PIL images -> a float tensor (N, 3, H, W) in [-1, 1]."""
    import numpy as np
    import torch

    array = np.stack([np.asarray(image, dtype=np.float32) for image in images]) / 127.5 - 1.0
    return torch.from_numpy(array).permute(0, 3, 1, 2).contiguous()


def build_tokenizer(scratch: Path, words: tuple[str, ...] = _WORDS) -> Any:
    """A ``CLIPTokenizer`` (``model_max_length`` 77): the 514 byte-level tokens of
    ``app/devtools/tiny_models.py`` plus merges that make each data-set word one token.

    Raises:
        RuntimeError: a data-set word does not come out as one token (the merges conflict).
    """
    from transformers import CLIPTokenizer

    from app.devtools.tiny_models import _byte_level_vocab

    vocab = _byte_level_vocab()
    merges: list[tuple[str, str]] = []
    for word in sorted(set(words) - {"a"}, key=lambda w: (-len(w), w)):  # longer words' merges first
        pieces = [*word[:-1], word[-1] + "</w>"]
        left = pieces[0]
        for right in pieces[1:]:
            if (left, right) not in merges:
                merges.append((left, right))
            left += right
            vocab.setdefault(left, len(vocab))
    scratch.mkdir(parents=True, exist_ok=True)
    (scratch / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    (scratch / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges), encoding="utf-8")
    tokenizer = CLIPTokenizer(str(scratch / "vocab.json"), str(scratch / "merges.txt"), model_max_length=_MAX_TOKENS)
    for word in words:
        ids = tokenizer(word, add_special_tokens=False).input_ids
        if len(ids) != 1:
            raise RuntimeError(f"the word {word!r} tokenizes to {len(ids)} tokens, not 1: {ids}")
    return tokenizer


def _vae() -> Any:
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        latent_channels=4,
        block_out_channels=(16, 32, 32),
        down_block_types=("DownEncoderBlock2D",) * 3,
        up_block_types=("UpDecoderBlock2D",) * 3,
        layers_per_block=1,
        norm_num_groups=8,
        sample_size=PIXELS,
        scaling_factor=1.0,
        mid_block_add_attention=False,
    )


def _text_encoder(tokenizer: Any) -> Any:
    from transformers import CLIPTextConfig, CLIPTextModel

    return CLIPTextModel(
        CLIPTextConfig(
            vocab_size=len(tokenizer),
            hidden_size=_TEXT_HIDDEN,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=_MAX_TOKENS,
            projection_dim=_TEXT_HIDDEN,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    )


def _unet(in_channels: int = 4) -> Any:
    from diffusers import UNet2DConditionModel

    return UNet2DConditionModel(
        sample_size=_LATENT,
        in_channels=in_channels,
        out_channels=4,
        block_out_channels=(32, 64),
        layers_per_block=1,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        attention_head_dim=8,
        norm_num_groups=8,
        cross_attention_dim=_TEXT_HIDDEN,
        # the prompt's pooled states join the timestep embedding of every block (colour, shape and
        # background are global); cross attention reads the words at the 4 x 4 level
        addition_embed_type="text",
        addition_embed_type_num_heads=4,
    )


def _scheduler() -> Any:
    from diffusers import DDIMScheduler

    return DDIMScheduler(
        num_train_timesteps=_TRAIN_TIMESTEPS,
        clip_sample=False,
        set_alpha_to_one=False,
        timestep_spacing="trailing",
        steps_offset=1,
        **_SCHEDULE,
    )


def _ema_update(ema: list[Any], params: list[Any], decay: float) -> None:
    import torch

    with torch.no_grad():
        torch._foreach_lerp_(ema, params, 1.0 - decay)


def _steps(total: int, log: Callable[[str], None], what: str) -> Iterator[int]:
    start = time.monotonic()
    for step in range(total):
        yield step
        if (step + 1) % max(1, total // 10) == 0:
            log(f"{what}: step {step + 1}/{total}, {time.monotonic() - start:.0f} s")


def _train_vae(rng: random.Random, steps: int, batch: int, log: Callable[[str], None]) -> tuple[Any, float]:
    import torch

    vae = _vae().train()
    optimiser = torch.optim.AdamW(vae.parameters(), lr=2e-3, weight_decay=0.0)
    losses = []
    for step in _steps(steps, log, "vae"):
        images = _pixels([_sample(rng, STYLES[i % 2])[0] for i in range(batch)])
        posterior = vae.encode(images).latent_dist
        decoded = vae.decode(posterior.mean).sample  # the UNet learns the means: decode those
        error = decoded - images
        loss = error.abs().mean() + error.pow(2).mean() + 1e-6 * posterior.kl().mean()
        optimiser.zero_grad(set_to_none=True)
        loss.backward()
        optimiser.step()
        for group in optimiser.param_groups:  # cosine decay to 1e-5
            group["lr"] = 1e-5 + (2e-3 - 1e-5) * 0.5 * (1 + math.cos(math.pi * step / steps))
        losses.append(loss.item())
    vae.eval()
    with torch.no_grad():  # scaling_factor: latents of unit variance, as the UNet expects
        images = _pixels([_sample(rng, STYLES[i % 2])[0] for i in range(256)])
        std = float(vae.encode(images).latent_dist.mean.std())
    vae.register_to_config(scaling_factor=round(1.0 / std, 5))
    return vae, sum(losses[-100:]) / len(losses[-100:])


def _train_style(
    style: str,
    vae: Any,
    tokenizer: Any,
    rng: random.Random,
    steps: int,
    batch: int,
    dataset: int,
    log: Callable[[str], None],
) -> tuple[Any, Any, float]:
    import copy

    import torch
    from diffusers import DDPMScheduler

    pairs = [_sample(rng, style) for _ in range(dataset)]
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
        [p[1] for p in pairs], padding="max_length", max_length=_MAX_TOKENS, truncation=True, return_tensors="pt"
    ).input_ids
    text_encoder, unet = _text_encoder(tokenizer).train(), _unet().train()
    noise_scheduler = DDPMScheduler(num_train_timesteps=_TRAIN_TIMESTEPS, **_SCHEDULE)
    params = [*unet.parameters(), *text_encoder.parameters()]
    ema_unet, ema_text = copy.deepcopy(unet).eval(), copy.deepcopy(text_encoder).eval()
    ema_params = [*ema_unet.parameters(), *ema_text.parameters()]
    optimiser = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.0)
    generator = torch.Generator().manual_seed(rng.randrange(2**31))
    losses = []
    for step in _steps(steps, log, style):
        index = torch.randint(0, dataset, (batch,), generator=generator)
        clean = latents[index]
        noise = torch.randn(clean.shape, generator=generator)
        timesteps = torch.randint(0, _TRAIN_TIMESTEPS, (batch,), generator=generator)
        noisy = noise_scheduler.add_noise(clean, noise, timesteps)
        target = noise_scheduler.get_velocity(clean, noise, timesteps)
        states = text_encoder(ids[index]).last_hidden_state
        loss = torch.nn.functional.mse_loss(unet(noisy, timesteps, encoder_hidden_states=states).sample, target)
        optimiser.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimiser.step()
        _ema_update(ema_params, params, min(0.999, (1 + step) / (10 + step)))
        losses.append(loss.item())
    return ema_text, ema_unet, sum(losses[-100:]) / len(losses[-100:])


def _save(folder: Path, vae: Any, text_encoder: Any, tokenizer: Any, unet: Any) -> int:
    """Save a float16 ``StableDiffusionPipeline`` folder; its size, bytes."""
    import shutil

    import torch
    from diffusers import StableDiffusionPipeline

    pipeline = StableDiffusionPipeline(
        vae=_copy_of(vae),
        text_encoder=_copy_of(text_encoder),
        tokenizer=tokenizer,
        unet=_copy_of(unet),
        scheduler=_scheduler(),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    ).to(torch.float16)
    if folder.exists():
        shutil.rmtree(folder)
    pipeline.save_pretrained(str(folder), safe_serialization=True)
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())


def _copy_of(module: Any) -> Any:
    import copy

    return copy.deepcopy(module).eval()


def _style_process(
    style: str,
    out_dir: Path,
    vae_config: dict[str, Any],
    vae_state: dict[str, Any],
    seed: int,
    threads: int,
    steps: int,
    batch: int,
    dataset: int,
) -> dict[str, float]:
    """Train and save one style in this (spawned) process; its figures."""
    import tempfile

    import torch
    from diffusers import AutoencoderKL

    from app.core.quiet import quiet_libraries

    torch.set_num_threads(threads)
    torch.manual_seed(seed + 1 + STYLES.index(style))
    rng = random.Random(seed + 1 + STYLES.index(style))
    with quiet_libraries():
        vae = AutoencoderKL.from_config(vae_config)
        vae.load_state_dict(vae_state)
        vae.eval()
        with tempfile.TemporaryDirectory() as scratch:
            tokenizer = build_tokenizer(Path(scratch))
        began = time.monotonic()
        text_encoder, unet, loss = _train_style(
            style, vae, tokenizer, rng, steps, batch, dataset, lambda line: print(line, flush=True)
        )
        seconds = time.monotonic() - began
        size = _save(out_dir / MODEL_NAMES[style], vae, text_encoder, tokenizer, unet)
    print(f"{style}: {steps} steps in {seconds:.0f} s, loss {loss:.4f}, {size / 1e6:.2f} MB", flush=True)
    return {"train_s": round(seconds, 1), "loss": round(loss, 5), "size_bytes": size}


def train_shapes(
    out_dir: Path,
    *,
    seed: int = 19,
    threads: int = 1,
    vae_steps: int = 1500,
    unet_steps: int = 1500,
    vae_batch: int = 16,
    batch: int = 32,
    dataset: int = 6000,
    styles: tuple[str, ...] = STYLES,
    log: Callable[[str], None] = print,
) -> TrainingReport:
    """Train the VAE, then one text encoder + UNet per style; save ``out_dir/shapes-<style>/``
    (diffusers folders) and ``out_dir/training.json`` (the :class:`TrainingReport`).

    The styles train at the same time, one spawned process each with ``threads`` torch threads
    (so two styles at ``threads=1`` use two cores). ``seed`` fixes everything (data, initial
    weights, noise; each style has its own stream, so the order the processes run in does not
    matter); steps and ``batch`` (images per step) set the cost: on this shared 2-core machine
    about 0.37 s per VAE step and 0.45 s per UNet step.
    """
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    import torch

    from app.core.quiet import quiet_libraries

    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    rng = random.Random(seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    with quiet_libraries():
        vae, vae_loss = _train_vae(rng, vae_steps, vae_batch, log)
    vae_s = time.monotonic() - start
    log(f"vae: {vae_steps} steps in {vae_s:.0f} s, loss {vae_loss:.4f}, scaling_factor {vae.config.scaling_factor}")
    config, state = dict(vae.config), {k: v.detach().clone() for k, v in vae.state_dict().items()}
    with ProcessPoolExecutor(len(styles), mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {
            style: pool.submit(_style_process, style, out_dir, config, state, seed, threads, unet_steps, batch, dataset)
            for style in styles
        }
        results = {style: future.result() for style, future in futures.items()}
    report = TrainingReport(
        seed,
        threads,
        vae_steps,
        round(vae_s, 1),
        round(vae_loss, 5),
        unet_steps,
        results,
        round(time.monotonic() - start, 1),
    )
    (out_dir / "training.json").write_text(json.dumps(asdict(report), indent=2) + "\n")
    return report
