"""The memory estimate from safetensors headers (docs/design.md, "Residency", R10/R11) covers every family's
components (issue 19): for each tiny pipeline of every registered pipeline class, the weight
bytes read from the headers (what placement prices, app/fleet/costs.py, and the variant's
figure, app/core/variants.py) equal the bytes of the parameters and buffers the real loader puts
in memory, text encoders (CLIP, T5/UMT5, Qwen2.5-VL), VAEs, motion adapters and denoisers
included."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.core.families import FAMILIES, TEXT_FAMILIES
from app.core.safetensors import model_weight_bytes
from app.core.variants import Variant, parameter_counts, weights_bytes
from app.devtools.tiny_models import TINY_MODELS
from tasks.pipelines import load_pipeline

FOLDERS = {family: name for name, family in TINY_MODELS.items()}
TEXT_ENCODERS = {"sd1": 1, "sdxl": 2, "flux": 2, "sd1-pix2pix": 1, "qwen-image": 1, "sd-upscale": 1,
                 "animatediff": 1, "wan": 1, "flux-kontext": 2}

DIFFUSION_FAMILIES = [name for name in FAMILIES if name not in TEXT_FAMILIES]  # text: tests/unit/tasks/test_text_kind.py


def loaded_bytes(pipeline: object) -> dict[str, int]:
    """Bytes per component of a loaded pipeline: every tensor of its state (parameters and
    persistent buffers; tied ones once). Buffers a module computes at start-up (position ids,
    rotary tables) are no weights: no file holds them."""
    import torch

    sizes: dict[str, int] = {}
    for name, component in pipeline.components.items():  # type: ignore[attr-defined]
        if isinstance(component, torch.nn.Module):
            tensors = {t.data_ptr(): t for t in component.state_dict().values()}
            sizes[name] = sum(t.numel() * t.element_size() for t in tensors.values())
    return sizes


@pytest.mark.parametrize("family", DIFFUSION_FAMILIES)
def test_header_estimate_equals_loaded_bytes_for_every_component(family: str, tiny_families_dir: Path) -> None:
    folder = tiny_families_dir / FOLDERS[family]
    loaded = loaded_bytes(load_pipeline(folder))
    counts = parameter_counts(folder)
    assert sum(1 for name in counts if name.startswith("text_encoder")) == TEXT_ENCODERS[family]
    assert set(counts) == {name for name, size in loaded.items() if size}, "a component the headers miss"
    assert model_weight_bytes(folder) == sum(loaded.values())
    assert weights_bytes(counts, Variant("fp32")) == sum(loaded.values())
    assert weights_bytes(counts, Variant("bf16")) == sum(loaded.values()) // 2
