"""Tiny diffusers pipelines with random weights, built locally (no model hub).

The recipe (component classes, tiny sizes, the byte-level CLIP tokenizer, the
upscaler's VAE ``scaling_factor=0.08333`` and class embeddings) comes from
``docs/operations.md``; the numbers below were re-checked on
torch 2.13.0+cpu, diffusers 0.42.1, transformers 5.x.

Each pipeline is saved with ``save_pretrained(folder, safe_serialization=True)``
and loads back with the real loading code::

    DiffusionPipeline.from_pretrained(folder, local_files_only=True)

Only the weights are tiny and random: outputs are noise, but shapes, schedulers,
callbacks and file layouts are those of the real pipelines.

Families (``app/core/families.py``), folder names and sizes (images are RGB; ``H`` and ``W``
multiples of 8, of 16 for flux, flux-kontext, qwen-image and wan):

===========  ===================  =======================================  ================================
family       folder               pipeline                                 pixels
===========  ===================  =======================================  ================================
sd1          tiny-sd              StableDiffusionPipeline                  default 64x64 (latents 4 x H/2 x W/2)
sdxl         tiny-sdxl            StableDiffusionXLPipeline                default 64x64, two CLIP encoders
flux         tiny-flux            FluxPipeline                             64x64, CLIP + T5 encoders
sd1-pix2pix  tiny-pix2pix         StableDiffusionInstructPix2PixPipeline   output = input size, e.g. 64x64
qwen-image   tiny-qwen-image-edit QwenImageEditPipeline                    output = input size, e.g. 64x64
flux-kontext tiny-flux-kontext    FluxKontextPipeline                      output = input size, e.g. 64x64
sd-upscale   tiny-upscaler        StableDiffusionUpscalePipeline (x4)      16x16 in -> 64x64 out
animatediff  tiny-animatediff     AnimateDiffPipeline (+ MotionAdapter)    default 64x64, e.g. 4 frames
wan          tiny-wan             WanPipeline                              e.g. 32x32 x 5 frames (4k+1)
===========  ===================  =======================================  ================================

The older kind names still build the SD-1-based four: txt2img (sd1), edit (sd1-pix2pix),
upscale (sd-upscale), video (animatediff).

This module imports only the standard library at import time; torch,
diffusers and transformers are imported inside the functions that need them.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from app.core.quiet import quiet_libraries

if TYPE_CHECKING:  # pragma: no cover - typing only
    from diffusers import DiffusionPipeline

__all__ = ["KIND_FAMILIES", "LORA_TARGETS", "TINY_MODELS", "make_tiny", "make_tiny_families", "make_tiny_lora"]

#: Folder name (under ``out_dir``) -> family. Lists only families verified to build,
#: save, reload offline and generate.
TINY_MODELS: dict[str, str] = {
    "tiny-sd": "sd1",
    "tiny-sdxl": "sdxl",
    "tiny-flux": "flux",
    "tiny-pix2pix": "sd1-pix2pix",
    "tiny-qwen-image-edit": "qwen-image",
    "tiny-flux-kontext": "flux-kontext",
    "tiny-upscaler": "sd-upscale",
    "tiny-animatediff": "animatediff",
    "tiny-wan": "wan",
}

#: The older kind names -> the family each builds (``make_tiny(kinds=...)``).
KIND_FAMILIES: dict[str, str] = {
    "txt2img": "sd1",
    "edit": "sd1-pix2pix",
    "upscale": "sd-upscale",
    "video": "animatediff",
}

_FOLDER_BY_FAMILY: dict[str, str] = {family: name for name, family in TINY_MODELS.items()}

# Shared tiny sizes (from docs/operations.md).
_MAX_TOKENS: int = 77  # tokenizer model_max_length == text encoder max_position_embeddings
_TEXT_HIDDEN: int = 32  # CLIP hidden size == UNet cross_attention_dim
_UNET_CHANNELS: tuple[int, int] = (32, 64)
_VAE_CHANNELS: tuple[int, int] = (16, 32)  # 2 blocks -> vae_scale_factor 2
_UPSCALE_VAE_CHANNELS: tuple[int, int, int] = (16, 32, 32)  # 3 blocks -> vae_scale_factor 4 (x4)
_UPSCALE_MAX_NOISE_LEVEL: int = 350
_NORM_GROUPS: int = 8
_DEFAULT_PIXELS: int = 64


# --------------------------------------------------------------------------- helpers


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
    attention dim 32; ``sample_size`` is in latent pixels. Attention only below the full latent
    resolution, as SDXL's UNet has it: self-attention over a 32x32 latent (1,024 tokens) was 75 %
    of a step's CPU, 0.14 CPU-s a step at 64x64 against 0.035 without it (one torch thread)."""
    from diffusers import UNet2DConditionModel

    return UNet2DConditionModel(
        sample_size=sample_size,
        in_channels=in_channels,
        out_channels=4,
        block_out_channels=_UNET_CHANNELS,
        layers_per_block=1,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        attention_head_dim=8,
        norm_num_groups=_NORM_GROUPS,
        **{"cross_attention_dim": _TEXT_HIDDEN, **extra},
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
    from diffusers import (
        EulerAncestralDiscreteScheduler,
        StableDiffusionInstructPix2PixPipeline,
    )

    tokenizer = _tokenizer(scratch)
    return StableDiffusionInstructPix2PixPipeline(
        vae=_vae(),
        text_encoder=_text_encoder(tokenizer),
        tokenizer=tokenizer,
        unet=_unet(in_channels=8),
        scheduler=EulerAncestralDiscreteScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear"),
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


# --------------------------------------------------------------------------- the larger families
# Shapes after diffusers' own fast tests (tests/pipelines/<family>/test_*.py, get_dummy_components),
# with every text encoder and tokenizer built here instead of fetched from the hub.

_T5_HIDDEN: int = 32  # T5/UMT5 d_model == Flux joint_attention_dim == Wan text_dim
_QWEN_HIDDEN: int = 16  # Qwen2.5-VL hidden size == QwenImage joint_attention_dim
_QWEN_SPECIALS: tuple[str, ...] = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)


def _byte_chars() -> list[str]:
    """The 256 byte-level characters (GPT-2 order): the first 256 entries of the CLIP vocab."""
    return list(_byte_level_vocab())[:256]


def _t5_tokenizer() -> Any:
    """``T5Tokenizer`` (Unigram) over single characters: ``<pad>`` 0, ``</s>`` 1, ``<unk>`` 2,
    the word marker and printable ASCII, no extra ids; appends ``</s>``."""
    from transformers import T5Tokenizer

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -1.0)]
    pieces += [(chr(code), -2.0) for code in range(33, 127)]
    return T5Tokenizer(vocab=pieces, extra_ids=0, model_max_length=512)


