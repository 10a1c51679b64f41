"""Exact weight bytes of a registered model from its safetensors headers, without loading it
(docs/design.md, "Residency"; docs/operations.md "Memory from headers": a safetensors file starts
with an 8-byte little-endian length N and N bytes of JSON; the sum of
``data_offsets[1] - data_offsets[0]`` over tensors equals the loaded parameter bytes).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from app.core.errors import IntegrityFailure

MAX_HEADER_BYTES = 100_000_000


def safetensors_weight_bytes(path: Path) -> int:
    """Summed tensor bytes of one ``.safetensors`` file, read from its header only.

    Raises:
        IntegrityFailure: the header is truncated, too large or not a safetensors header.
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
    total = 0
    for name, tensor in header.items():
        if name == "__metadata__":
            continue
        start, end = tensor["data_offsets"]
        total += int(end) - int(start)
    return total


def model_weight_bytes(folder: Path) -> int:
    """Summed weight bytes of every ``.safetensors`` file under a model folder (0 if none)."""
    return sum(safetensors_weight_bytes(p) for p in sorted(folder.rglob("*.safetensors")))
