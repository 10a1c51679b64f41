"""The reverse key mapping of app/devtools/tiny_single_file.py is the inverse of diffusers' own
single-file conversion: forward(reverse(state)) == state, tensor for tensor, for the SD UNet, the
VAE, CLIP-L, OpenCLIP and the Flux transformer; and the original names are the ones real
checkpoints use (docs/operations.md "Single-file checkpoints")."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import torch
from diffusers.loaders.single_file_utils import (
    CHECKPOINT_KEY_NAMES,
    convert_flux_transformer_checkpoint_to_diffusers,
    convert_ldm_clip_checkpoint,
    convert_ldm_unet_checkpoint,
    convert_ldm_vae_checkpoint,
    convert_open_clip_checkpoint,
)
from transformers import CLIPTextConfig, CLIPTextModelWithProjection

from app.devtools import tiny_models as tiny
from app.devtools.tiny_single_file import (
    SD1_CLIP_PREFIX,
    SDXL_OPEN_CLIP_PREFIX,
    UNET_PREFIX,
    VAE_PREFIX,
    clip_to_original,
    flux_to_original,
    open_clip_to_original,
    unet_to_original,
    vae_to_original,
)
from app.store.single_file import write_clip_tokenizer_files


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))[:5]
    return [k for k in a if not torch.equal(a[k], b[k])]


def test_unet_sd1_and_sdxl_round_trip_through_convert_ldm_unet_checkpoint() -> None:
    torch.manual_seed(0)
    for unet in (
        tiny._unet(),
        tiny._unet(
            cross_attention_dim=80,
            addition_embed_type="text_time",
            addition_time_embed_dim=8,
            projection_class_embeddings_input_dim=96,
        ),
    ):
        state = unet.state_dict()
        original = {UNET_PREFIX + k: v for k, v in unet_to_original(state, unet.config).items()}
        assert "model.diffusion_model.input_blocks.0.0.weight" in original
        assert "model.diffusion_model.output_blocks.2.1.conv.weight" not in original  # last up block: no upsampler
        assert same(convert_ldm_unet_checkpoint(original, unet.config), state) == []


def test_vae_round_trips_with_the_original_1x1_convolution_attention() -> None:
    torch.manual_seed(0)
    vae = tiny._vae()
    state = vae.state_dict()
    original = {VAE_PREFIX + k: v for k, v in vae_to_original(state, vae.config).items()}
    assert original["first_stage_model.encoder.mid.attn_1.q.weight"].ndim == 4
    assert "first_stage_model.decoder.up.1.upsample.conv.weight" in original  # up blocks count backwards
    assert same(convert_ldm_vae_checkpoint(original, vae.config), state) == []


def test_clip_and_open_clip_round_trip(tmp_path: Path) -> None:
    torch.manual_seed(0)
    text = tiny._text_encoder(tiny._tokenizer(tmp_path))
    original = clip_to_original(text.state_dict(), SD1_CLIP_PREFIX)
    assert CHECKPOINT_KEY_NAMES["clip"] in original
    back = {k.removeprefix("text_model."): v for k, v in convert_ldm_clip_checkpoint(original).items()}
    assert same(back, text.state_dict()) == []
    big = CLIPTextModelWithProjection(
        CLIPTextConfig(
            vocab_size=514,
            hidden_size=48,
            intermediate_size=37,
            num_hidden_layers=2,
            num_attention_heads=4,
            projection_dim=40,
        )
    )
    original = open_clip_to_original(big.state_dict())
    assert original[SDXL_OPEN_CLIP_PREFIX + "transformer.resblocks.1.attn.in_proj_weight"].shape == (3 * 48, 48)
    assert original[SDXL_OPEN_CLIP_PREFIX + "text_projection"].shape == (48, 40)
    assert same(convert_open_clip_checkpoint(big, original, prefix=SDXL_OPEN_CLIP_PREFIX), big.state_dict()) == []


def test_flux_round_trips_at_flux1_width() -> None:
    """diffusers' Flux converter takes FLUX.1's width (3072, MLP 12288) as fixed, so the state is
    built with those row counts and one column: the mapping is checked, not a model."""
    torch.manual_seed(0)
    width, mlp = 3072, 12288
    state: dict[str, torch.Tensor] = {}
    for head in (
        "time_text_embed.timestep_embedder",
        "time_text_embed.text_embedder",
        "time_text_embed.guidance_embedder",
    ):
        for layer in ("linear_1", "linear_2"):
            state[f"{head}.{layer}.weight"], state[f"{head}.{layer}.bias"] = torch.randn(4, 1), torch.randn(4)
    for name in ("context_embedder", "x_embedder", "proj_out", "norm_out.linear"):
        state[f"{name}.weight"], state[f"{name}.bias"] = torch.randn(6, 1), torch.randn(6)
    block = "transformer_blocks.0."
    for name in (
        "norm1.linear",
        "norm1_context.linear",
        "attn.to_q",
        "attn.to_k",
        "attn.to_v",
        "attn.add_q_proj",
        "attn.add_k_proj",
        "attn.add_v_proj",
        "ff.net.0.proj",
        "ff.net.2",
        "ff_context.net.0.proj",
        "ff_context.net.2",
        "attn.to_out.0",
        "attn.to_add_out",
    ):
        state[f"{block}{name}.weight"], state[f"{block}{name}.bias"] = torch.randn(5, 1), torch.randn(5)
    for name in ("norm_q", "norm_k", "norm_added_q", "norm_added_k"):
        state[f"{block}attn.{name}.weight"] = torch.randn(5)
    single = "single_transformer_blocks.0."
    for name, rows in (
        ("norm.linear", 5),
        ("attn.to_q", width),
        ("attn.to_k", width),
        ("attn.to_v", width),
        ("proj_mlp", mlp),
        ("proj_out", 5),
    ):
        state[f"{single}{name}.weight"], state[f"{single}{name}.bias"] = torch.randn(rows, 1), torch.randn(rows)
    state[f"{single}attn.norm_q.weight"], state[f"{single}attn.norm_k.weight"] = torch.randn(5), torch.randn(5)
    original = flux_to_original(state)
    assert original["double_blocks.0.img_attn.qkv.weight"].shape == (15, 1)
    assert original["single_blocks.0.linear1.weight"].shape == (3 * width + mlp, 1)
    assert CHECKPOINT_KEY_NAMES["flux"][0] in original
    assert same(convert_flux_transformer_checkpoint_to_diffusers(dict(original)), state) == []


def test_the_clip_vocabulary_is_built_like_clips_own_encoder(tmp_path: Path) -> None:
    bpe = tmp_path / "bpe_simple_vocab_16e6.txt.gz"
    bpe.write_bytes(gzip.compress("\n".join(['"bpe_simple_vocab_16e6.txt#version: 0.2', "t h", "th e</w>"]).encode()))
    write_clip_tokenizer_files(bpe, tmp_path / "tokenizer")
    vocab = json.loads((tmp_path / "tokenizer" / "vocab.json").read_text())
    assert (len(vocab), vocab["!"], vocab["!</w>"], vocab["th"], vocab["the</w>"]) == (516, 0, 256, 512, 513)
    assert (vocab["<|startoftext|>"], vocab["<|endoftext|>"]) == (514, 515)
    assert (tmp_path / "tokenizer" / "merges.txt").read_text() == "#version: 0.2\nt h\nth e</w>\n"


def test_the_shipped_clip_vocabulary_tokenizes_as_clip_does(tmp_path: Path) -> None:
    """The vocabulary shipped for single-file conversions (app/store/family_configs/clip) gives
    CLIP's own token ids: "a photo of a cat" is 49406 320 1125 539 320 2368 49407 in OpenAI's
    CLIP tokenizer (the ids SD 1.x's text encoder was trained on)."""
    from transformers import CLIPTokenizer

    from app.store.single_file import FAMILY_CONFIGS, clip_vocabulary

    bpe = clip_vocabulary()
    assert bpe == FAMILY_CONFIGS / "clip" / "bpe_simple_vocab_16e6.txt.gz"
    write_clip_tokenizer_files(bpe, tmp_path / "tokenizer")
    tokenizer = CLIPTokenizer(str(tmp_path / "tokenizer" / "vocab.json"), str(tmp_path / "tokenizer" / "merges.txt"))
    assert len(tokenizer) == 49408
    assert tokenizer("a photo of a cat")["input_ids"] == [49406, 320, 1125, 539, 320, 2368, 49407]