def _t5_encoder(tokenizer: Any, umt5: bool = False) -> Any:
    """``T5EncoderModel`` (or ``UMT5EncoderModel`` for Wan): d_model 32, 2 layers, 4 heads."""
    from transformers import T5Config, T5EncoderModel, UMT5Config, UMT5EncoderModel

    settings = {
        "vocab_size": len(tokenizer),
        "d_model": _T5_HIDDEN,
        "d_kv": 8,
        "d_ff": 37,
        "num_layers": 2,
        "num_heads": 4,
        "relative_attention_num_buckets": 8,
        "pad_token_id": tokenizer.pad_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "decoder_start_token_id": tokenizer.pad_token_id,
    }
    if umt5:
        return UMT5EncoderModel(UMT5Config(**settings)).eval()
    return T5EncoderModel(T5Config(**settings)).eval()


def _text_encoder_with_projection(tokenizer: Any) -> Any:
    """``CLIPTextModelWithProjection`` (SDXL's second encoder): hidden 32, projection 32."""
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    config = CLIPTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=_TEXT_HIDDEN,
        intermediate_size=37,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=_MAX_TOKENS,
        projection_dim=_TEXT_HIDDEN,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return CLIPTextModelWithProjection(config).eval()


def _build_sdxl(scratch: Path) -> DiffusionPipeline:
    """StableDiffusionXLPipeline: two CLIP encoders (hidden 32 each, so cross attention 64), a
    ``text_time`` UNet (pooled 32 + 6 size ids x 8 = 80 added-embedding inputs); 64x64 default."""
    from diffusers import EulerDiscreteScheduler, StableDiffusionXLPipeline

    tokenizer = _tokenizer(scratch)
    return StableDiffusionXLPipeline(
        vae=_vae(),
        text_encoder=_text_encoder(tokenizer),
        text_encoder_2=_text_encoder_with_projection(tokenizer),
        tokenizer=tokenizer,
        tokenizer_2=_tokenizer(scratch),
        unet=_unet(
            cross_attention_dim=2 * _TEXT_HIDDEN,
            addition_embed_type="text_time",
            addition_time_embed_dim=8,
            projection_class_embeddings_input_dim=_TEXT_HIDDEN + 6 * 8,
        ),
        scheduler=EulerDiscreteScheduler(
            beta_start=0.00085,
            beta_end=0.012,
            beta_schedule="scaled_linear",
            steps_offset=1,
            timestep_spacing="leading",
        ),
        force_zeros_for_empty_prompt=True,
    )


