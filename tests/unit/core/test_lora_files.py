"""LoRA files recognised from their tensor names (app/core/lora_files.py): kohya vs
diffusers/PEFT layout, the base they adapt (SD 1.x UNet, SDXL, Flux, another transformer), and
refusals naming the keys seen: a full checkpoint, a file of mixed or unknown keys, a LoRA for
another family than the one it is registered for."""

from __future__ import annotations

import pytest

from app.core.errors import Rejected
from app.core.families import FAMILIES
from app.core.lora_files import (
    BASES,
    DIFFUSERS,
    KOHYA,
    LORA_WEIGHTS,
    adapted_module,
    context_width,
    first_misfit,
    recognise,
    weight_file,
    width_name,
)

KOHYA_SD1 = [
    "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q.lora_down.weight",
    "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q.lora_up.weight",
    "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q.alpha",
    "lora_unet_up_blocks_3_attentions_2_transformer_blocks_0_attn2_to_out_0.lora_down.weight",
    "lora_unet_up_blocks_3_attentions_2_transformer_blocks_0_attn2_to_out_0.lora_up.weight",
    "lora_unet_up_blocks_3_attentions_2_transformer_blocks_0_attn2_to_out_0.alpha",
    "lora_te_text_model_encoder_layers_0_self_attn_out_proj.lora_down.weight",
    "lora_te_text_model_encoder_layers_0_self_attn_out_proj.lora_up.weight",
    "lora_te_text_model_encoder_layers_0_self_attn_out_proj.alpha",
]
KOHYA_SDXL = [
    "lora_te1_text_model_encoder_layers_0_self_attn_out_proj.lora_down.weight",
    "lora_te1_text_model_encoder_layers_0_self_attn_out_proj.lora_up.weight",
    "lora_te1_text_model_encoder_layers_0_self_attn_out_proj.alpha",
    "lora_te2_text_model_encoder_layers_0_mlp_fc1.lora_down.weight",
    "lora_te2_text_model_encoder_layers_0_mlp_fc1.lora_up.weight",
    "lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_k.lora_down.weight",
    "lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_k.lora_up.weight",
    "lora_unet_middle_block_1_proj_in.lora_down.weight",
    "lora_unet_middle_block_1_proj_in.lora_up.weight",
]
KOHYA_FLUX = [
    "lora_te1_text_model_encoder_layers_0_self_attn_out_proj.lora_down.weight",  # Flux's CLIP is te1 too
    "lora_te1_text_model_encoder_layers_0_self_attn_out_proj.lora_up.weight",
    "lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight",
    "lora_unet_double_blocks_0_img_attn_qkv.lora_up.weight",
    "lora_unet_double_blocks_0_img_attn_qkv.alpha",
    "lora_unet_single_blocks_37_linear1.lora_down.weight",
    "lora_unet_single_blocks_37_linear1.lora_up.weight",
]
PEFT_SD1 = [
    "unet.down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q.lora_A.weight",
    "unet.down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q.lora_B.weight",
    "unet.mid_block.attentions.0.transformer_blocks.0.attn2.to_out.0.lora_A.weight",
    "unet.mid_block.attentions.0.transformer_blocks.0.attn2.to_out.0.lora_B.weight",
    "text_encoder.text_model.encoder.layers.0.self_attn.q_proj.lora_A.weight",
    "text_encoder.text_model.encoder.layers.0.self_attn.q_proj.lora_B.weight",
]
#: what diffusers' save_lora_weights writes (app/devtools/tiny_models.py make_tiny_lora)
OLD_DIFFUSERS_SD1 = [
    "unet.down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_k.lora.down.weight",
    "unet.down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_k.lora.up.weight",
    "unet.down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_out.0.lora.down.weight",
    "unet.down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_out.0.lora.up.weight",
]
PEFT_SDXL = [
    "text_encoder_2.text_model.encoder.layers.0.self_attn.q_proj.lora_A.weight",
    "text_encoder_2.text_model.encoder.layers.0.self_attn.q_proj.lora_B.weight",
    "unet.down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q.lora_A.weight",
    "unet.down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q.lora_B.weight",
]
#: an SDXL UNet-only file in diffusers naming: only SDXL has more than one transformer block per attention
PEFT_SDXL_UNET = [
    "unet.down_blocks.2.attentions.1.transformer_blocks.0.attn1.to_q.lora_A.weight",
    "unet.down_blocks.2.attentions.1.transformer_blocks.0.attn1.to_q.lora_B.weight",
    "unet.down_blocks.2.attentions.1.transformer_blocks.7.attn1.to_q.lora_A.weight",
    "unet.down_blocks.2.attentions.1.transformer_blocks.7.attn1.to_q.lora_B.weight",
]
#: blocks both UNets have: the names leave it open
PEFT_EITHER_UNET = [
    "unet.down_blocks.1.attentions.0.transformer_blocks.0.attn2.to_k.lora_A.weight",
    "unet.down_blocks.1.attentions.0.transformer_blocks.0.attn2.to_k.lora_B.weight",
    "unet.mid_block.attentions.0.transformer_blocks.0.attn1.to_q.lora_A.weight",
    "unet.mid_block.attentions.0.transformer_blocks.0.attn1.to_q.lora_B.weight",
]
PEFT_FLUX = [
    "transformer.single_transformer_blocks.0.attn.to_q.lora_A.weight",
    "transformer.single_transformer_blocks.0.attn.to_q.lora_B.weight",
    "transformer.transformer_blocks.0.attn.add_k_proj.lora_A.weight",
    "transformer.transformer_blocks.0.attn.add_k_proj.lora_B.weight",
    "text_encoder_2.encoder.block.0.layer.0.SelfAttention.q.lora_A.weight",  # T5 (text_encoder_2): still Flux
    "text_encoder_2.encoder.block.0.layer.0.SelfAttention.q.lora_B.weight",
]
PEFT_TRANSFORMER = [
    "transformer.transformer_blocks.0.attn.to_q.lora_A.weight",
    "transformer.transformer_blocks.0.attn.to_q.lora_B.weight",
]
SD1_CHECKPOINT = [
    "model.diffusion_model.input_blocks.0.0.weight",
    "model.diffusion_model.input_blocks.0.0.bias",
    "first_stage_model.encoder.conv_in.weight",
    "cond_stage_model.transformer.text_model.embeddings.position_ids",
]


