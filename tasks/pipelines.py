"""Loading diffusers pipelines from a worker's own model folder, never from a hub."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")


def quiet() -> None:
    """Silence diffusers/transformers progress bars and info logs (workers log per job instead)."""
    import diffusers
    import transformers

    diffusers.utils.logging.disable_progress_bar()
    diffusers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()


def load_pipeline(folder: Path) -> Any:
    """``DiffusionPipeline.from_pretrained(folder, local_files_only=True)`` on the CPU.

    Raises ``OSError`` when a file is missing or unreadable.
    """
    from diffusers import DiffusionPipeline

    pipeline = DiffusionPipeline.from_pretrained(str(folder), local_files_only=True)
    pipeline.set_progress_bar_config(disable=True)
    return pipeline


def png_bytes(image: Any, provenance: dict[str, Any]) -> bytes:
    """Encode a PIL image as PNG with the job's provenance in a ``homefleet`` text chunk."""
    from PIL.PngImagePlugin import PngInfo

    info = PngInfo()
    info.add_text("homefleet", json.dumps(provenance, sort_keys=True))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", pnginfo=info)
    return buffer.getvalue()