def _build_flux(scratch: Path, kontext: bool = False) -> DiffusionPipeline:
    """FluxPipeline (or, with ``kontext``, FluxKontextPipeline, the same components): CLIP
    (pooled 32) + T5 (32) encoders, a 1+1-layer FluxTransformer2DModel with distilled-guidance
    embeddings (like FLUX.1-dev), a 2-block VAE with 4 latent channels (packed 2x2: 16
    transformer channels), flow-matching Euler scheduler; 64x64 default."""
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        FluxKontextPipeline,
        FluxPipeline,
        FluxTransformer2DModel,
    )

    tokenizer = _tokenizer(scratch)
    tokenizer_2 = _t5_tokenizer()
    return (FluxKontextPipeline if kontext else FluxPipeline)(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=AutoencoderKL(
            block_out_channels=_VAE_CHANNELS,
            in_channels=3,
            out_channels=3,
            down_block_types=("DownEncoderBlock2D",) * 2,
            up_block_types=("UpDecoderBlock2D",) * 2,
            latent_channels=4,
            norm_num_groups=_NORM_GROUPS,
            sample_size=_DEFAULT_PIXELS,
            use_quant_conv=False,
            use_post_quant_conv=False,
            shift_factor=0.0609,
            scaling_factor=1.5035,
        ).eval(),
        text_encoder=_text_encoder(tokenizer),
        tokenizer=tokenizer,
        text_encoder_2=_t5_encoder(tokenizer_2),
        tokenizer_2=tokenizer_2,
        transformer=FluxTransformer2DModel(
            patch_size=1,
            in_channels=16,
            num_layers=1,
            num_single_layers=1,
            attention_head_dim=16,
            num_attention_heads=2,
            joint_attention_dim=_T5_HIDDEN,
            pooled_projection_dim=_TEXT_HIDDEN,
            guidance_embeds=True,
            axes_dims_rope=(4, 4, 8),
        ).eval(),
        image_encoder=None,
        feature_extractor=None,
    )


