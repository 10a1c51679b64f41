"""The worker's adapter helpers that need no pipeline: which file of an adapter's
manifest is loaded, and the embedded provenance of a job's adapters."""

from __future__ import annotations

import pytest

from app.core.lora_files import LORA_WEIGHTS
from app.core.protocol import AdapterClaim, Manifest, ManifestFile
from tasks.adapters import provenance_entries, weight_name
from tasks.provenance import embedded_provenance


def manifest(adapter_id: str, *paths: str) -> Manifest:
    return Manifest(
        model_id=adapter_id,
        family="sd1",
        kinds=["adapter"],
        files=[ManifestFile(path=p, size=1, digest=f"blake3:{i:064x}") for i, p in enumerate(paths)],
    )


def test_the_diffusers_file_is_loaded_first_else_the_first_safetensors_at_the_top() -> None:
    assert weight_name(manifest("a", "README.md", "b.safetensors", LORA_WEIGHTS)) == LORA_WEIGHTS
    assert weight_name(manifest("a", "sub/x.safetensors", "z.safetensors", "m.safetensors")) == "m.safetensors"


def test_provenance_names_each_adapter_with_its_scale_and_digests_in_order() -> None:
    adapters = [
        AdapterClaim(manifest=manifest("b", LORA_WEIGHTS), scale=0.5),
        AdapterClaim(manifest=manifest("a", LORA_WEIGHTS, "c.json"), scale=1.0),
    ]
    entries = provenance_entries(adapters)
    assert entries == [
        {"id": "b", "scale": 0.5, "files": {LORA_WEIGHTS: "blake3:" + "0" * 64}},
        {"id": "a", "scale": 1.0, "files": {LORA_WEIGHTS: "blake3:" + "0" * 64, "c.json": "blake3:" + "0" * 63 + "1"}},
    ]
    base = manifest("tiny-sd", "unet/x.safetensors")
    record = embedded_provenance(
        model_id="tiny-sd",
        manifest=base,
        kind="txt2img",
        params={"seed": 1},
        inputs={},
        machine="m1",
        device="cpu",
        adapters=entries,
    )
    assert record["adapters"] == entries
    plain = embedded_provenance(
        model_id="tiny-sd", manifest=base, kind="txt2img", params={"seed": 1}, inputs={}, machine="m1", device="cpu"
    )
    assert "adapters" not in plain  # without adapters the record is as before (same bytes)


def test_an_adapter_without_safetensors_file_names_it() -> None:
    with pytest.raises(ValueError, match=r"adapter a has no .safetensors file in its manifest"):
        weight_name(manifest("a", "README.md", "sub/x.safetensors"))
