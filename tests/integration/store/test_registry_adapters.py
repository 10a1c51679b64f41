"""LoRA adapters in the registry (issue 22): registered like models (``--adapter-of FAMILY``),
with a manifest of digests, found by :meth:`Registry.adapter`, never a model of their own; the
tiny LoRA builder is deterministic."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.context import ServerContext
from app.core.digest import file_digest
from app.core.errors import NotFound, Rejected
from app.core.families import kinds_of
from app.devtools.tiny_models import make_tiny_lora


@pytest.fixture(scope="module")
def lora(tiny_models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_lora(tiny_models_dir / "tiny-sd", tmp_path_factory.mktemp("lora") / "sd-lora")


def test_an_adapter_is_a_registry_entry_with_its_base_family_and_a_manifest(ctx: ServerContext, lora: Path) -> None:
    record = ctx.registry.add(lora, "sd-lora", adapter_of="sd1")
    assert (record.family, record.kinds, record.pipeline_class) == ("sd1", ["adapter"], "LoRA")
    assert kinds_of(record.family, record.kinds) == ("adapter",)
    manifest = ctx.registry.manifest("sd-lora")
    weights = lora / "pytorch_lora_weights.safetensors"
    assert [(f.path, f.size, f.digest) for f in manifest.files] == [
        ("pytorch_lora_weights.safetensors", weights.stat().st_size, file_digest(weights))]
    assert ctx.registry.adapter("sd-lora").id == "sd-lora"
    assert ctx.registry.weights_bytes("sd-lora") == weights.stat().st_size - (
        8 + int.from_bytes(weights.read_bytes()[:8], "little"))  # fp32 parameters: the file less its header
    assert "sd-lora" in ctx.dispatcher.costs.model_profiles()  # placement prices its load by its bytes


def test_a_model_or_an_unknown_id_is_no_adapter(ctx: ServerContext, lora: Path, tiny_models_dir: Path) -> None:
    ctx.registry.add(tiny_models_dir / "tiny-sd", "tiny-sd")
    ctx.registry.add(lora, "sd-lora", adapter_of="sd1")
    with pytest.raises(NotFound, match=r"adapter 'tiny-sd' is a model, not an adapter; registered adapters: sd-lora"):
        ctx.registry.adapter("tiny-sd")
    with pytest.raises(NotFound, match=r"adapter 'nope' is not registered; registered adapters: sd-lora") as caught:
        ctx.registry.adapter("nope")
    assert caught.value.reason == "unknown_adapter"


def test_a_folder_that_is_no_adapter_or_an_unknown_family_is_refused(ctx: ServerContext, lora: Path,
                                                                        tiny_models_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(Rejected, match="is a diffusers pipeline") as caught:
        ctx.registry.add(tiny_models_dir / "tiny-sd", adapter_of="sd1")
    assert caught.value.reason == "not_an_adapter"
    (tmp_path / "empty").mkdir()
    with pytest.raises(Rejected, match=r"holds no \*.safetensors LoRA weights"):
        ctx.registry.add(tmp_path / "empty", adapter_of="sd1")
    with pytest.raises(Rejected, match="adapter family 'sd9' is unknown") as caught:
        ctx.registry.add(lora, adapter_of="sd9")
    assert caught.value.reason == "unknown_family"
    with pytest.raises(Rejected, match="takes no quantization"):
        ctx.registry.add(lora, adapter_of="sd1", quantization="torchao-int8wo")


def test_the_tiny_lora_is_deterministic(tiny_models_dir: Path, tmp_path: Path, lora: Path) -> None:
    again = make_tiny_lora(tiny_models_dir / "tiny-sd", tmp_path / "again")
    other = make_tiny_lora(tiny_models_dir / "tiny-sd", tmp_path / "other", seed=1)
    name = "pytorch_lora_weights.safetensors"
    assert (again / name).read_bytes() == (lora / name).read_bytes()
    assert (other / name).read_bytes() != (lora / name).read_bytes()