@pytest.mark.parametrize(
    ("keys", "source_format", "base", "first_evidence"),
    [
        (KOHYA_SD1, KOHYA, "sd1", "lora_te_text_model_encoder_layers_0_self_attn_out_proj.alpha"),
        (KOHYA_SDXL, KOHYA, "sdxl", "lora_te1_text_model_encoder_layers_0_self_attn_out_proj.alpha"),
        (KOHYA_FLUX, KOHYA, "flux", "lora_unet_double_blocks_0_img_attn_qkv.alpha"),
        (PEFT_SD1, DIFFUSERS, "unet", PEFT_SD1[4]),  # diffusers' names alone: SD 1.x/2.x or SDXL
        (OLD_DIFFUSERS_SD1, DIFFUSERS, "unet", OLD_DIFFUSERS_SD1[0]),
        (PEFT_SDXL, DIFFUSERS, "sdxl", PEFT_SDXL[0]),
        (PEFT_SDXL_UNET, DIFFUSERS, "sdxl", PEFT_SDXL_UNET[2]),
        (PEFT_EITHER_UNET, DIFFUSERS, "unet", PEFT_EITHER_UNET[0]),
        (PEFT_FLUX, DIFFUSERS, "flux", PEFT_FLUX[0]),
        (PEFT_TRANSFORMER, DIFFUSERS, "transformer", PEFT_TRANSFORMER[0]),
    ],
)
def test_the_layout_and_base_come_from_the_keys(
    keys: list[str], source_format: str, base: str, first_evidence: str
) -> None:
    layout = recognise(keys, "x.safetensors")
    assert (layout.source_format, layout.base, layout.tensors) == (source_format, base, len(keys))
    assert layout.evidence[0] == first_evidence and len(layout.evidence) <= 3
    assert layout.families == BASES[base].families


