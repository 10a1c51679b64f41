"""A worker following the registry (tasks/verify.py, R4): when models leave it, the log names as
withdrawn only those this machine advertised, not every model it never held. Real parts: the
API served by uvicorn with its Redis, journal and registry, real model files, the worker's
verifier hashing them."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest

from app.context import ServerContext, build_context
from app.core.config import Settings, WorkerSettings
from tasks.verify import Verifier
from tests.helpers import make_fleet, served_api

HELD, NEVER = "tiny-held", "tiny-never"


def m1_settings(ctx: ServerContext, models_dir: Path, url: str) -> WorkerSettings:
    """Machine m1's worker settings: its copies in ``models_dir``, the API served at ``url``."""
    return WorkerSettings(
        machine="m1",
        models_dir=models_dir,
        server_url=url,
        worker_token=ctx.fleet.machines["m1"].token,
        redis_url=ctx.settings.redis_url,
    )


def test_r4_a_registry_change_names_as_withdrawn_only_the_models_advertised_here(
    ctx: ServerContext, tiny_models_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    for model_id in (HELD, NEVER):
        ctx.registry.add(tiny_models_dir / "tiny-sd", model_id)
    models_dir = tmp_path / "m1-models"
    shutil.copytree(ctx.registry.folder(HELD), models_dir / HELD)  # synced here; NEVER is not
    with served_api(ctx) as url:
        verifier = Verifier(m1_settings(ctx, models_dir, url), ctx.redis, ctx.keys)
        assert verifier.verify() == {HELD}
        for model_id in (HELD, NEVER):
            ctx.registry.retire(model_id)
        with caplog.at_level(logging.INFO, logger="homefleet.worker"):
            verifier._follow(ctx.redis.get(ctx.keys.registry_changed()))  # the heartbeat's thread's work, here
    said = [r.getMessage() for r in caplog.records if "the registry changed" in r.getMessage()]
    assert said == [f"m1: the registry changed; withdrawn (no longer registered): {HELD}"], said
    assert ctx.redis.smembers(ctx.keys.verified("m1")) == set()


def test_r4_a_copy_damaged_before_the_worker_started_is_advertised_once_put_back(
    ctx: ServerContext, tiny_models_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A byte flipped in a copy while no worker ran: the start-up check does not advertise it,
    and watches it as one withdrawn; the file put back as it was (``cp -p`` from a backup)
    brings it back at the next beats, no sync. A copy cut short (a file missing) is not
    watched: a sync verifies it."""
    import os

    from tasks.verify import file_stats

    ctx.registry.add(tiny_models_dir / "tiny-sd", HELD)
    ctx.registry.add(tiny_models_dir / "tiny-sd", NEVER)
    models_dir = tmp_path / "m1-models"
    shutil.copytree(ctx.registry.folder(HELD), models_dir / HELD)
    shutil.copytree(ctx.registry.folder(NEVER), models_dir / NEVER)
    (models_dir / NEVER / "unet" / "config.json").unlink()  # a copy cut short
    path = models_dir / HELD / "unet" / "config.json"
    original, stat = path.read_bytes(), path.stat()
    path.write_bytes(original[:-1] + bytes([original[-1] ^ 1]))  # same size, one bit other
    with served_api(ctx) as url:
        verifier = Verifier(m1_settings(ctx, models_dir, url), ctx.redis, ctx.keys)
        with caplog.at_level(logging.WARNING, logger="homefleet.worker"):
            assert verifier.verify() == set()
        assert set(verifier.withdrawn) == {HELD}  # watched; the copy cut short is not
        said = {r.getMessage().split(" is not advertised")[0]: r.getMessage() for r in caplog.records}
        held = said[f"m1: model {HELD}"]  # each copy that fails is named, with what differs
        assert "unet/config.json: digest blake3:" in held and "manifest says blake3:" in held
        assert f"`homefleet sync m1 {HELD}`" in held
        assert "unet/config.json: missing" in said[f"m1: model {NEVER}"]
        path.write_bytes(original)
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # as cp -p puts it back
        assert file_stats(models_dir, verifier.manifests[HELD]) != verifier.withdrawn[HELD]  # the mtime moved back
        verifier.check_unchanged()  # a beat: the stat moved, so it is hashed again in a thread
        assert verifier._following is not None
        verifier._following.join(timeout=30)
    assert ctx.redis.smembers(ctx.keys.verified("m1")) == {HELD}
    assert HELD not in verifier.withdrawn and HELD in verifier.stats


def test_r4_the_start_line_counts_only_the_models_of_families_the_machine_runs(
    settings: Settings, tiny_models_dir: Path, tiny_text_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """m1's fleet entry supports family sd1 only; the registry holds an sd1 model, an
    sd1-pix2pix model and a qwen2 text model, and m1 holds no copy. Its start-up line counts the
    one model it runs, not all three as if two were missing, and says the others are of
    families it does not run. Once it holds the sd1 model, that one is counted verified."""
    ctx = build_context(settings, make_fleet("m1", families=frozenset({"sd1"})), migrate=True)
    try:
        ctx.registry.add(tiny_models_dir / "tiny-sd", "tiny-sd")
        ctx.registry.add(tiny_models_dir / "tiny-pix2pix", "tiny-pix2pix")
        ctx.registry.add(tiny_text_dir / "tiny-qwen2", "tiny-qwen2")
        models_dir = tmp_path / "m1-models"
        with served_api(ctx) as url, caplog.at_level(logging.INFO, logger="homefleet.worker"):
            assert Verifier(m1_settings(ctx, models_dir, url), ctx.redis, ctx.keys).verify() == set()
            shutil.copytree(ctx.registry.folder("tiny-sd"), models_dir / "tiny-sd")
            assert Verifier(m1_settings(ctx, models_dir, url), ctx.redis, ctx.keys).verify() == {"tiny-sd"}
    finally:
        ctx.close()
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("m1 verified")]
    others = "; 2 more registered models are of families it does not run (qwen2, sd1-pix2pix)"
    assert said == [
        "m1 verified 0 of 1 models it runs (sd1): none" + others,
        "m1 verified 1 of 1 models it runs (sd1): tiny-sd" + others,
    ], said
