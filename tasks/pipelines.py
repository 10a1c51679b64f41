"""Loading diffusers pipelines from a worker's own model folder, never from a hub, at the
precision and quantization the model variant names (see :mod:`app.core.variants`)."""

from __future__ import annotations

import io
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app.core.processors import (
    QWEN_VL_PROCESSOR,
    load_image_processor_only,
    video_processors_available,
)
from app.core.quiet import quiet_import_warnings
from app.core.textgen import is_text_folder, load_tokenizer
from app.core.variants import DENOISERS, TORCH_DTYPES, quantization_spec, stored_variant

OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}


def go_offline() -> None:
    """Tell huggingface_hub and transformers never to reach a hub in this process. Called by
    the worker's entry point (not at import: the API process serves Hugging Face clients)."""
    for name, value in OFFLINE_ENV.items():
        os.environ.setdefault(name, value)


def quiet() -> None:
    """Silence diffusers/transformers progress bars and info logs (workers log per job instead)."""
    quiet_import_warnings()
    import diffusers
    import transformers

    diffusers.utils.logging.disable_progress_bar()
    diffusers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()


def load_pipeline(folder: Path, precision: str = "fp32", quantization: str | None = None) -> Any:
    """``DiffusionPipeline.from_pretrained(folder, local_files_only=True, dtype=…)`` on the CPU;
    a transformers causal-LM folder gives a :class:`TextModel` (:func:`load_text_model`).

    ``precision`` is ``fp32`` | ``bf16`` | ``fp16`` (the dtype of every component);
    ``quantization`` (e.g. ``torchao-int8wo``) quantizes the denoiser (``unet`` or
    ``transformer``) at load time through diffusers' ``quantization_config``. A folder registered
    with a precision's variant files (``unet/diffusion_pytorch_model.fp16.safetensors``,
    :func:`app.core.variants.stored_variant`) is loaded with diffusers' ``variant=``; its
    components without such files load their full-precision files (docs/operations.md, "What
    registration takes").

    Raises ``OSError`` when a file is missing or unreadable, ``ValueError`` for an unknown
    precision or quantization, ``ImportError`` when the quantization backend is not installed.
    """
    import torch

    if precision not in TORCH_DTYPES:
        raise ValueError(f"precision must be one of {', '.join(TORCH_DTYPES)}, got {precision!r}")
    dtype = getattr(torch, TORCH_DTYPES[precision])
    if is_text_folder(folder):
        return load_text_model(folder, dtype, quantization)
    from diffusers import DiffusionPipeline

    kwargs: dict[str, Any] = {"local_files_only": True, "dtype": dtype}
    if quantization is not None:
        kwargs["quantization_config"] = _quantization_config(folder, quantization)
    if (variant := stored_variant(folder)) is not None:
        kwargs["variant"] = variant
    kwargs.update(_components_without_torchvision(folder))
    pipeline = DiffusionPipeline.from_pretrained(str(folder), **kwargs)
    pipeline.set_progress_bar_config(disable=True)
    return pipeline


@dataclass
class TextModel:
    """A resident causal LM: the transformers model and its own tokenizer."""

    model: Any
    tokenizer: Any

    def to(self, device: str) -> TextModel:
        """Move the model to ``device`` (``cuda``, ``mps``); the tokenizer stays on the CPU."""
        self.model = self.model.to(device)
        return self


