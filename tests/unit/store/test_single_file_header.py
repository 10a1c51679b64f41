"""A single-file checkpoint cut short (a half-finished download) is said to be one, with the fix;
a file of another format is not a safetensors checkpoint."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from app.core.errors import Rejected
from app.store.single_file import read_keys


def test_a_truncated_checkpoint_is_incomplete_and_another_format_is_not_a_checkpoint(tmp_path: Path) -> None:
    whole = tmp_path / "model.safetensors"
    save_file({"unet.weight": np.zeros((64, 64), dtype=np.float32)}, str(whole))
    assert read_keys(whole) == {"unet.weight": [64, 64]}
    cut = tmp_path / "model-cut.safetensors"
    cut.write_bytes(whole.read_bytes()[: whole.stat().st_size // 2])
    with pytest.raises(Rejected) as truncated:
        read_keys(cut)
    assert truncated.value.reason == "incomplete_checkpoint"
    assert "a truncated or damaged file (an interrupted download? download it again)" in truncated.value.message
    other = tmp_path / "notes.safetensors"
    other.write_bytes(b"this is a text file, not weights")
    with pytest.raises(Rejected) as refused:
        read_keys(other)
    assert refused.value.reason == "not_a_checkpoint" and "is not a safetensors checkpoint" in refused.value.message