def _build_wan(scratch: Path) -> DiffusionPipeline:
    """WanPipeline (Wan 2.1 text-to-video): UMT5 encoder (32), a 2-layer WanTransformer3DModel
    (patch 1x2x2), the Wan VAE (spatial factor 8, temporal factor 4: frames are 4k+1); sides
    multiples of 16, e.g. 32x32 x 5 frames."""
    from diffusers import (
        AutoencoderKLWan,
        FlowMatchEulerDiscreteScheduler,
        WanPipeline,
        WanTransformer3DModel,
    )

    tokenizer = _t5_tokenizer()
    return WanPipeline(
        tokenizer=tokenizer,
        text_encoder=_t5_encoder(tokenizer, umt5=True),
        vae=AutoencoderKLWan(
            base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True]
        ).eval(),
        transformer=WanTransformer3DModel(
            patch_size=(1, 2, 2),
            num_attention_heads=2,
            attention_head_dim=12,
            in_channels=16,
            out_channels=16,
            text_dim=_T5_HIDDEN,
            freq_dim=256,
            ffn_dim=32,
            num_layers=2,
            cross_attn_norm=True,
            qk_norm="rms_norm_across_heads",
            rope_max_seq_len=32,
        ).eval(),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0),
    )


def _qwen_tokenizer() -> Any:
    """``Qwen2Tokenizer``: byte-level BPE over the 256 byte characters (no merges) plus the chat
    and vision special tokens the Qwen-Image-Edit prompt template uses."""
    from transformers import AddedToken, Qwen2Tokenizer

    vocab = {char: index for index, char in enumerate(_byte_chars())}
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=[], model_max_length=4096)
    tokenizer.add_special_tokens(
        {"additional_special_tokens": [AddedToken(t, special=True) for t in _QWEN_SPECIALS[1:]]}
    )
    tokenizer.add_tokens([AddedToken(_QWEN_SPECIALS[0], special=True)], special_tokens=True)
    return tokenizer


def _build_qwen_image_edit(scratch: Path) -> DiffusionPipeline:
    """QwenImageEditPipeline: a 2-layer Qwen2.5-VL text+vision encoder (hidden 16) with its
    processor (image patches capped at 56x56 pixels), a 2-layer QwenImageTransformer2DModel
    without guidance embeddings (true CFG instead), the Qwen-Image VAE (spatial factor 8: sides
    multiples of 16). The pipeline encodes the input at ~1024x1024 area whatever its size."""
    from diffusers import (
        AutoencoderKLQwenImage,
        FlowMatchEulerDiscreteScheduler,
        QwenImageEditPipeline,
        QwenImageTransformer2DModel,
    )
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    from app.core.processors import image_only_processor_class

    tokenizer = _qwen_tokenizer()
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in _QWEN_SPECIALS}
    config = Qwen2_5_VLConfig(
        text_config={
            "hidden_size": _QWEN_HIDDEN,
            "intermediate_size": 16,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 2,
            "vocab_size": len(tokenizer),
            "rope_scaling": {"mrope_section": [1, 1, 2], "rope_type": "default", "type": "default"},
            "rope_theta": 1000000.0,
            "max_position_embeddings": 4096,
            "bos_token_id": ids["<|endoftext|>"],
            "eos_token_id": ids["<|im_end|>"],
            "pad_token_id": ids["<|endoftext|>"],
        },
        vision_config={
            "depth": 2,
            "hidden_size": 16,
            "intermediate_size": 16,
            "num_heads": 2,
            "out_hidden_size": _QWEN_HIDDEN,
        },
        # the model-wide ids: PretrainedConfig's **kwargs, which transformers 5's signature leaves out
        vocab_size=len(tokenizer),
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],  # type: ignore[call-arg]
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )
    image_processor = Qwen2VLImageProcessorPil(min_pixels=28 * 28, max_pixels=56 * 56)
    z_dim = 4
    return QwenImageEditPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=AutoencoderKLQwenImage(
            base_dim=z_dim,
            z_dim=z_dim,
            dim_mult=[1, 1, 1, 1],
            num_res_blocks=1,
            temperal_downsample=[False, True, True],
            latents_mean=[0.0] * z_dim,
            latents_std=[1.0] * z_dim,
        ).eval(),
        text_encoder=Qwen2_5_VLForConditionalGeneration(config).eval(),
        tokenizer=tokenizer,
        processor=image_only_processor_class()(image_processor=image_processor, tokenizer=tokenizer),
        transformer=QwenImageTransformer2DModel(
            patch_size=2,
            in_channels=4 * z_dim,
            out_channels=z_dim,
            num_layers=2,
            attention_head_dim=16,
            num_attention_heads=3,
            joint_attention_dim=_QWEN_HIDDEN,
            guidance_embeds=False,
            axes_dims_rope=(8, 4, 4),
        ).eval(),
    )


