"""The registry and manifest (issue 2 item 3; R4/R5 server side), on real tiny models."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from app.context import ServerContext
from app.core.digest import file_digest
from app.core.errors import Conflict, NotFound, Rejected


@pytest.fixture
def ctx(sql_ctx: ServerContext) -> ServerContext:
    """These tests are about SQL: each runs on SQLite and on PostgreSQL (tests/conftest.py)."""
    return sql_ctx


def test_a_registered_model_has_a_full_manifest(ctx: ServerContext, tiny_models_dir: Path) -> None:
    source = tiny_models_dir / "tiny-sd"
    record = ctx.registry.add(source)
    assert (record.id, record.family, record.kinds) == ("tiny-sd", "sd1", ["txt2img", "img2img", "inpaint"])
    manifest = ctx.registry.manifest(record.id)
    source_files = sorted(p.relative_to(source).as_posix() for p in source.rglob("*") if p.is_file())
    assert [f.path for f in manifest.files] == source_files
    for entry in manifest.files:
        assert entry.size == (source / entry.path).stat().st_size
        assert entry.digest == file_digest(source / entry.path)
    assert record.total_bytes == sum(f.size for f in manifest.files)
    assert any(f.path.endswith(".safetensors") for f in manifest.files)


def test_ids_are_minted_by_the_server_and_never_reused(ctx: ServerContext, tiny_models_dir: Path) -> None:
    first = ctx.registry.add(tiny_models_dir / "tiny-sd")
    second = ctx.registry.add(tiny_models_dir / "tiny-sd", precision="bf16")  # another variant: another id
    assert (first.id, second.id) == ("tiny-sd", "tiny-sd-2")
    with pytest.raises(Rejected, match="already registered"):
        ctx.registry.add(tiny_models_dir / "tiny-sd", model_id="tiny-sd")
    with pytest.raises(Rejected, match="model id must match"):
        ctx.registry.add(tiny_models_dir / "tiny-sd", model_id="Bad Id")


def test_a_folder_that_is_not_a_pipeline_is_refused(ctx: ServerContext, tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(Rejected, match="model_index.json"):
        ctx.registry.add(tmp_path / "empty")
    odd = tmp_path / "odd"
    odd.mkdir()
    (odd / "model_index.json").write_text(json.dumps({"_class_name": "SomethingPipeline"}))
    with pytest.raises(Rejected, match="SomethingPipeline"):
        ctx.registry.add(odd)
    with pytest.raises(NotFound, match="not registered"):
        ctx.registry.get("odd")


def test_r5_a_changed_server_file_is_hashed_again(ctx: ServerContext, tiny_models_dir: Path) -> None:
    record = ctx.registry.add(tiny_models_dir / "tiny-sd")
    before = {f.path: f.digest for f in ctx.registry.manifest(record.id).files}
    config = ctx.registry.folder(record.id) / "unet" / "config.json"
    text = config.read_text()
    replacement = config.with_suffix(".new")
    replacement.write_text(text.replace("{", "{ ", 1))  # a new inode, a new size
    shutil.move(replacement, config)
    after = {f.path: f.digest for f in ctx.registry.manifest(record.id).files}
    assert after["unet/config.json"] == file_digest(config) != before["unet/config.json"]
    assert {k: v for k, v in after.items() if k != "unet/config.json"} == {
        k: v for k, v in before.items() if k != "unet/config.json"
    }


def test_r5_adding_the_same_folder_again_names_the_registered_model_and_copies_nothing(
        ctx: ServerContext, tiny_models_dir: Path, tmp_path: Path) -> None:
    """Running ``homefleet models add FOLDER`` twice must not leave a second, silent copy under a
    new id (a second full copy of the weights on the server's disk, and a model id nobody
    chose): the same files and variant without an explicit id are refused naming the first
    id. A changed file, another variant or an explicit id register a new model."""
    first = ctx.registry.add(tiny_models_dir / "tiny-sd")
    before = sorted(p.name for p in ctx.settings.models_dir.iterdir())
    with pytest.raises(Conflict, match="already registered as 'tiny-sd'") as refused:
        ctx.registry.add(tiny_models_dir / "tiny-sd")
    assert refused.value.reason == "model_already_registered"
    assert sorted(p.name for p in ctx.settings.models_dir.iterdir()) == before  # no copy left behind
    assert [m.id for m in ctx.registry.list()] == [first.id]

    changed = tmp_path / "tiny-sd"
    shutil.copytree(tiny_models_dir / "tiny-sd", changed)
    (changed / "model_index.json").write_text((changed / "model_index.json").read_text() + "\n")
    assert ctx.registry.add(changed).id == "tiny-sd-2"
    assert ctx.registry.add(tiny_models_dir / "tiny-sd", quantization="torchao-int8wo").id == "tiny-sd-3"
    assert ctx.registry.add(tiny_models_dir / "tiny-sd", model_id="tiny-sd-copy").id == "tiny-sd-copy"


def test_r15_the_loaded_bytes_are_priced_once_at_registration_and_carried_in_the_manifest(
        ctx: ServerContext, tiny_models_dir: Path) -> None:
    """The variant's price (app/core/pricing.py) is stored with the record, handed out in the
    manifest (the worker's residency uses it, tasks/loading.py), and equals what the worker's
    loader holds; a record registered before the column existed is priced from its folder."""
    from sqlmodel import Session

    from app.db.tables import ModelRecord
    from tasks.pipelines import load_pipeline
    from tests.helpers import held_bytes

    source = tiny_models_dir / "tiny-sd"
    record = ctx.registry.add(source, "sd-int8", precision="bf16", quantization="torchao-int8wo")
    held = sum(held_bytes(load_pipeline(source, "bf16", "torchao-int8wo")).values())
    assert record.weights_bytes == held
    with Session(ctx.registry.engine) as session:
        stored = session.get(ModelRecord, "sd-int8")
        assert stored is not None and stored.weights_bytes == held
    assert ctx.registry.manifest("sd-int8").weights_bytes == held == ctx.registry.weights_bytes("sd-int8")

    old = ctx.registry.add(source, "sd-old")
    with Session(ctx.registry.engine) as session:
        row = session.get(ModelRecord, "sd-old")
        assert row is not None
        row.weights_bytes = None
        session.add(row)
        session.commit()
    ctx.registry._records.pop("sd-old", None)
    assert ctx.registry.get("sd-old").weights_bytes is None
    assert ctx.registry.weights_bytes("sd-old") == sum(held_bytes(load_pipeline(source)).values()) == old.weights_bytes
