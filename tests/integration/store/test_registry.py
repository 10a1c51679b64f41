"""The registry and manifest (R4/R5 server side), on real tiny models."""

from __future__ import annotations

import json
import os
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
    with pytest.raises(Rejected, match=r"model_index.json"):
        ctx.registry.add(tmp_path / "empty")
    odd = tmp_path / "odd"
    odd.mkdir()
    (odd / "model_index.json").write_text(json.dumps({"_class_name": "SomethingPipeline"}))
    with pytest.raises(Rejected, match="SomethingPipeline"):
        ctx.registry.add(odd)
    with pytest.raises(NotFound, match="not registered"):
        ctx.registry.get("odd")


def test_r5_a_changed_server_file_is_refused_never_adopted_and_taken_only_by_update(
    ctx: ServerContext, tiny_models_dir: Path
) -> None:
    """A registered digest never changes by itself: a file of the server's copy replaced with
    other bytes makes the manifest refuse (409 ``model_changed`` naming the file, both digests
    and the fix), verify reports it and records nothing, and only ``update`` takes it."""
    record = ctx.registry.add(tiny_models_dir / "tiny-sd")
    before = {f.path: f.digest for f in ctx.registry.manifest(record.id).files}
    mark = ctx.redis.get(ctx.keys.registry_changed())
    config = ctx.registry.folder(record.id) / "unet" / "config.json"
    replacement = config.with_suffix(".new")
    replacement.write_text(config.read_text().replace("{", "{ ", 1))  # a new inode, a new size
    shutil.move(replacement, config)
    for _ in range(2):  # the second answer comes from the remembered digest, the same
        with pytest.raises(Conflict) as refused:
            ctx.registry.manifest(record.id)
        assert (refused.value.status_code, refused.value.reason) == (409, "model_changed")
        message = refused.value.message
        assert f"unet/config.json: digest {file_digest(config)}, registered {before['unet/config.json']}" in message
        assert "`homefleet models update tiny-sd`" in message
    assert {f.path: f.digest for f in ctx.registry.registered_manifest(record.id).files} == before
    checks = [c for c in ctx.registry.verify([record.id]) if c.status != "ok"]
    assert [(c.path, c.status, c.recorded, c.actual) for c in checks] == [
        ("unet/config.json", "changed", before["unet/config.json"], file_digest(config))
    ]
    assert [c.path for c in ctx.registry.verify([record.id]) if c.status != "ok"] == ["unet/config.json"]  # unrecorded
    assert ctx.redis.get(ctx.keys.registry_changed()) == mark  # nothing told the workers: nothing changed

    changes = ctx.registry.update(record.id)
    assert (changes.changed, changes.added, changes.removed) == (["unet/config.json"], [], [])
    after = {f.path: f.digest for f in ctx.registry.manifest(record.id).files}
    assert after == {**before, "unet/config.json": file_digest(config)}
    assert ctx.redis.get(ctx.keys.registry_changed()) != mark  # every worker re-verifies
    listed = next(m for m in ctx.registry.list() if m.id == record.id)
    assert listed.total_bytes == sum(f.size for f in ctx.registry.manifest(record.id).files)
    assert all(c.status == "ok" for c in ctx.registry.verify([record.id]))


def test_r5_update_takes_what_registration_would_and_refuses_what_it_would(
    ctx: ServerContext, tiny_models_dir: Path
) -> None:
    """``models update`` is registration's selection and checks over the server's copy: files no
    loader reads (a README, a stray folder, a ``.bin`` twin of safetensors weights) are named and
    left out, never recorded or synced; a folder that now holds another pipeline, or that lost a
    component's weights, is refused and nothing is recorded."""
    record = ctx.registry.add(tiny_models_dir / "tiny-sd")
    folder = ctx.registry.folder(record.id)
    before = {f.path: f.digest for f in ctx.registry.manifest(record.id).files}
    (folder / "README.md").write_text("notes")
    (folder / "extra").mkdir()
    (folder / "extra" / "x.txt").write_text("hi")
    (folder / "unet" / "diffusion_pytorch_model.bin").write_bytes(os.urandom(3000))  # garbage, never loaded
    changes = ctx.registry.update(record.id)
    assert (changes.changed, changes.added, changes.removed) == ([], [], [])
    assert changes.left_out == ["README.md", "extra/x.txt", "unet/diffusion_pytorch_model.bin"]
    assert {f.path: f.digest for f in ctx.registry.manifest(record.id).files} == before

    index = folder / "model_index.json"
    original = index.read_text()
    index.write_text(original.replace('"StableDiffusionPipeline"', '"StableDiffusionInstructPix2PixPipeline"'))
    with pytest.raises(Rejected) as refused:
        ctx.registry.update(record.id)
    assert refused.value.reason == "family_changed", refused.value.message
    assert refused.value.message == (
        "model 'tiny-sd': the folder now holds a StableDiffusionInstructPix2PixPipeline (family sd1-pix2pix), "
        "but the model is registered as a StableDiffusionPipeline (family sd1); an update keeps the family, "
        "kinds and variant: register the folder as a new model (`homefleet models add`); nothing was recorded"
    )
    index.write_text(original.replace('"StableDiffusionPipeline"', '"StableDiffusionXLPipeline"'))
    with pytest.raises(Rejected) as refused:  # the job then failed in the worker ("'NoneType' ... 'tokenize'")
        ctx.registry.update(record.id)
    assert (
        refused.value.reason == "family_changed" and "StableDiffusionXLPipeline (family sdxl)" in refused.value.message
    )
    index.write_text(original.replace('"PNDMScheduler"', '"DDIMScheduler"'))  # a new scheduler class, same pipeline
    (folder / "vae" / "diffusion_pytorch_model.safetensors").unlink()
    with pytest.raises(Rejected) as refused:
        ctx.registry.update(record.id)
    assert refused.value.reason == "incomplete_model" and "vae" in refused.value.message, refused.value.message
    assert {f.path: f.digest for f in ctx.registry.registered_manifest(record.id).files} == before