_BUILDERS: dict[str, Callable[[Path], DiffusionPipeline]] = {
    "sd1": _build_txt2img,
    "sdxl": _build_sdxl,
    "flux": _build_flux,
    "sd1-pix2pix": _build_edit,
    "qwen-image": _build_qwen_image_edit,
    "flux-kontext": lambda scratch: _build_flux(scratch, kontext=True),
    "sd-upscale": _build_upscale,
    "animatediff": _build_video,
    "wan": _build_wan,
}


def _as_saved(target: Path) -> None:
    """Make the saved folder what a real checkpoint holds: transformers 5 writes only
    ``tokenizer.json``, so the CLIP tokenizers get ``vocab.json``/``merges.txt`` too; a Qwen2-VL
    processor built without its video half (``app.core.processors``) is recorded as the
    ``Qwen2VLProcessor`` it is, so the folder names only diffusers and transformers classes."""
    from app.core.processors import QWEN_VL_PROCESSOR

    index_path = target / "model_index.json"
    index = json.loads(index_path.read_text())
    for name, entry in index.items():
        if isinstance(entry, list) and entry[1:] == ["CLIPTokenizer"]:
            _write_vocab_files(target / name)
    if "processor" in index and index["processor"][1] != QWEN_VL_PROCESSOR[1]:
        index["processor"] = list(QWEN_VL_PROCESSOR)
        index_path.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        config_path = target / "processor" / "processor_config.json"
        config = json.loads(config_path.read_text())
        config["processor_class"] = QWEN_VL_PROCESSOR[1]
        config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _is_complete(folder: Path) -> bool:
    """A folder is complete when its ``model_index.json`` exists (it is moved
    into place only after everything was written)."""
    return (folder / "model_index.json").is_file()


def _build_into(family: str, folder: Path, seed: int, force: bool) -> Path:
    """Build ``family`` in a temporary sibling folder, then move it to ``folder``."""
    import torch

    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", suffix=".tmp", dir=folder.parent))
    try:
        target = staging / "pipeline"
        # Fork the RNG so the caller's global torch RNG state is left untouched;
        # components are created in a fixed order, so the weights depend only on seed.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            pipe = _BUILDERS[family](staging)
        pipe.save_pretrained(str(target), safe_serialization=True)
        _as_saved(target)
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
    """Build the tiny pipelines of ``kinds`` (``txt2img``, ``edit``, ``upscale``, ``video``:
    the SD-1-based families of :data:`KIND_FAMILIES`); ``{kind: folder}``. See
    :func:`make_tiny_families`.

    Raises:
        ValueError: for an unknown kind.
    """
    wanted = list(dict.fromkeys(kinds))
    unknown = [kind for kind in wanted if kind not in KIND_FAMILIES]
    if unknown:
        raise ValueError(f"unknown tiny model kind(s) {unknown}; known: {sorted(KIND_FAMILIES)}")
    built = make_tiny_families(out_dir, [KIND_FAMILIES[kind] for kind in wanted], seed, force=force)
    return {kind: built[KIND_FAMILIES[kind]] for kind in wanted}


