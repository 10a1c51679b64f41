"""Tiny single-file checkpoints in the original training code's key layout, made from tiny
diffusers pipelines (no model hub): the files ``homefleet models add FILE --family …`` converts
(docs/operations.md, "Single-file checkpoints").

The reverse key mapping (diffusers -> original names) is the inverse of diffusers' own
conversion functions in ``diffusers/loaders/single_file_utils.py``:

* SD 1.x / SDXL UNet -> ``model.diffusion_model.`` (``input_blocks``/``middle_block``/
  ``output_blocks``; inverse of ``convert_ldm_unet_checkpoint``);
* VAE -> ``first_stage_model.`` (``encoder.down.N.block.M``, ``mid.attn_1`` with 1x1-conv
  attention weights; inverse of ``convert_ldm_vae_checkpoint``);
* CLIP-L -> ``cond_stage_model.transformer.text_model.`` (SD 1.x) or
  ``conditioner.embedders.0.transformer.text_model.`` (SDXL; inverse of
  ``convert_ldm_clip_checkpoint``);
* SDXL's OpenCLIP-bigG encoder -> ``conditioner.embedders.1.model.`` (``resblocks.N`` with a
  fused ``attn.in_proj_weight``, ``text_projection`` transposed; inverse of
  ``convert_open_clip_checkpoint``);
* the Flux transformer -> ``double_blocks.N``/``single_blocks.N`` with fused ``qkv`` and
  ``linear1`` (inverse of ``convert_flux_transformer_checkpoint_to_diffusers``, which takes
  FLUX.1's width, 3072, as fixed: only a transformer of that width converts back).

Every mapping is checked by a round trip through the forward function
(tests/unit/devtools/test_tiny_single_file.py): forward(reverse(state)) == state.

This module imports only the standard library at import time.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, cast

from app.core.quiet import quiet_libraries

__all__ = [
    "SDXL_TEXT_WIDTHS",
    "flux_to_original",
    "make_tiny_sdxl_single_file_base",
    "make_tiny_single_file",
    "sd_to_original",
    "sdxl_to_original",
]

_RESNET = {
    "norm1": "in_layers.0",
    "conv1": "in_layers.2",
    "norm2": "out_layers.0",
    "conv2": "out_layers.3",
    "time_emb_proj": "emb_layers.1",
    "conv_shortcut": "skip_connection",
}
_VAE_ATTENTION = {"group_norm": "norm", "to_q": "q", "to_k": "k", "to_v": "v", "to_out.0": "proj_out"}
UNET_PREFIX = "model.diffusion_model."
VAE_PREFIX = "first_stage_model."
SD1_CLIP_PREFIX = "cond_stage_model.transformer."
SDXL_CLIP_PREFIX = "conditioner.embedders.0.transformer."
SDXL_OPEN_CLIP_PREFIX = "conditioner.embedders.1.model."

#: Hidden widths of the two text encoders of the tiny SDXL base a single-file test converts: they
#: differ, as CLIP-L's 768 and OpenCLIP-bigG's 1280 do, since diffusers tells the two encoders of
#: an SDXL checkpoint apart by their width (``create_diffusers_clip_model_from_ldm``).
SDXL_TEXT_WIDTHS: tuple[int, int] = (32, 48)


def _rename_head(rest: str, table: Mapping[str, str]) -> str:
    for new, old in table.items():
        if rest.startswith(new + "."):
            return old + rest[len(new) :]
    return rest


def unet_to_original(state: Mapping[str, Any], config: Mapping[str, Any]) -> dict[str, Any]:
    """A diffusers ``UNet2DConditionModel`` state dict -> the original UNet keys (no prefix).

    ``config`` is the UNet's config (``layers_per_block``, ``up_block_types``,
    ``addition_embed_type``). Tensors are kept as they are (the original 1x1 convolutions and
    linear projections have the diffusers shapes)."""
    from diffusers.loaders.single_file_utils import DIFFUSERS_TO_LDM_MAPPING

    per_block = int(config["layers_per_block"])
    mapping = cast("dict[str, dict[str, Any]]", DIFFUSERS_TO_LDM_MAPPING)  # typed as dict[str, object]
    fixed = dict(mapping["unet"]["layers"])
    if config.get("addition_embed_type") == "text_time":
        fixed.update(mapping["unet"]["addition_embed_type"])
    attention_up = ["CrossAttn" in name for name in config["up_block_types"]]
    out: dict[str, Any] = {}
    for key, tensor in state.items():
        if key in fixed:
            out[fixed[key]] = tensor
            continue
        if m := re.fullmatch(r"down_blocks\.(\d+)\.(resnets|attentions)\.(\d+)\.(.+)", key):
            block, part, layer, rest = int(m[1]), m[2], int(m[3]), m[4]
            index = 1 + block * (per_block + 1) + layer
            name = (
                f"input_blocks.{index}.0.{_rename_head(rest, _RESNET)}"
                if part == "resnets"
                else f"input_blocks.{index}.1.{rest}"
            )
        elif m := re.fullmatch(r"down_blocks\.(\d+)\.downsamplers\.0\.conv\.(.+)", key):
            name = f"input_blocks.{1 + int(m[1]) * (per_block + 1) + per_block}.0.op.{m[2]}"
        elif m := re.fullmatch(r"mid_block\.resnets\.(\d+)\.(.+)", key):
            name = f"middle_block.{2 * int(m[1])}.{_rename_head(m[2], _RESNET)}"
        elif m := re.fullmatch(r"mid_block\.attentions\.0\.(.+)", key):
            name = f"middle_block.1.{m[1]}"
        elif m := re.fullmatch(r"up_blocks\.(\d+)\.(resnets|attentions)\.(\d+)\.(.+)", key):
            block, part, layer, rest = int(m[1]), m[2], int(m[3]), m[4]
            index = block * (per_block + 1) + layer
            name = (
                f"output_blocks.{index}.0.{_rename_head(rest, _RESNET)}"
                if part == "resnets"
                else f"output_blocks.{index}.1.{rest}"
            )
        elif m := re.fullmatch(r"up_blocks\.(\d+)\.upsamplers\.0\.conv\.(.+)", key):
            block = int(m[1])
            slot = 2 if attention_up[block] else 1
            name = f"output_blocks.{block * (per_block + 1) + per_block}.{slot}.conv.{m[2]}"
        else:
            raise ValueError(f"UNet key {key!r} has no original name in this mapping")
        out[name] = tensor
    return out


def vae_to_original(state: Mapping[str, Any], config: Mapping[str, Any]) -> dict[str, Any]:
    """A diffusers ``AutoencoderKL`` state dict -> the original (LDM) VAE keys (no prefix); the
    mid-block attention's q/k/v/proj_out weights become 1x1 convolutions (C, C, 1, 1)."""
    from diffusers.loaders.single_file_utils import DIFFUSERS_TO_LDM_MAPPING

    fixed = cast("dict[str, str]", DIFFUSERS_TO_LDM_MAPPING["vae"])
    blocks = len(config["up_block_types"])
    out: dict[str, Any] = {}
    for key, tensor in state.items():
        if key in fixed:
            out[fixed[key]] = tensor
            continue
        if m := re.fullmatch(r"encoder\.down_blocks\.(\d+)\.resnets\.(\d+)\.(.+)", key):
            name = f"encoder.down.{m[1]}.block.{m[2]}.{m[3].replace('conv_shortcut', 'nin_shortcut')}"
        elif m := re.fullmatch(r"encoder\.down_blocks\.(\d+)\.downsamplers\.0\.conv\.(.+)", key):
            name = f"encoder.down.{m[1]}.downsample.conv.{m[2]}"
        elif m := re.fullmatch(r"decoder\.up_blocks\.(\d+)\.resnets\.(\d+)\.(.+)", key):
            name = f"decoder.up.{blocks - 1 - int(m[1])}.block.{m[2]}.{m[3].replace('conv_shortcut', 'nin_shortcut')}"
        elif m := re.fullmatch(r"decoder\.up_blocks\.(\d+)\.upsamplers\.0\.conv\.(.+)", key):
            name = f"decoder.up.{blocks - 1 - int(m[1])}.upsample.conv.{m[2]}"
        elif m := re.fullmatch(r"(encoder|decoder)\.mid_block\.resnets\.(\d+)\.(.+)", key):
            name = f"{m[1]}.mid.block_{int(m[2]) + 1}.{m[3].replace('conv_shortcut', 'nin_shortcut')}"
        elif m := re.fullmatch(r"(encoder|decoder)\.mid_block\.attentions\.0\.(.+)\.(weight|bias)", key):
            name = f"{m[1]}.mid.attn_1.{_VAE_ATTENTION[m[2]]}.{m[3]}"
            if m[3] == "weight" and m[2] != "group_norm":
                tensor = tensor[:, :, None, None]  # the original's 1x1 convolution
        else:
            raise ValueError(f"VAE key {key!r} has no original name in this mapping")
        out[name] = tensor
    return out