@pytest.mark.parametrize(("width", "base"), [(768, "sd1"), (1024, "sd1"), (2048, "sdxl"), (64, "unet")])
def test_a_unet_file_the_names_leave_open_is_decided_by_its_cross_attention_width(width: int, base: str) -> None:
    """The key projection of cross-attention takes the text encoder's width: SD 1.x 768, SD 2.x
    1024, SDXL 2048; another width (a tiny test model) leaves it open, and then it fits both."""
    shapes = {key: ([4, width] if ".lora_A." in key else [320, 4]) for key in PEFT_EITHER_UNET}
    layout = recognise(PEFT_EITHER_UNET, "x.safetensors", shapes)
    assert layout.base == base
    if base != "unet":
        assert layout.evidence == (f"{PEFT_EITHER_UNET[0]} of width {width}",)
    else:
        for family in ("sd1", "sdxl", "animatediff"):
            layout.check_family(family, "x.safetensors")
    with pytest.raises(Rejected) as caught:
        layout.check_family("flux", "x.safetensors")
    assert caught.value.reason == "adapter_family_mismatch"


@pytest.mark.parametrize(
    ("shapes", "width"),
    [
        (  # kohya, as downloaded: the down matrix's input width
            {
                "lora_unet_up_blocks_1_attentions_0_transformer_blocks_0_attn2_to_v.lora_down.weight": [8, 1024],
                "lora_unet_up_blocks_1_attentions_0_transformer_blocks_0_attn2_to_v.lora_up.weight": [640, 8],
                "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_k.lora_down.weight": [8, 320],
            },
            1024,
        ),
        (  # diffusers / PEFT
            {
                "unet.down_blocks.1.attentions.0.transformer_blocks.0.attn2.to_k.lora_A.weight": [4, 2048],
                "unet.down_blocks.1.attentions.0.transformer_blocks.0.attn2.to_k.lora_B.weight": [640, 4],
            },
            2048,
        ),
        (  # the older diffusers names save_lora_weights still writes
            {"unet.mid_block.attentions.0.transformer_blocks.0.attn2.to_k.lora.down.weight": [4, 768]},
            768,
        ),
        (  # self-attention and feed-forward only: nothing says the width
            {
                "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_k.lora_down.weight": [8, 320],
                "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_ff_net_2.lora_down.weight": [8, 1280],
            },
            None,
        ),
    ],
)
def test_the_cross_attention_width_a_lora_was_made_for(shapes: dict[str, list[int]], width: int | None) -> None:
    assert context_width(shapes) == width


PROCESSOR_KEYS = [  # older diffusers' attention processors, under the pipeline's component prefix
    "unet.down_blocks.0.attentions.0.transformer_blocks.0.attn2.processor.to_k_lora.down.weight",
    "unet.down_blocks.0.attentions.0.transformer_blocks.0.attn2.processor.to_k_lora.up.weight",
    "unet.down_blocks.0.attentions.0.transformer_blocks.0.attn2.processor.to_out_lora.down.weight",
    "unet.down_blocks.0.attentions.0.transformer_blocks.0.attn2.processor.to_out_lora.up.weight",
]


def test_the_attention_processor_layout_is_a_lora_and_its_width_decides_its_base() -> None:
    """diffusers 0.42's load_lora_weights converts ``processor.to_k_lora.down`` to PEFT's names
    (measured on tiny-sd: two LoRA layers loaded from two such tensors)."""
    shapes = {k: ([4, 768] if ".down." in k else [320, 4]) for k in PROCESSOR_KEYS}
    layout = recognise(PROCESSOR_KEYS, "x.safetensors", shapes)
    assert (layout.source_format, layout.base, layout.tensors) == (DIFFUSERS, "sd1", 4)
    assert context_width(shapes) == 768


