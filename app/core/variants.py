"""Model variants: the precision (fp32 / bf16 / fp16) and load-time quantization a model is
registered with, and the weight memory that follows from them.

A variant is part of a model's identity on a worker: the residency key of a loaded pipeline
includes it (a bf16 copy is not the fp32 one), and so does the memory estimate.

Quantization goes through diffusers' ``quantization_config`` with **torchao** (checked here:
torchao 0.18 with torch 2.13.0+cpu and diffusers 0.42.1 loads a UNet with int8 weight-only
``Int8Tensor`` weights and generates on the CPU). bitsandbytes 0.50 installs, but diffusers'
bitsandbytes quantizer refuses to load without a CUDA/XPU/MPS device ("No GPU found. A GPU
is needed for quantization."), so it cannot run on CPU workers or in this project's tests.

Memory: :mod:`app.core.pricing` prices a variant at the bytes its loaded pipeline holds (every
component at its real dtype, a quantized denoiser at torchao's bytes), once at registration.
"""

from __future__ import annotations

from dataclasses import dataclass


#: precision -> torch dtype attribute name
TORCH_DTYPES: dict[str, str] = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
#: precision -> bytes per floating value (a KV cache's, a LoRA adapter's)
PRECISION_BYTES: dict[str, float] = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0}
#: quantization -> (diffusers backend, torchao config class)
QUANTIZATIONS: dict[str, tuple[str, str]] = {
    "torchao-int8wo": ("torchao", "Int8WeightOnlyConfig"),
}
#: the components a quantization applies to (the denoiser: most of the weights)
DENOISERS: tuple[str, ...] = ("transformer", "unet")
#: Text families whose linear layers are no ``nn.Linear`` (GPT-2's ``Conv1D``): torchao leaves
#: them as they are, so a quantized variant is refused for them (checked: 0 weights quantized).
UNQUANTIZABLE_TEXT_FAMILIES: frozenset[str] = frozenset({"gpt2"})


@dataclass(frozen=True)
class Variant:
    """How a model is loaded: ``precision`` of every component, optional ``quantization`` of the denoiser."""

    precision: str = "fp32"
    quantization: str | None = None

    def key(self) -> str:
        """Short text for residency keys and logs, e.g. ``bf16+torchao-int8wo``."""
        return self.precision + (f"+{self.quantization}" if self.quantization else "")


def check_variant(precision: str, quantization: str | None) -> Variant:
    """Validate a variant. Raises ``ValueError`` naming the field, the value and the choices."""
    if precision not in PRECISION_BYTES:
        raise ValueError(f"precision must be one of {', '.join(PRECISION_BYTES)}, got {precision!r}")
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)} or none, got {quantization!r}")
    return Variant(precision, quantization)


def check_family_variant(family: str, quantization: str | None) -> None:
    """Raises ``ValueError`` when ``family`` cannot be loaded with ``quantization``."""
    if quantization is not None and family in UNQUANTIZABLE_TEXT_FAMILIES:
        raise ValueError(f"quantization {quantization!r} does not apply to family {family!r}: its linear layers are "
                         "Conv1D, which torchao's weight-only configs leave unquantized; register it unquantized")


def quantization_spec(quantization: str) -> tuple[str, str]:
    """(diffusers backend, torchao config class name) of ``quantization``. Raises ``ValueError``."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {quantization!r}")
    return QUANTIZATIONS[quantization]
