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

import json
import re
from dataclasses import dataclass
from pathlib import Path

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
        raise ValueError(
            f"quantization {quantization!r} does not apply to family {family!r}: its linear layers are "
            "Conv1D, which torchao's weight-only configs leave unquantized; register it unquantized"
        )


def quantization_spec(quantization: str) -> tuple[str, str]:
    """(diffusers backend, torchao config class name) of ``quantization``. Raises ``ValueError``."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {quantization!r}")
    return QUANTIZATIONS[quantization]


#: precision -> the diffusers ``variant`` whose files a model registered at that precision takes
#: where a component has them (``diffusion_pytorch_model.fp16.safetensors``, ``model.bf16-00001-of-00002
#: .safetensors``); fp32 takes the full-precision files (docs/operations.md, "What registration takes").
PRECISION_FILE_VARIANTS: dict[str, str] = {"fp16": "fp16", "bf16": "bf16"}

_VARIANT_FILE = re.compile(r"^[^.]+\.(?P<variant>[a-z0-9_]+?)(-\d{5}-of-\d{5})?\.(safetensors|bin)$")


def stored_variant(folder: Path) -> str | None:
    """The diffusers ``variant`` (``fp16``, ``bf16``) whose weight files a stored diffusers
    folder holds in any component folder, e.g. ``unet/diffusion_pytorch_model.fp16.safetensors``,
    or None (full-precision names only, or not a diffusers folder). ``from_pretrained`` must be
    given it (``variant=``) to load those files; a component without them loads its plain files
    (diffusers' ``_identify_model_variants``)."""
    index = folder / "model_index.json"
    try:
        components = [name for name, entry in json.loads(index.read_text()).items() if isinstance(entry, list)]
    except (OSError, ValueError, AttributeError):
        return None
    for name in components:
        component = folder / name
        if not component.is_dir():
            continue
        for child in sorted(component.iterdir()):
            found = _VARIANT_FILE.match(child.name)
            if found and found["variant"] in PRECISION_FILE_VARIANTS.values():
                return found["variant"]
    return None