def clip_to_original(state: Mapping[str, Any], prefix: str) -> dict[str, Any]:
    """A transformers ``CLIPTextModel`` state dict -> ``prefix + "text_model." + …`` (the
    original code wraps the transformers model, so the names are the transformers ones)."""
    return {
        prefix + (key if key.startswith("text_model.") else "text_model." + key): tensor
        for key, tensor in state.items()
    }


def open_clip_to_original(state: Mapping[str, Any], prefix: str = SDXL_OPEN_CLIP_PREFIX) -> dict[str, Any]:
    """A transformers ``CLIPTextModelWithProjection`` state dict -> OpenCLIP's names under
    ``prefix`` (``transformer.resblocks.N.attn.in_proj_weight`` = q, k, v stacked;
    ``text_projection`` is the transposed projection matrix)."""
    import torch

    fixed = {
        "text_model.embeddings.position_embedding.weight": "positional_embedding",
        "text_model.embeddings.token_embedding.weight": "token_embedding.weight",
        "text_model.final_layer_norm.weight": "ln_final.weight",
        "text_model.final_layer_norm.bias": "ln_final.bias",
    }
    parts = {
        "layer_norm1": "ln_1",
        "layer_norm2": "ln_2",
        "mlp.fc1": "mlp.c_fc",
        "mlp.fc2": "mlp.c_proj",
        "self_attn.out_proj": "attn.out_proj",
    }
    out: dict[str, Any] = {}
    fused: dict[tuple[int, str], dict[str, Any]] = {}
    for key, tensor in state.items():
        if key in fixed:
            out[prefix + fixed[key]] = tensor
        elif key == "text_projection.weight":
            out[prefix + "text_projection"] = tensor.T.contiguous()
        elif m := re.fullmatch(r"text_model\.encoder\.layers\.(\d+)\.self_attn\.([qkv])_proj\.(weight|bias)", key):
            fused.setdefault((int(m[1]), m[3]), {})[m[2]] = tensor
        elif m := re.fullmatch(r"text_model\.encoder\.layers\.(\d+)\.(.+)", key):
            out[f"{prefix}transformer.resblocks.{m[1]}.{_rename_head(m[2], parts)}"] = tensor
        else:
            raise ValueError(f"text encoder key {key!r} has no OpenCLIP name in this mapping")
    for (layer, kind), qkv in fused.items():
        out[f"{prefix}transformer.resblocks.{layer}.attn.in_proj_{kind}"] = torch.cat([qkv["q"], qkv["k"], qkv["v"]])
    return out


