"""Model variants: precision and quantization priced from safetensors headers (issue 7)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from app.core.variants import Variant, check_variant, parameter_counts, weights_bytes

CARD_24_GB = 24_000_000_000


def write_safetensors_header(path: Path, tensors: dict[str, tuple[str, list[int]]]) -> None:
    """A safetensors file with the given (dtype, shape) per tensor; data bytes are zeros."""
    sizes = {"F32": 4, "BF16": 2, "F16": 2}
    header, offset = {}, 0
    for name, (dtype, shape) in tensors.items():
        count = 1
        for dim in shape:
            count *= dim
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + count * sizes[dtype]]}
        offset += count * sizes[dtype]
    raw = json.dumps(header).encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(offset))


def test_parameter_counts_come_from_the_headers_per_component(tmp_path: Path) -> None:
    write_safetensors_header(tmp_path / "unet" / "diffusion_pytorch_model.safetensors",
                             {"a": ("F32", [4, 8]), "b": ("F32", [3])})
    write_safetensors_header(tmp_path / "vae" / "diffusion_pytorch_model.safetensors", {"c": ("BF16", [10, 10])})
    assert parameter_counts(tmp_path) == {"unet": 35, "vae": 100}


def test_weights_bytes_follow_precision_and_quantize_only_the_denoiser() -> None:
    counts = {"unet": 1000, "text_encoder": 100}
    assert weights_bytes(counts, Variant("fp32")) == 4400
    assert weights_bytes(counts, Variant("bf16")) == weights_bytes(counts, Variant("fp16")) == 2200
    assert weights_bytes(counts, Variant("bf16", "torchao-int8wo")) == 1000 + 200


def test_a_flux_sized_model_too_large_for_a_24_gb_card_in_bf16_fits_quantized() -> None:
    # flux-dev (docs/benchmarks.md, "Placement"): transformer ~12e9 params (~24 GB bf16) + T5 ~4.75e9 (~9.5 GB)
    counts = {"transformer": 12_000_000_000, "text_encoder_2": 4_750_000_000, "vae": 84_000_000}
    assert weights_bytes(counts, Variant("bf16")) > CARD_24_GB
    assert weights_bytes(counts, Variant("bf16", "torchao-int8wo")) < CARD_24_GB


def test_unknown_precision_or_quantization_is_refused_naming_the_choices() -> None:
    with pytest.raises(ValueError, match=r"precision must be one of fp32, bf16, fp16, got 'int3'"):
        check_variant("int3", None)
    with pytest.raises(ValueError, match=r"quantization must be one of torchao-int8wo or none, got 'nf4'"):
        check_variant("bf16", "nf4")
    assert check_variant("bf16", "torchao-int8wo").key() == "bf16+torchao-int8wo"
