"""Tiny diffusers pipelines with random weights, built locally (no model hub).

The recipe (component classes, tiny sizes, the byte-level CLIP tokenizer, the
upscaler's VAE ``scaling_factor=0.08333`` and class embeddings) comes from
``shared/notes/diffusers-offline.md``; the numbers below were re-checked on
torch 2.13.0+cpu, diffusers 0.42.1, transformers 5.x.

Each pipeline is saved with ``save_pretrained(folder, safe_serialization=True)``
and loads back with the real loading code::

    DiffusionPipeline.from_pretrained(folder, local_files_only=True)

Only the weights are tiny and random: outputs are noise, but shapes, schedulers,
callbacks and file layouts are those of the real pipelines.

Kinds, folder names and sizes (images are RGB; ``H`` and ``W`` must be
multiples of 8):

========  =================  ==========================================  ================================
kind      folder             pipeline                                    pixels
========  =================  ==========================================  ================================
txt2img   tiny-sd            StableDiffusionPipeline                     default 64x64 (latents 4 x H/2 x W/2)
edit      tiny-pix2pix       StableDiffusionInstructPix2PixPipeline      output = input size, e.g. 64x64
upscale   tiny-upscaler      StableDiffusionUpscalePipeline (x4)         16x16 in -> 64x64 out
video     tiny-animatediff   AnimateDiffPipeline (+ MotionAdapter)       default 64x64, e.g. 4 frames
========  =================  ==========================================  ================================

This module imports only the standard library at import time; torch,
diffusers and transformers are imported inside the functions that need them.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tempfile
import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:  # pragma: no cover - typing only
    from diffusers import DiffusionPipeline

__all__ = ["TINY_MODELS", "make_tiny"]

#: Folder name (under ``out_dir``) -> kind. Lists only kinds verified to build,
#: save, reload offline and generate.
TINY_MODELS: dict[str, str] = {
    "tiny-sd": "txt2img",
    "tiny-pix2pix": "edit",
    "tiny-upscaler": "upscale",
    "tiny-animatediff": "video",
}

_FOLDER_BY_KIND: dict[str, str] = {kind: name for name, kind in TINY_MODELS.items()}

# Shared tiny sizes (from shared/notes/diffusers-offline.md).
_MAX_TOKENS: int = 77  # tokenizer model_max_length == text encoder max_position_embeddings
_TEXT_HIDDEN: int = 32  # CLIP hidden size == UNet cross_attention_dim
_UNET_CHANNELS: tuple[int, int] = (32, 64)
_VAE_CHANNELS: tuple[int, int] = (16, 32)  # 2 blocks -> vae_scale_factor 2
_UPSCALE_VAE_CHANNELS: tuple[int, int, int] = (16, 32, 32)  # 3 blocks -> vae_scale_factor 4 (x4)
_UPSCALE_MAX_NOISE_LEVEL: int = 350
_NORM_GROUPS: int = 8
_DEFAULT_PIXELS: int = 64


# --------------------------------------------------------------------------- helpers


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Lower diffusers/transformers verbosity, hide their progress bars and their
    deprecation/user warnings for the duration of a build; restore afterwards."""
    import diffusers.utils.logging as d_log
    import transformers.utils.logging as t_log

    d_level = d_log.get_verbosity()
    t_level = t_log.get_verbosity()
    d_bars = d_log.is_progress_bar_enabled()
    t_bars = t_log.is_progress_bar_enabled()
    d_log.set_verbosity(logging.ERROR)
    t_log.set_verbosity(logging.ERROR)
    d_log.disable_progress_bar()
    t_log.disable_progress_bar()
    try:
        with warnings.catch_warnings():
            for category in (FutureWarning, DeprecationWarning, UserWarning):
                warnings.filterwarnings(
                    "ignore", category=category, module=r"(diffusers|transformers|huggingface_hub)(\.|$)"
                )
            yield
    finally:
        d_log.set_verbosity(d_level)
        t_log.set_verbosity(t_level)
        if d_bars:
            d_log.enable_progress_bar()
        if t_bars:
            t_log.enable_progress_bar()