def flux_to_original(state: Mapping[str, Any]) -> dict[str, Any]:
    """A diffusers ``FluxTransformer2DModel`` state dict -> the original FLUX.1 names
    (``double_blocks.N.img_attn.qkv.weight``, ``single_blocks.N.linear1.weight``, …; no prefix).
    ``norm_out``'s (scale, shift) becomes the original's (shift, scale)."""
    import torch

    fixed = {
        "time_text_embed.timestep_embedder.linear_1": "time_in.in_layer",
        "time_text_embed.timestep_embedder.linear_2": "time_in.out_layer",
        "time_text_embed.text_embedder.linear_1": "vector_in.in_layer",
        "time_text_embed.text_embedder.linear_2": "vector_in.out_layer",
        "time_text_embed.guidance_embedder.linear_1": "guidance_in.in_layer",
        "time_text_embed.guidance_embedder.linear_2": "guidance_in.out_layer",
        "context_embedder": "txt_in",
        "x_embedder": "img_in",
        "proj_out": "final_layer.linear",
    }
    double = {
        "norm1.linear": "img_mod.lin",
        "norm1_context.linear": "txt_mod.lin",
        "attn.norm_q.weight": "img_attn.norm.query_norm.scale",
        "attn.norm_k.weight": "img_attn.norm.key_norm.scale",
        "attn.norm_added_q.weight": "txt_attn.norm.query_norm.scale",
        "attn.norm_added_k.weight": "txt_attn.norm.key_norm.scale",
        "ff.net.0.proj": "img_mlp.0",
        "ff.net.2": "img_mlp.2",
        "ff_context.net.0.proj": "txt_mlp.0",
        "ff_context.net.2": "txt_mlp.2",
        "attn.to_out.0": "img_attn.proj",
        "attn.to_add_out": "txt_attn.proj",
    }
    single = {
        "norm.linear": "modulation.lin",
        "attn.norm_q.weight": "norm.query_norm.scale",
        "attn.norm_k.weight": "norm.key_norm.scale",
        "proj_out": "linear2",
    }
    out: dict[str, Any] = {}
    fused: dict[str, dict[str, Any]] = {}
    for key, tensor in state.items():
        head, _, last = key.rpartition(".")
        if head in fixed:
            out[f"{fixed[head]}.{last}"] = tensor
        elif key.startswith("norm_out.linear."):
            scale, shift = tensor.chunk(2, dim=0)
            out[f"final_layer.adaLN_modulation.1.{last}"] = torch.cat([shift, scale])
        elif m := re.fullmatch(r"transformer_blocks\.(\d+)\.(.+)", key):
            block, rest = m[1], m[2]
            if qkv := re.fullmatch(r"attn\.(to|add)_([qkv])(?:_proj)?\.(weight|bias)", rest):
                stream = "img" if qkv[1] == "to" else "txt"
                fused.setdefault(f"double_blocks.{block}.{stream}_attn.qkv.{qkv[3]}", {})[qkv[2]] = tensor
            elif rest in double:
                out[f"double_blocks.{block}.{double[rest]}"] = tensor
            elif rest.rpartition(".")[0] in double:
                out[f"double_blocks.{block}.{double[rest.rpartition('.')[0]]}.{rest.rpartition('.')[2]}"] = tensor
            else:
                raise ValueError(f"Flux key {key!r} has no original name in this mapping")
        elif m := re.fullmatch(r"single_transformer_blocks\.(\d+)\.(.+)", key):
            block, rest = m[1], m[2]
            if part := re.fullmatch(r"(?:attn\.to_([qkv])|proj_(mlp))\.(weight|bias)", rest):
                fused.setdefault(f"single_blocks.{block}.linear1.{part[3]}", {})[part[1] or part[2]] = tensor
            elif rest in single:
                out[f"single_blocks.{block}.{single[rest]}"] = tensor
            elif rest.rpartition(".")[0] in single:
                out[f"single_blocks.{block}.{single[rest.rpartition('.')[0]]}.{rest.rpartition('.')[2]}"] = tensor
            else:
                raise ValueError(f"Flux key {key!r} has no original name in this mapping")
        else:
            raise ValueError(f"Flux key {key!r} has no original name in this mapping")
    for name, parts in fused.items():
        order = ("q", "k", "v", "mlp") if "linear1" in name else ("q", "k", "v")
        out[name] = torch.cat([parts[p] for p in order])
    return out


