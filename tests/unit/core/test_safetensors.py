"""Safetensors headers read without the tensor data (app/core/safetensors.py), and what is
refused: a file shorter than its length prefix, a truncated or non-JSON header, JSON that is
not a table of tensors."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from app.core.errors import IntegrityFailure
from app.core.safetensors import safetensors_header, safetensors_weight_bytes


def test_the_header_lists_each_tensor_without_the_metadata(tmp_path: Path) -> None:
    path = tmp_path / "a.safetensors"
    save_file(
        {"a.lora_down.weight": np.zeros((4, 8), np.float32), "a.alpha": np.array(4.0, np.float32)},
        str(path),
        metadata={"format": "pt"},
    )
    header = safetensors_header(path)
    assert sorted(header) == ["a.alpha", "a.lora_down.weight"]
    assert (header["a.lora_down.weight"]["dtype"], header["a.lora_down.weight"]["shape"]) == ("F32", [4, 8])
    assert header["a.alpha"]["shape"] == []
    assert safetensors_weight_bytes(path) == 4 * 8 * 4 + 4


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"abc", "is not a safetensors file: shorter than its 8-byte header length"),
        (struct.pack("<Q", 50) + b"{}", "safetensors header truncated (2 of 50 bytes)"),
        (struct.pack("<Q", 5) + b"hello", "safetensors header is not JSON"),
        (struct.pack("<Q", 2) + b"[]", "safetensors header is not a JSON object of tensors"),
        (struct.pack("<Q", 9) + b'{"a": 1}' + b" ", "safetensors header is not a JSON object of tensors"),
        (struct.pack("<Q", 200_000_000) + b"{}", "safetensors header of 200000000 bytes exceeds 100000000"),
    ],
)
def test_a_file_that_is_no_safetensors_is_refused_naming_why(tmp_path: Path, content: bytes, message: str) -> None:
    path = tmp_path / "garbage.safetensors"
    path.write_bytes(content)
    with pytest.raises(IntegrityFailure, match=f"^{path}.*{message}".replace("(", r"\(").replace(")", r"\)")):
        safetensors_header(path)