@pytest.mark.parametrize(
    "keys",
    [
        [k.removeprefix("unet.") for k in PROCESSOR_KEYS],  # unet.save_attn_procs
        [
            "down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q.lora_A.weight",
            "down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q.lora_B.weight",
        ],
        [
            "down_blocks.1.attentions.0.transformer_blocks.1.attn1.to_q.lora_A.weight",  # SDXL's second block
            "down_blocks.1.attentions.0.transformer_blocks.1.attn1.to_q.lora_B.weight",
        ],
    ],
)
def test_unet_keys_without_their_component_prefix_are_refused(keys: list[str]) -> None:
    """load_lora_weights reads a UNet's keys under ``unet.``; without it it loads none of them and
    says nothing (measured on tiny-sd: 0 LoRA layers), so the job would run without the adapter."""
    with pytest.raises(Rejected) as caught:
        recognise(keys, "x.safetensors")
    assert caught.value.reason == "not_an_adapter"
    assert caught.value.message.startswith("x.safetensors's LoRA keys name UNet modules without the `unet.` prefix")
    assert "prefix each key with `unet.`" in caught.value.message


@pytest.mark.parametrize(
    ("key", "adapted"),
    [
        ("unet.mid_block.attentions.0.proj_in.lora_A.weight", ("unet", "mid_block.attentions.0.proj_in", "input")),
        ("unet.up_blocks.1.resnets.0.conv1.lora_B.default_0.weight", ("unet", "up_blocks.1.resnets.0.conv1", "output")),
        (
            "text_encoder.text_model.encoder.layers.0.mlp.fc1.lora.down.weight",
            ("text_encoder", "text_model.encoder.layers.0.mlp.fc1", "input"),
        ),
        (
            "transformer.single_transformer_blocks.0.attn.to_q.lora_linear_layer.up.weight",
            ("transformer", "single_transformer_blocks.0.attn.to_q", "output"),
        ),
        (
            "unet.down_blocks.0.attentions.0.transformer_blocks.0.attn2.processor.to_out_lora.down.weight",
            ("unet", "down_blocks.0.attentions.0.transformer_blocks.0.attn2.to_out.0", "input"),
        ),
        (
            "lora_te2_text_model_encoder_layers_3_self_attn_q_proj.lora_up.weight",
            ("text_encoder_2", "text_model_encoder_layers_3_self_attn_q_proj", "output"),
        ),
        ("lora_unet_down_blocks_0_attentions_0_proj_in.alpha", None),
        ("lora_unet_input_blocks_4_1_proj_in.lora_down.weight", None),  # SDXL's original names
        ("lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight", None),  # Flux's
        ("unet.down_blocks.0.attentions.0.proj_in.lora_B.bias", None),
    ],
)
def test_what_one_lora_tensor_adapts(key: str, adapted: tuple[str, str, str] | None) -> None:
    assert adapted_module(key) == adapted