def sd_to_original(pipe: Any) -> dict[str, Any]:
    """An SD 1.x ``StableDiffusionPipeline`` -> one state dict in the original layout (UNet,
    VAE, CLIP-L), as an A1111/Civitai SD 1.5 checkpoint holds it."""
    state = {UNET_PREFIX + k: v for k, v in unet_to_original(pipe.unet.state_dict(), pipe.unet.config).items()}
    state.update({VAE_PREFIX + k: v for k, v in vae_to_original(pipe.vae.state_dict(), pipe.vae.config).items()})
    state.update(clip_to_original(pipe.text_encoder.state_dict(), SD1_CLIP_PREFIX))
    return state


def sdxl_to_original(pipe: Any) -> dict[str, Any]:
    """An SDXL ``StableDiffusionXLPipeline`` -> one state dict in the original (SGM) layout:
    UNet, VAE, CLIP-L (``conditioner.embedders.0``) and OpenCLIP (``conditioner.embedders.1``)."""
    state = {UNET_PREFIX + k: v for k, v in unet_to_original(pipe.unet.state_dict(), pipe.unet.config).items()}
    state.update({VAE_PREFIX + k: v for k, v in vae_to_original(pipe.vae.state_dict(), pipe.vae.config).items()})
    state.update(clip_to_original(pipe.text_encoder.state_dict(), SDXL_CLIP_PREFIX))
    state.update(open_clip_to_original(pipe.text_encoder_2.state_dict()))
    return state


