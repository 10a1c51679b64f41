"""Load-time quantization through diffusers' quantization_config with torchao, on the CPU."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.context import ServerContext
from tasks.pipelines import load_pipeline


def test_a_bf16_int8_variant_loads_quantized_and_generates(tiny_models_dir: Path) -> None:
    import torch
    from torchao.quantization import Int8Tensor

    pipeline = load_pipeline(tiny_models_dir / "tiny-sd", precision="bf16", quantization="torchao-int8wo")
    linears = [m for m in pipeline.unet.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(isinstance(m.weight, Int8Tensor) for m in linears)
    assert pipeline.text_encoder.dtype == torch.bfloat16  # precision applies to every component
    image = pipeline(
        "a cat", num_inference_steps=1, width=32, height=32, generator=torch.Generator("cpu").manual_seed(0)
    ).images[0]
    assert image.size == (32, 32)


def test_an_unknown_quantization_is_refused_before_loading(tiny_models_dir: Path) -> None:
    with pytest.raises(ValueError, match="quantization must be one of torchao-int8wo"):
        load_pipeline(tiny_models_dir / "tiny-sd", quantization="bnb-nf4")


def test_a_variant_is_in_the_manifest_the_residency_key_and_the_memory_estimate(
    ctx: ServerContext, tiny_models_dir: Path
) -> None:
    full = ctx.registry.add(tiny_models_dir / "tiny-sd", model_id="sd-fp32")
    half = ctx.registry.add(
        tiny_models_dir / "tiny-sd", model_id="sd-bf16-int8", precision="bf16", quantization="torchao-int8wo"
    )
    m_full, m_half = ctx.registry.manifest(full.id), ctx.registry.manifest(half.id)
    assert (m_half.precision, m_half.quantization) == ("bf16", "torchao-int8wo")
    assert m_full.files == m_half.files  # the same files…
    assert m_full.key() != m_half.key()  # …are another resident pipeline
    fp32_bytes = ctx.registry.weights_bytes(full.id)
    safetensors_bytes = sum(f.size for f in m_full.files if f.path.endswith(".safetensors"))
    assert safetensors_bytes - 200_000 < fp32_bytes <= safetensors_bytes  # headers aside, exact
    assert ctx.registry.weights_bytes(half.id) < fp32_bytes / 2


def test_an_unknown_precision_is_refused_at_registration(ctx: ServerContext, tiny_models_dir: Path) -> None:
    from app.core.errors import Rejected

    with pytest.raises(Rejected, match="precision must be one of fp32, bf16, fp16, got 'fp8'") as refused:
        ctx.registry.add(tiny_models_dir / "tiny-sd", model_id="sd-fp8", precision="fp8")
    assert refused.value.reason == "invalid_variant"