def test_the_first_misfit_is_found_across_layouts_and_text_encoder_names() -> None:
    base = {
        "unet": {
            "down_blocks.0.attentions.0.proj_in": (320, 320, 1, 1),
            "down_blocks.0.resnets.0.conv1": (320, 320, 3, 3),
        },
        # transformers 5 saves CLIP without its ``text_model.`` prefix; downloaded files have it
        "text_encoder": {"encoder.layers.0.self_attn.k_proj": (768, 768)},
    }
    fits = {
        "lora_unet_down_blocks_0_attentions_0_proj_in.lora_down.weight": (8, 320, 1, 1),
        "lora_unet_down_blocks_0_resnets_0_conv1.lora_down.weight": (8, 320, 3, 3),  # a LoCon's conv
        "lora_unet_down_blocks_0_resnets_0_conv1.lora_up.weight": (320, 8, 1, 1),
        "lora_te_text_model_encoder_layers_0_self_attn_k_proj.lora_down.weight": (8, 768),
        "text_encoder.text_model.encoder.layers.0.self_attn.k_proj.lora_B.weight": (768, 8),
        "lora_unet_input_blocks_4_1_proj_in.lora_down.weight": (8, 999),  # SDXL's original names: not judged
        "text_encoder_2.text_model.encoder.layers.0.mlp.fc1.lora_A.weight": (8, 5),  # no such component: not judged
    }
    assert first_misfit(fits, base) is None
    lacking = "unet.up_blocks.9.attentions.0.proj_out.lora_A.weight"  # a module the model's UNet lacks
    misfit = first_misfit({**fits, lacking: (8, 5)}, base)
    assert misfit is not None
    assert (misfit.key, misfit.module, misfit.side, misfit.base_shape) == (
        lacking,
        "up_blocks.9.attentions.0.proj_out",
        "missing",
        (),
    )
    misfit = first_misfit(
        {**fits, "lora_te_text_model_encoder_layers_0_self_attn_k_proj.lora_up.weight": (1024, 8)}, base
    )
    assert misfit is not None
    assert (misfit.component, misfit.module, misfit.side, misfit.shape, misfit.base_shape) == (
        "text_encoder",
        "encoder.layers.0.self_attn.k_proj",
        "output",
        (1024, 8),
        (768, 768),
    )


def test_widths_are_named_by_the_bases_that_have_them() -> None:
    assert [width_name(w) for w in (768, 1024, 2048, 32)] == ["768 (SD 1.x)", "1024 (SD 2.x)", "2048 (SDXL)", "32"]


def test_every_base_fits_registry_families_and_sd1_files_fit_the_sd1_unet_families() -> None:
    assert all(base.families <= set(FAMILIES) for base in BASES.values())
    sd1 = recognise(KOHYA_SD1, "a.safetensors")
    for family in ("sd1", "sd1-pix2pix", "animatediff"):
        sd1.check_family(family, "a.safetensors")
    recognise(PEFT_TRANSFORMER, "t.safetensors").check_family("qwen-image", "t.safetensors")  # no proof of Flux
    recognise(PEFT_FLUX, "f.safetensors").check_family("flux-kontext", "f.safetensors")


@pytest.mark.parametrize(
    ("keys", "family", "message"),
    [
        (
            KOHYA_SDXL,
            "sd1",
            "sdxl.safetensors is a LoRA for an SDXL UNet (keys like "
            "lora_te1_text_model_encoder_layers_0_self_attn_out_proj.alpha, "
            "lora_te1_text_model_encoder_layers_0_self_attn_out_proj.lora_down.weight, "
            "lora_te1_text_model_encoder_layers_0_self_attn_out_proj.lora_up.weight), not for family 'sd1'; "
            "register it with --adapter-of one of: sdxl",
        ),
        (KOHYA_SD1, "sdxl", "sdxl.safetensors is a LoRA for a Stable Diffusion 1.x/2.x UNet (keys like lora_te_"),
        (KOHYA_FLUX, "sd1", "sdxl.safetensors is a LoRA for a Flux transformer (keys like lora_unet_double_blocks_0_"),
        (
            PEFT_TRANSFORMER,
            "sd1",
            "sdxl.safetensors is a LoRA for a diffusion transformer (the keys do not say which) "
            "(keys like transformer.transformer_blocks.0.attn.to_q.lora_A.weight",
        ),
        (PEFT_SD1, "flux", "sdxl.safetensors is a LoRA for a Stable Diffusion UNet, 1.x/2.x or SDXL"),
    ],
)
def test_a_lora_for_another_family_is_refused_naming_the_keys(keys: list[str], family: str, message: str) -> None:
    with pytest.raises(Rejected) as caught:
        recognise(keys, "sdxl.safetensors").check_family(family, "sdxl.safetensors")
    assert caught.value.reason == "adapter_family_mismatch"
    assert caught.value.message.startswith(message), caught.value.message


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        ([], "x.safetensors holds no tensors"),
        (
            SD1_CHECKPOINT,
            "x.safetensors holds no LoRA weights: its 4 tensors are named like "
            "cond_stage_model.transformer.text_model.embeddings.position_ids, "
            "first_stage_model.encoder.conv_in.weight, model.diffusion_model.input_blocks.0.0.bias "
            "(and 1 more) (a full checkpoint or another file)",
        ),
        (
            ["conv_in.weight", "conv_in.bias"],
            "x.safetensors holds no LoRA weights: its 2 tensors are named like conv_in.bias, conv_in.weight",
        ),
        (["double_blocks.0.img_attn.qkv.weight"], "x.safetensors holds no LoRA weights"),  # a Flux checkpoint
        (
            [*PEFT_SD1, "model.diffusion_model.out.2.weight"],
            "x.safetensors holds 1 tensors that are not LoRA weights, e.g. model.diffusion_model.out.2.weight, "
            "beside 6",
        ),
        ([*KOHYA_SD1[:2], *PEFT_SD1[:2]], "x.safetensors mixes kohya keys (lora_unet_down_blocks_0_"),
        (
            ["lora_unet_blocks_0_cross_attn_q.lora_down.weight", "lora_unet_blocks_0_cross_attn_q.lora_up.weight"],
            "x.safetensors holds LoRA weights for no base Homefleet recognises "
            "(keys like lora_unet_blocks_0_cross_attn_q",
        ),
    ],
)
def test_a_file_without_a_recognised_lora_is_no_adapter(keys: list[str], message: str) -> None:
    with pytest.raises(Rejected) as caught:
        recognise(keys, "x.safetensors")
    assert caught.value.reason == "not_an_adapter"
    assert caught.value.message.startswith(message), caught.value.message