def test_r5_the_same_bytes_under_a_new_inode_refresh_the_stat_cache(ctx: ServerContext, tiny_models_dir: Path) -> None:
    """The (size, mtime_ns, inode) cache is only an "unchanged" test: a file copied over with
    the same bytes is rehashed once, found equal, and its new stat recorded."""
    from sqlmodel import Session

    from app.db.tables import ModelFile

    record = ctx.registry.add(tiny_models_dir / "tiny-sd")
    before = ctx.registry.manifest(record.id)
    config = ctx.registry.folder(record.id) / "unet" / "config.json"
    copy = config.with_suffix(".new")
    shutil.copy(config, copy)
    shutil.move(copy, config)
    assert ctx.registry.manifest(record.id) == before
    with Session(ctx.engine) as session:
        row = session.get(ModelFile, (record.id, "unet/config.json"))
        assert row is not None and (row.inode, row.mtime_ns) == (config.stat().st_ino, config.stat().st_mtime_ns)


def test_r5_a_missing_server_file_is_model_changed_naming_it(ctx: ServerContext, tiny_models_dir: Path) -> None:
    record = ctx.registry.add(tiny_models_dir / "tiny-sd")
    (ctx.registry.folder(record.id) / "scheduler" / "scheduler_config.json").unlink()
    with pytest.raises(Conflict, match=r"scheduler/scheduler_config.json: missing, registered blake3:") as refused:
        ctx.registry.manifest(record.id)
    assert refused.value.reason == "model_changed"
    assert [(c.path, c.status, c.actual) for c in ctx.registry.verify() if c.status != "ok"] == [
        ("scheduler/scheduler_config.json", "missing", None)
    ]


def test_r5_adding_the_same_folder_again_names_the_registered_model_and_copies_nothing(
    ctx: ServerContext, tiny_models_dir: Path, tmp_path: Path
) -> None:
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
    ctx: ServerContext, tiny_models_dir: Path
) -> None:
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


def test_r1_a_retired_model_keeps_its_record_and_id_but_leaves_the_list_even_for_a_warm_cache(
    ctx: ServerContext, tiny_models_dir: Path
) -> None:
    """``retire`` is refused while a job of the model is queued or running, naming it; once
    retired the record stays (``get``, its id taken) but ``list`` leaves it out, and another
    process's registry that had it cached refuses it at once (``check_in_service`` reads afresh)."""
    from app.core.states import JobState
    from app.db.tables import Job
    from app.store.registry import Registry

    ctx.registry.add(tiny_models_dir / "tiny-sd")
    ctx.registry.add(tiny_models_dir / "tiny-sd", model_id="other-sd")
    running = Registry(ctx.engine, ctx.registry.models_dir)  # a long-running server's, warmed below
    running.get("tiny-sd")
    running.check_in_service("tiny-sd")
    for job_id, state in (("queued1", JobState.queued), ("running1", JobState.running), ("done1", JobState.succeeded)):
        ctx.journal.add(Job(id=job_id, state=state, model_id="tiny-sd", kind="txt2img", target="auto", machine="m1"))
    with pytest.raises(Conflict) as refused:
        ctx.registry.retire("tiny-sd")
    assert refused.value.reason == "model_in_use"
    assert "queued1, running1" in refused.value.message and "done1" not in refused.value.message
    assert "cancel" in refused.value.message
    assert [m.id for m in ctx.registry.list()] == ["other-sd", "tiny-sd"]  # nothing recorded
    ctx.journal.cancel("queued1")
    ctx.journal.fail("running1", "m1", "oom", "out of memory")
    with pytest.raises(NotFound) as unknown:
        ctx.registry.retire("nope")
    assert unknown.value.reason == "unknown_model"

    done = ctx.registry.retire("tiny-sd")
    assert not done.already and not done.files_deleted and done.folder.is_dir()
    assert [m.id for m in ctx.registry.list()] == ["other-sd"]
    assert [(m.id, m.retired_at is not None) for m in ctx.registry.list(retired=True)] == [
        ("other-sd", False),
        ("tiny-sd", True),
    ]
    assert ctx.registry.get("tiny-sd").id == "tiny-sd"  # the record stays: its jobs name it
    for registry in (ctx.registry, running):
        with pytest.raises(NotFound) as retired:
            registry.check_in_service("tiny-sd")
        assert retired.value.reason == "model_retired" and "in service: other-sd" in retired.value.message
    running.check_in_service("other-sd")
    with pytest.raises(NotFound) as updated:  # no new content for a model that runs no job
        ctx.registry.update("tiny-sd")
    assert updated.value.reason == "model_retired"
    with pytest.raises(Rejected, match="already registered"):
        ctx.registry.add(tiny_models_dir / "tiny-sd", model_id="tiny-sd")
    with pytest.raises(Conflict, match="already registered as 'other-sd'"):  # in service: use it
        ctx.registry.add(tiny_models_dir / "tiny-sd")
    ctx.registry.retire("other-sd")
    # a retired model is no copy to use instead: the same folder registers again, under a new id
    assert ctx.registry.add(tiny_models_dir / "tiny-sd").id == "tiny-sd-2"

    again = ctx.registry.retire("tiny-sd", delete_files=True)
    assert again.already and again.retired_at == done.retired_at
    assert again.files_deleted and not ctx.registry.folder("tiny-sd").exists()
