"""The price of a variant (app/core/pricing.py: what registration stores in
``ModelRecord.weights_bytes``, what placement and the worker's residency use, R10/R15) equals
the bytes its loaded pipeline holds, measured on the tensors that ``tasks/pipelines.py``'s
``load_pipeline`` (the worker's load path) puts in memory: every component's parameters and
buffers, each tensor once, torchao's int8 weights by their inner tensors (int8 ``qdata`` + fp32
per-row ``scale``). Exact, for the tiny pipeline of every family and the tiny causal LMs, at
fp32, bf16, fp16 and int8 weight-only (over fp32 and bf16) where the family allows it.

What the figure covers that the safetensors headers do not: buffers computed at start-up
(CLIP's int64 ``position_ids``, rotary tables kept fp32), modules kept in fp32 at any precision
(Wan's ``_keep_in_fp32_modules``) or at fp16 (T5/UMT5's ``wo``), and int8 weight-only
quantizing only ``nn.Linear`` weights (convolutions, norms, biases, embeddings stay at the
precision) with a 4-byte scale per output row."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.core.families import FAMILIES, TEXT_FAMILIES
from app.core.pricing import component_bytes, loaded_bytes
from app.core.variants import UNQUANTIZABLE_TEXT_FAMILIES, Variant
from app.devtools.tiny_models import TINY_MODELS
from tasks.pipelines import load_pipeline
from tests.helpers import held_bytes

FOLDERS = {family: name for name, family in TINY_MODELS.items()}
DIFFUSION_FAMILIES = [name for name in FAMILIES if name not in TEXT_FAMILIES]
VARIANTS = [
    Variant("fp32"),
    Variant("bf16"),
    Variant("fp16"),
    Variant("fp32", "torchao-int8wo"),
    Variant("bf16", "torchao-int8wo"),
]


def test_every_registered_family_has_a_tiny_pipeline_here() -> None:
    assert set(DIFFUSION_FAMILIES) == set(FOLDERS) and len(FOLDERS) == 9


@pytest.mark.parametrize("variant", VARIANTS, ids=Variant.key)
@pytest.mark.parametrize("family", DIFFUSION_FAMILIES)
def test_the_price_of_every_family_and_variant_is_what_its_loaded_pipeline_holds(
    family: str, variant: Variant, tiny_families_dir: Path
) -> None:
    folder = tiny_families_dir / FOLDERS[family]
    held = held_bytes(load_pipeline(folder, variant.precision, variant.quantization))
    priced = component_bytes(folder, variant)
    assert priced == held, "per component"
    assert loaded_bytes(folder, variant) == sum(held.values())


@pytest.mark.parametrize("variant", VARIANTS, ids=Variant.key)
@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt2"])
def test_the_price_of_a_causal_lm_is_what_the_loaded_model_holds(
    family: str, variant: Variant, tiny_text_dir: Path
) -> None:
    if variant.quantization and family in UNQUANTIZABLE_TEXT_FAMILIES:
        pytest.skip("gpt2's Conv1D layers are refused a quantization (app/core/variants.py)")
    folder = tiny_text_dir / f"tiny-{family}"
    held = held_bytes(load_pipeline(folder, variant.precision, variant.quantization))
    assert loaded_bytes(folder, variant) == held[""]


def test_int8_weight_only_quantizes_only_linear_weights_and_adds_a_scale_per_row(tiny_families_dir: Path) -> None:
    """The old 1-byte-per-denoiser-parameter price was less than half of what sd1's quantized
    UNet holds: its convolutions stay fp32. The price is the loaded bytes, not that."""
    folder = tiny_families_dir / FOLDERS["sd1"]
    int8 = component_bytes(folder, Variant("fp32", "torchao-int8wo"))
    fp32 = component_bytes(folder, Variant("fp32"))
    unet_parameters = fp32["unet"] // 4
    assert int8["unet"] > 2 * unet_parameters  # more than twice the one-byte figure
    assert int8["unet"] < fp32["unet"] and {k: v for k, v in int8.items() if k != "unet"} == {
        k: v for k, v in fp32.items() if k != "unet"
    }  # only the denoiser is quantized


def test_wan_keeps_its_fp32_modules_at_bf16(tiny_families_dir: Path) -> None:
    folder = tiny_families_dir / FOLDERS["wan"]
    fp32, bf16 = component_bytes(folder, Variant("fp32")), component_bytes(folder, Variant("bf16"))
    assert bf16["transformer"] > fp32["transformer"] // 2  # _keep_in_fp32_modules and its rotary buffers
    assert bf16["vae"] == fp32["vae"] // 2


def test_a_lora_adapter_folder_is_priced_by_its_header_at_the_precision(tmp_path: Path) -> None:
    import torch
    from safetensors.torch import save_file

    save_file(
        {"a.lora_A.weight": torch.zeros(4, 8), "a.lora_B.weight": torch.zeros(8, 4, dtype=torch.float16)},
        str(tmp_path / "pytorch_lora_weights.safetensors"),
    )
    assert loaded_bytes(tmp_path, Variant("fp32")) == 64 * 4
    assert loaded_bytes(tmp_path, Variant("bf16")) == 64 * 2


def test_a_folder_that_is_no_model_is_refused_naming_it(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="neither a diffusers folder"):
        loaded_bytes(tmp_path, Variant())