def load_text_model(folder: Path, dtype: Any, quantization: str | None = None) -> TextModel:
    """``AutoModelForCausalLM`` and ``AutoTokenizer`` from ``folder``, local files only, in eval
    mode; ``quantization`` (``app.core.variants.QUANTIZATIONS``) through transformers'
    ``TorchAoConfig`` at load time (its linear layers' weights, as ``weights_bytes`` prices them).

    Raises ``OSError`` for missing files, ``ValueError`` for a quantization backend other than torchao.
    """
    from transformers import AutoModelForCausalLM

    extra: dict[str, Any] = {}
    if quantization is not None:
        import torchao.quantization
        from transformers import TorchAoConfig

        backend, config_class = quantization_spec(quantization)
        if backend != "torchao":
            raise ValueError(f"quantization backend {backend!r} is not supported here; supported: torchao")
        extra["quantization_config"] = TorchAoConfig(quant_type=getattr(torchao.quantization, config_class)())
    model = AutoModelForCausalLM.from_pretrained(str(folder), local_files_only=True, dtype=dtype, **extra)
    model.eval()
    return TextModel(model=model, tokenizer=load_tokenizer(folder))


def _components_without_torchvision(folder: Path) -> dict[str, Any]:
    """Components loaded here instead of by diffusers: a Qwen2-VL ``processor`` (Qwen-Image-Edit)
    when transformers cannot build video processors (no torchvision), loaded with its image and
    text halves only (:mod:`app.core.processors`); the pipeline feeds it images and text only."""
    index = json.loads((folder / "model_index.json").read_text())
    if tuple(index.get("processor") or ()) == QWEN_VL_PROCESSOR and not video_processors_available():
        return {"processor": load_image_processor_only(folder / "processor")}
    return {}


def _quantization_config(folder: Path, quantization: str) -> Any:
    """diffusers ``PipelineQuantizationConfig`` for ``quantization`` applied to the denoiser."""
    import torchao.quantization
    from diffusers import PipelineQuantizationConfig, TorchAoConfig

    backend, config_class = quantization_spec(quantization)
    if backend != "torchao":
        raise ValueError(f"quantization backend {backend!r} is not supported here; supported: torchao")
    index = json.loads((folder / "model_index.json").read_text())
    config = getattr(torchao.quantization, config_class)
    # torchao configs are objects (diffusers 0.42 TorchAoConfig wants an AOBaseConfig instance)
    return PipelineQuantizationConfig(
        quant_mapping={name: TorchAoConfig(config()) for name in DENOISERS if name in index},
    )


def decode_image(data: bytes) -> Any:
    """Decode uploaded image bytes (PNG/JPEG/WebP) into an RGB PIL image, upright: turned as its
    EXIF orientation says (``PIL.ImageOps.exif_transpose``, as diffusers' ``load_image`` does; a
    phone's portrait photo is stored landscape), the size the server journaled
    (``app.jobs.validation.image_size``). Raises ``PIL.UnidentifiedImageError`` for bytes that
    are no image."""
    from PIL import Image, ImageOps

    with Image.open(io.BytesIO(data)) as image:
        return ImageOps.exif_transpose(image).convert("RGB")


def decode_mask(data: bytes) -> Any:
    """Decode an uploaded inpainting mask into a binary ``L`` PIL image, upright as
    :func:`decode_image`: greyscale (alpha ignored), 255 where the value is at least 128
    (repaint), else 0 (keep); diffusers' mask processor binarizes at the same half. Raises
    ``PIL.UnidentifiedImageError`` for bytes that are no image."""
    from PIL import Image, ImageOps

    with Image.open(io.BytesIO(data)) as image:
        return ImageOps.exif_transpose(image).convert("L").point(lambda value: 255 if value >= 128 else 0)


def png_bytes(image: Any, provenance: dict[str, Any]) -> bytes:
    """Encode a PIL image as PNG with the job's provenance in a ``homefleet`` text chunk (JSON)
    and, for other tools, in AUTOMATIC1111's ``parameters`` text chunk (``tasks.provenance.a1111_parameters``)."""
    from PIL.PngImagePlugin import PngInfo

    from tasks.provenance import a1111_parameters

    info = PngInfo()
    info.add_text("homefleet", json.dumps(provenance, sort_keys=True))
    info.add_text("parameters", a1111_parameters(provenance, image.size))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", pnginfo=info)
    return buffer.getvalue()