def make_tiny_families(
    out_dir: Path,
    families: Iterable[str] = ("sd1",),
    seed: int = 0,
    *,
    force: bool = False,
) -> dict[str, Path]:
    """Build tiny diffusers pipelines with random weights into ``out_dir/<name>/``, each of its
    family's very pipeline class with every component (text encoders and tokenizers included)
    built here, the way diffusers' own fast tests build dummy components.

    Args:
        out_dir: parent folder; each family goes to ``out_dir / <name>`` with
            ``<name>`` from :data:`TINY_MODELS` (e.g. ``tiny-flux``).
        families: any of :data:`TINY_MODELS`' families (``sd1``, ``sdxl``, ``flux``,
            ``sd1-pix2pix``, ``qwen-image``, ``flux-kontext``, ``sd-upscale``, ``animatediff``,
            ``wan``).
        seed: weights are drawn from ``torch.manual_seed(seed)`` inside a forked
            RNG (caller's RNG state is unchanged); two builds with the same seed
            give byte-identical ``*.safetensors`` files.
        force: rebuild even if a complete folder (one with ``model_index.json``)
            already exists. Without it existing complete folders are returned as is.

    Returns:
        ``{family: folder}`` for the requested families.

    Sizes: each folder is 1-8 MB (safetensors, float32); each builds in about a second.
    Loading each back: ``DiffusionPipeline.from_pretrained(folder, local_files_only=True)``
    (a Qwen-Image-Edit folder: see ``tasks/pipelines.py`` for its processor).

    Raises:
        ValueError: for an unknown family.
    """
    wanted = list(dict.fromkeys(families))
    unknown = [family for family in wanted if family not in _BUILDERS]
    if unknown:
        raise ValueError(f"unknown tiny model family(ies) {unknown}; known: {', '.join(_BUILDERS)}")

    out_dir = Path(out_dir)
    result: dict[str, Path] = {}
    todo: list[str] = []
    for family in wanted:
        folder = out_dir / _FOLDER_BY_FAMILY[family]
        if _is_complete(folder) and not force:
            result[family] = folder
        else:
            todo.append(family)
    if todo:
        with quiet_libraries():
            for family in todo:
                result[family] = _build_into(family, out_dir / _FOLDER_BY_FAMILY[family], seed, force)
    return {family: result[family] for family in wanted}


#: The UNet attention projections a tiny LoRA adapts (diffusers' own LoRA training scripts' choice).
LORA_TARGETS: tuple[str, ...] = ("to_q", "to_k", "to_v", "to_out.0")


def make_tiny_lora(base: Path, folder: Path, seed: int = 0, rank: int = 4, *, force: bool = False) -> Path:
    """Build a LoRA adapter for the UNet of the diffusers pipeline ``base`` (e.g. ``tiny-sd``)
    into ``folder``, without training: peft's ``LoraConfig`` (rank ``rank``,
    ``lora_alpha`` = ``rank``: scale 1) on :data:`LORA_TARGETS` with ``init_lora_weights=False``,
    so both LoRA matrices are drawn at random (seeded: ``torch.manual_seed(seed)`` in a forked
    RNG) and the adapter changes the output at scale 1; saved with diffusers'
    ``save_lora_weights`` as ``folder/pytorch_lora_weights.safetensors``, the layout
    ``homefleet models add FOLDER --adapter-of FAMILY`` registers. Same seed, same bytes.

    An existing ``folder`` holding that file is returned as it is unless ``force``.

    Raises:
        OSError: ``base`` has no ``unet`` folder.
    """
    folder = Path(folder)
    weights = folder / "pytorch_lora_weights.safetensors"
    if weights.is_file() and not force:
        return folder
    import torch
    from diffusers import StableDiffusionPipeline, UNet2DConditionModel
    from diffusers.utils import convert_state_dict_to_diffusers
    from peft import LoraConfig, get_peft_model_state_dict

    with quiet_libraries(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        unet = UNet2DConditionModel.from_pretrained(str(Path(base) / "unet"), local_files_only=True)
        unet.add_adapter(
            LoraConfig(r=rank, lora_alpha=rank, init_lora_weights=False, target_modules=list(LORA_TARGETS))
        )
        layers = convert_state_dict_to_diffusers(get_peft_model_state_dict(unet))
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", suffix=".tmp", dir=folder.parent))
    try:
        StableDiffusionPipeline.save_lora_weights(str(staging), unet_lora_layers=layers, safe_serialization=True)
        os.chmod(staging, 0o755)
        if folder.exists():
            shutil.rmtree(folder)
        os.replace(staging, folder)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder
