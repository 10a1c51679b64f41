"""Exact weight bytes of a registered model from its safetensors headers, without loading it
(docs/design.md, "Residency"; docs/operations.md "Memory from headers": a safetensors file starts
with an 8-byte little-endian length N and N bytes of JSON; the sum of
``data_offsets[1] - data_offsets[0]`` over tensors equals the loaded parameter bytes).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

from app.core.errors import IntegrityFailure

MAX_HEADER_BYTES = 100_000_000


def safetensors_header(path: Path) -> dict[str, Any]:
    """The tensors of one ``.safetensors`` file as its header lists them, read without the
    tensor data: ``{name: {"dtype": ..., "shape": [...], "data_offsets": [start, end]}}``
    (the ``__metadata__`` entry left out). The one place headers are read (weights, variants,
    LoRA layouts: app/core/lora_files.py).

    Raises:
        IntegrityFailure: the file is shorter than its header, the header is larger than
            :data:`MAX_HEADER_BYTES`, or it is not a JSON object of tensors.
    """
    with path.open("rb") as handle:
        head = handle.read(8)
        if len(head) != 8:
            raise IntegrityFailure(f"{path} is not a safetensors file: shorter than its 8-byte header length")
        (length,) = struct.unpack("<Q", head)
        if length > MAX_HEADER_BYTES:
            raise IntegrityFailure(f"{path}: safetensors header of {length} bytes exceeds {MAX_HEADER_BYTES}")
        raw = handle.read(length)
    if len(raw) != length:
        raise IntegrityFailure(f"{path}: safetensors header truncated ({len(raw)} of {length} bytes)")
    try:
        header = json.loads(raw)
    except ValueError as error:
        raise IntegrityFailure(f"{path}: safetensors header is not JSON ({error})") from error
    if not isinstance(header, dict) or not all(
        isinstance(entry, dict) for name, entry in header.items() if name != "__metadata__"
    ):
        raise IntegrityFailure(f"{path}: safetensors header is not a JSON object of tensors")
    header.pop("__metadata__", None)
    return header


def safetensors_weight_bytes(path: Path) -> int:
    """Summed tensor bytes of one ``.safetensors`` file, read from its header only.

    Raises:
        IntegrityFailure: the header is truncated, too large or not a safetensors header.
    """
    total = 0
    for tensor in safetensors_header(path).values():
        start, end = tensor["data_offsets"]
        total += int(end) - int(start)
    return total


def model_weight_bytes(folder: Path) -> int:
    """Summed weight bytes of every ``.safetensors`` file under a model folder (0 if none)."""
    return sum(safetensors_weight_bytes(p) for p in sorted(folder.rglob("*.safetensors")))


def looks_like_safetensors(path: Path) -> bool:
    """Whether ``path`` begins as a safetensors file does: an 8-byte little-endian header length
    that fits the file, then a JSON object (a file that does and yet cannot be read is damaged
    or cut short, not of another format)."""
    with open(path, "rb") as handle:
        start = handle.read(9)
    if len(start) < 9:
        return False
    length = int.from_bytes(start[:8], "little")
    return 2 <= length <= path.stat().st_size - 8 and start[8:9] == b"{"


def check_loadable(path: Path) -> None:
    """Open ``path`` with safetensors' own reader, which refuses a header it cannot load
    (offsets, shapes, dtypes) and a file its tensors do not cover exactly (a truncated
    download); nothing is read beyond the header.

    Raises:
        IntegrityFailure: naming the file and the reader's error.
    """
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt"):
            pass
    except (SafetensorError, OSError, ValueError) as error:
        raise IntegrityFailure(f"{path.name}: {error}") from error