def make_tiny_sdxl_single_file_base(folder: Path, seed: int = 0) -> Path:
    """A tiny SDXL base pipeline (the components of ``tiny_models``' ``tiny-sdxl``) whose two
    text encoders differ in width (:data:`SDXL_TEXT_WIDTHS`), saved as a diffusers folder:
    the pipeline a tiny SDXL single-file checkpoint is made from and converted back with."""
    import torch
    from diffusers import EulerDiscreteScheduler, StableDiffusionXLPipeline
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    from app.devtools import tiny_models as tiny

    folder = Path(folder)
    with quiet_libraries(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        tokenizer = tiny._tokenizer(folder.parent / f".{folder.name}-scratch")

        def encoder(cls: Any, width: int) -> Any:
            return cls(
                CLIPTextConfig(
                    vocab_size=len(tokenizer),
                    hidden_size=width,
                    intermediate_size=37,
                    num_hidden_layers=2,
                    num_attention_heads=4,
                    max_position_embeddings=77,
                    projection_dim=width,
                    bos_token_id=tokenizer.bos_token_id,
                    eos_token_id=tokenizer.eos_token_id,
                    pad_token_id=tokenizer.pad_token_id,
                )
            ).eval()

        small, large = SDXL_TEXT_WIDTHS
        pipe = StableDiffusionXLPipeline(
            vae=tiny._vae(),
            text_encoder=encoder(CLIPTextModel, small),
            text_encoder_2=encoder(CLIPTextModelWithProjection, large),
            tokenizer=tokenizer,
            tokenizer_2=tokenizer,
            unet=tiny._unet(
                cross_attention_dim=small + large,
                addition_embed_type="text_time",
                addition_time_embed_dim=8,
                projection_class_embeddings_input_dim=large + 6 * 8,
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
        pipe.save_pretrained(str(folder), safe_serialization=True)
        tiny._as_saved(folder)
    return folder


def make_tiny_single_file(base: Path, target: Path, family: str) -> Path:
    """Write the diffusers pipeline folder ``base`` as ONE ``.safetensors`` checkpoint in the
    original key layout of ``family`` (``sd1``, ``sdxl``: the whole pipeline's weights; ``flux``:
    the transformer only, as ``flux1-dev.safetensors`` holds it) at ``target``; returns it.

    Raises:
        ValueError: an unknown family, or a key the mapping has no original name for (e.g. a
            Flux transformer not 3072 wide cannot be converted back by diffusers).
    """
    from diffusers import DiffusionPipeline, FluxTransformer2DModel
    from safetensors.torch import save_file

    from app.core.quiet import quiet_libraries

    with quiet_libraries():
        if family == "flux":
            model = FluxTransformer2DModel.from_pretrained(str(Path(base) / "transformer"), local_files_only=True)
            state = flux_to_original(model.state_dict())
        elif family in ("sd1", "sdxl"):
            pipe = DiffusionPipeline.from_pretrained(str(base), local_files_only=True)
            state = sd_to_original(pipe) if family == "sd1" else sdxl_to_original(pipe)
        else:
            raise ValueError(f"no single-file layout for family {family!r}; known: sd1, sdxl, flux")
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, str(target))
    return target