def _byte_level_vocab() -> dict[str, int]:
    """GPT-2/CLIP byte-level vocabulary: the 256 byte characters, the same 256
    with ``</w>`` (end of word), then ``<|startoftext|>`` (512) and
    ``<|endoftext|>`` (513). 514 entries; with no merges every byte is a token."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("\xa1"), ord("\xac") + 1))
        + list(range(ord("\xae"), ord("\xff") + 1))
    )
    codes = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            codes.append(256 + extra)
            extra += 1
    chars = [chr(code) for code in codes]
    vocab: dict[str, int] = {}
    for char in chars:
        vocab[char] = len(vocab)
    for char in chars:
        vocab[char + "</w>"] = len(vocab)
    vocab["<|startoftext|>"] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    return vocab


def _write_vocab_files(directory: Path) -> tuple[Path, Path]:
    """Write ``vocab.json`` and ``merges.txt`` (only ``#version: 0.2``) into
    ``directory``; returns their paths."""
    directory.mkdir(parents=True, exist_ok=True)
    vocab_path = directory / "vocab.json"
    merges_path = directory / "merges.txt"
    vocab_path.write_text(json.dumps(_byte_level_vocab(), ensure_ascii=False), encoding="utf-8")
    merges_path.write_text("#version: 0.2\n", encoding="utf-8")
    return vocab_path, merges_path


def _tokenizer(scratch: Path) -> Any:
    """Byte-level ``CLIPTokenizer`` (514 tokens, ``model_max_length=77``; pads
    with ``<|endoftext|>``)."""
    from transformers import CLIPTokenizer

    vocab_path, merges_path = _write_vocab_files(scratch / "tokenizer-src")
    return CLIPTokenizer(str(vocab_path), str(merges_path), model_max_length=_MAX_TOKENS)


def _text_encoder(tokenizer: Any) -> Any:
    """``CLIPTextModel``: hidden 32, 2 layers, 4 heads, 77 positions; output
    ``last_hidden_state`` is ``(batch, 77, 32)``. Its bos/eos/pad ids equal the
    tokenizer's (eos pooling depends on it)."""
    from transformers import CLIPTextConfig, CLIPTextModel

    config = CLIPTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=_TEXT_HIDDEN,
        intermediate_size=37,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=_MAX_TOKENS,
        projection_dim=_TEXT_HIDDEN,
        layer_norm_eps=1e-5,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return CLIPTextModel(config).eval()


def _vae(block_out_channels: tuple[int, ...] = _VAE_CHANNELS, scaling_factor: float = 0.18215) -> Any:
    """``AutoencoderKL`` with 4 latent channels; spatial factor is
    ``2 ** (len(block_out_channels) - 1)`` (2 for the default, 4 for the upscaler)."""
    from diffusers import AutoencoderKL

    blocks = len(block_out_channels)
    return AutoencoderKL(
        block_out_channels=block_out_channels,
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * blocks,
        up_block_types=("UpDecoderBlock2D",) * blocks,
        latent_channels=4,
        norm_num_groups=_NORM_GROUPS,
        sample_size=_DEFAULT_PIXELS,
        scaling_factor=scaling_factor,
    ).eval()


def _unet(in_channels: int = 4, sample_size: int = _DEFAULT_PIXELS // 2, **extra: Any) -> Any:
    """``UNet2DConditionModel``: channels (32, 64), 1 layer per block, cross
    attention dim 32; ``sample_size`` is in latent pixels."""
    from diffusers import UNet2DConditionModel

    return UNet2DConditionModel(
        sample_size=sample_size,
        in_channels=in_channels,
        out_channels=4,
        block_out_channels=_UNET_CHANNELS,
        layers_per_block=1,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=_TEXT_HIDDEN,
        attention_head_dim=8,
        norm_num_groups=_NORM_GROUPS,
        **extra,
    ).eval()


def _ddim(**extra: Any) -> Any:
    """SD-1.5-like DDIM scheduler (exactly ``num_inference_steps`` steps)."""
    from diffusers import DDIMScheduler

    settings: dict[str, Any] = {
        "beta_start": 0.00085,
        "beta_end": 0.012,
        "beta_schedule": "scaled_linear",
        "clip_sample": False,
        "set_alpha_to_one": False,
        "steps_offset": 1,
    }
    settings.update(extra)
    return DDIMScheduler(**settings)


# --------------------------------------------------------------------------- builders


def _build_txt2img(scratch: Path) -> DiffusionPipeline:
    """StableDiffusionPipeline; 64x64 by default (UNet sample 32, VAE factor 2)."""
    from diffusers import StableDiffusionPipeline

    tokenizer = _tokenizer(scratch)
    return StableDiffusionPipeline(
        vae=_vae(),
        text_encoder=_text_encoder(tokenizer),
        tokenizer=tokenizer,
        unet=_unet(),
        scheduler=_ddim(),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )


def _build_edit(scratch: Path) -> DiffusionPipeline:
    """StableDiffusionInstructPix2PixPipeline; UNet in_channels 8 (4 noisy + 4
    image latents); output size equals the input image size."""
    from diffusers import EulerAncestralDiscreteScheduler, StableDiffusionInstructPix2PixPipeline

    tokenizer = _tokenizer(scratch)
    return StableDiffusionInstructPix2PixPipeline(
        vae=_vae(),
        text_encoder=_text_encoder(tokenizer),
        tokenizer=tokenizer,
        unet=_unet(in_channels=8),
        scheduler=EulerAncestralDiscreteScheduler(
            beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear"
        ),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )


def _build_upscale(scratch: Path) -> DiffusionPipeline:
    """StableDiffusionUpscalePipeline, x4: UNet in_channels 7 (4 latents + 3
    low-res RGB), ``num_class_embeds = max_noise_level + 1 = 351`` (noise level
    is the class label); 3-block VAE (factor 4) with ``scaling_factor=0.08333``;
    DDPM low-res scheduler; DDIM v-prediction scheduler. 16x16 in -> 64x64 out."""
    from diffusers import DDPMScheduler, StableDiffusionUpscalePipeline

    tokenizer = _tokenizer(scratch)
    return StableDiffusionUpscalePipeline(
        vae=_vae(_UPSCALE_VAE_CHANNELS, scaling_factor=0.08333),
        text_encoder=_text_encoder(tokenizer),
        tokenizer=tokenizer,
        unet=_unet(in_channels=7, sample_size=_DEFAULT_PIXELS // 4, num_class_embeds=_UPSCALE_MAX_NOISE_LEVEL + 1),
        low_res_scheduler=DDPMScheduler(beta_schedule="scaled_linear", beta_start=0.0001, beta_end=0.02),
        scheduler=_ddim(prediction_type="v_prediction"),
        safety_checker=None,
        feature_extractor=None,
        watermarker=None,
        max_noise_level=_UPSCALE_MAX_NOISE_LEVEL,
    )


def _build_video(scratch: Path) -> DiffusionPipeline:
    """AnimateDiffPipeline: the 2D UNet plus a MotionAdapter (channels (32, 64),
    1 motion layer per block, 4 heads, up to 32 frames) become a UNetMotionModel;
    64x64 by default; output ``frames`` is ``(batch, num_frames)`` images."""
    from diffusers import AnimateDiffPipeline, MotionAdapter

    tokenizer = _tokenizer(scratch)
    vae = _vae()
    text_encoder = _text_encoder(tokenizer)
    unet = _unet()
    adapter = MotionAdapter(
        block_out_channels=_UNET_CHANNELS,
        motion_layers_per_block=1,
        motion_norm_num_groups=_NORM_GROUPS,
        motion_num_attention_heads=4,
        motion_max_seq_length=32,
    ).eval()
    return AnimateDiffPipeline(
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        unet=unet,
        motion_adapter=adapter,
        scheduler=_ddim(beta_schedule="linear", clip_sample=False),
        feature_extractor=None,
        image_encoder=None,
    )


_BUILDERS: dict[str, Callable[[Path], DiffusionPipeline]] = {
    "txt2img": _build_txt2img,
    "edit": _build_edit,
    "upscale": _build_upscale,
    "video": _build_video,
}


def _is_complete(folder: Path) -> bool:
    """A folder is complete when its ``model_index.json`` exists (it is moved
    into place only after everything was written)."""
    return (folder / "model_index.json").is_file()


def _build_into(kind: str, folder: Path, seed: int, force: bool) -> Path:
    """Build ``kind`` in a temporary sibling folder, then move it to ``folder``."""
    import torch

    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", suffix=".tmp", dir=folder.parent))
    try:
        target = staging / "pipeline"
        # Fork the RNG so the caller's global torch RNG state is left untouched;
        # components are created in a fixed order, so the weights depend only on seed.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            pipe = _BUILDERS[kind](staging)
        pipe.save_pretrained(str(target), safe_serialization=True)
        # transformers 5 writes only tokenizer.json; add the classic files too.
        _write_vocab_files(target / "tokenizer")
        # Make the tree readable like a normal download (mkdtemp creates 0700).
        os.chmod(staging, 0o755)

        if folder.exists():
            if _is_complete(folder) and not force:
                return folder  # built concurrently by someone else: keep theirs
            os.replace(folder, staging / "old")
        try:
            os.replace(target, folder)
        except OSError:
            # Another process moved a build into place between the check above
            # and here (renaming onto a non-empty folder fails): keep theirs.
            if _is_complete(folder) and not force:
                return folder
            raise
        return folder
    finally:
        shutil.rmtree(staging)


# --------------------------------------------------------------------------- public API


def make_tiny(
    out_dir: Path,
    kinds: Iterable[str] = ("txt2img",),
    seed: int = 0,
    *,
    force: bool = False,
) -> dict[str, Path]:
    """Build tiny diffusers pipelines with random weights into ``out_dir/<name>/``.

    Recipe source: ``shared/notes/diffusers-offline.md``.

    Args:
        out_dir: parent folder; each kind goes to ``out_dir / <name>`` with
            ``<name>`` from :data:`TINY_MODELS` (e.g. ``tiny-sd``).
        kinds: any of ``"txt2img"``, ``"edit"``, ``"upscale"``, ``"video"``.
        seed: weights are drawn from ``torch.manual_seed(seed)`` inside a forked
            RNG (caller's RNG state is unchanged); two builds with the same seed
            give byte-identical ``*.safetensors`` files.
        force: rebuild even if a complete folder (one with ``model_index.json``)
            already exists. Without it existing complete folders are returned as is.

    Returns:
        ``{kind: folder}`` for the requested kinds.

    Sizes: each folder is ~4-8 MB (safetensors, float32). Pixels: txt2img and
    video default to 64x64 (latents ``(4, H/2, W/2)``, H and W multiples of 8);
    edit keeps the input image size; upscale turns ``HxW`` into ``4Hx4W``
    (16x16 -> 64x64). Loading each back:
    ``DiffusionPipeline.from_pretrained(folder, local_files_only=True)``.

    Raises:
        ValueError: for an unknown kind.
    """
    wanted = list(dict.fromkeys(kinds))
    unknown = [kind for kind in wanted if kind not in _BUILDERS]
    if unknown:
        raise ValueError(f"unknown tiny model kind(s) {unknown}; known: {sorted(_BUILDERS)}")

    out_dir = Path(out_dir)
    result: dict[str, Path] = {}
    todo: list[str] = []
    for kind in wanted:
        folder = out_dir / _FOLDER_BY_KIND[kind]
        if _is_complete(folder) and not force:
            result[kind] = folder
        else:
            todo.append(kind)
    if todo:
        with _quiet():
            for kind in todo:
                result[kind] = _build_into(kind, out_dir / _FOLDER_BY_KIND[kind], seed, force)
    return {kind: result[kind] for kind in wanted}
