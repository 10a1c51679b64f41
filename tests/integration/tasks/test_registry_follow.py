"""A worker following the registry (tasks/verify.py, R4): when models leave it, the log names as
withdrawn only those this machine advertised, not every model it never held. Real parts: the
API served by uvicorn with its Redis, journal and registry, real model files, the worker's
verifier hashing them."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest

from app.context import ServerContext
from app.core.config import WorkerSettings
from tasks.verify import Verifier
from tests.helpers import served_api

HELD, NEVER = "tiny-held", "tiny-never"


def test_r4_a_registry_change_names_as_withdrawn_only_the_models_advertised_here(
    ctx: ServerContext, tiny_models_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    for model_id in (HELD, NEVER):
        ctx.registry.add(tiny_models_dir / "tiny-sd", model_id)
    models_dir = tmp_path / "m1-models"
    shutil.copytree(ctx.registry.folder(HELD), models_dir / HELD)  # synced here; NEVER is not
    with served_api(ctx) as url:
        settings = WorkerSettings(
            machine="m1",
            models_dir=models_dir,
            server_url=url,
            worker_token=ctx.fleet.machines["m1"].token,
            redis_url=ctx.settings.redis_url,
        )
        verifier = Verifier(settings, ctx.redis, ctx.keys)
        assert verifier.verify() == {HELD}
        for model_id in (HELD, NEVER):
            ctx.registry.retire(model_id)
        with caplog.at_level(logging.INFO, logger="homefleet.worker"):
            verifier._follow(ctx.redis.get(ctx.keys.registry_changed()))  # the heartbeat's thread's work, here
    said = [r.getMessage() for r in caplog.records if "the registry changed" in r.getMessage()]
    assert said == [f"m1: the registry changed; withdrawn (no longer registered): {HELD}"], said
    assert ctx.redis.smembers(ctx.keys.verified("m1")) == set()
