"""Model variants: precision and quantization (their price: app/core/pricing.py,
tests/integration/fleet/test_family_memory.py)."""

from __future__ import annotations

import pytest

from app.core.variants import check_variant


def test_unknown_precision_or_quantization_is_refused_naming_the_choices() -> None:
    with pytest.raises(ValueError, match=r"precision must be one of fp32, bf16, fp16, got 'int3'"):
        check_variant("int3", None)
    with pytest.raises(ValueError, match=r"quantization must be one of torchao-int8wo or none, got 'nf4'"):
        check_variant("bf16", "nf4")
    assert check_variant("bf16", "torchao-int8wo").key() == "bf16+torchao-int8wo"