def test_the_weight_file_of_a_folder() -> None:
    assert weight_file(["README.md", "b.safetensors", LORA_WEIGHTS]) == LORA_WEIGHTS
    assert weight_file(["sub/x.safetensors", "z.safetensors", "m.safetensors"]) == "m.safetensors"
    assert weight_file(["sub/x.safetensors", "README.md"]) is None


TE = "lora_te_text_model_encoder_layers_0_"


def kohya_pairs(*modules: str, prefix: str = TE) -> list[str]:
    return [f"{prefix}{m}.{part}" for m in modules for part in ("lora_down.weight", "lora_up.weight", "alpha")]


@pytest.mark.parametrize(
    "keys",
    [
        kohya_pairs("self_attn_k_proj"),  # diffusers: "Could not automatically infer state dict type"
        kohya_pairs("self_attn_k_proj", "mlp_fc1"),  # diffusers: fc1 loaded, k_proj left out silently
        [*KOHYA_SD1[:6], *kohya_pairs("self_attn_q_proj", "self_attn_v_proj")],
        [*KOHYA_SDXL, *kohya_pairs("self_attn_q_proj", prefix="lora_te2_text_model_encoder_layers_0_")],
    ],
)
def test_kohya_text_encoder_self_attention_without_out_proj_is_refused(keys: list[str]) -> None:
    """diffusers tells a kohya text encoder's layout by an ``out_proj`` key, per encoder
    (measured on tiny-sd in tests/integration/store/test_registry_adapters.py)."""
    with pytest.raises(Rejected) as caught:
        recognise(keys, "x.safetensors")
    assert caught.value.reason == "not_an_adapter"
    assert caught.value.message.startswith("x.safetensors's text-encoder keys (lora_te"), caught.value.message
    assert "adapt self-attention without its out_proj" in caught.value.message


@pytest.mark.parametrize(
    "keys",
    [
        kohya_pairs("self_attn_q_proj", "self_attn_k_proj", "self_attn_v_proj", "self_attn_out_proj", "mlp_fc1"),
        kohya_pairs("self_attn_k_proj", "self_attn_out_proj"),
        kohya_pairs("mlp_fc1", "mlp_fc2"),
    ],
)
def test_kohya_text_encoder_keys_diffusers_loads_whole_are_a_lora(keys: list[str]) -> None:
    assert recognise(keys, "x.safetensors").source_format == KOHYA
