"""Schema migrations with Alembic, on SQLite and PostgreSQL."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect
from sqlmodel import SQLModel

import app.db.tables  # noqa: F401
from app.core.config import Settings
from app.db.engine import create_engine
from app.db.migrations import SCRIPTS, alembic_config, head_revision, upgrade
from tests.helpers import run_cli, settings_env


@pytest.fixture
def settings(sql_settings: Settings) -> Settings:
    """These tests are about SQL: each runs on SQLite and on PostgreSQL (tests/conftest.py)."""
    return sql_settings


def test_migrations_build_exactly_the_tables_the_code_declares(settings: Settings) -> None:
    engine = create_engine(settings)
    upgrade(engine)  # every migration, on an empty database
    try:
        upgrade(engine)  # a second run changes nothing
        with engine.connect() as connection:
            diffs = compare_metadata(MigrationContext.configure(connection), SQLModel.metadata)
            revision = MigrationContext.configure(connection).get_current_revision()
        assert diffs == []
        assert {"job", "jobevent", "modelrecord", "modelfile", "learnedtiming"} <= set(
            inspect(engine).get_table_names()
        )
        heads = [p.name.split("_")[0] for p in (SCRIPTS / "versions").glob("*.py") if not p.name.startswith("__")]
        assert revision in heads
    finally:
        engine.dispose()


def test_homefleet_db_upgrade_reports_the_revision(settings: Settings) -> None:
    head = head_revision()
    first = run_cli("db", "upgrade", env=settings_env(settings)).stdout
    assert f"migrated from no schema to revision {head}" in first
    again = run_cli("db", "upgrade", env=settings_env(settings)).stdout
    assert f"already at revision {head}" in again


def test_r13_learned_steps_taught_by_small_jobs_are_replayed_with_the_minimum_scaled_size(settings: Settings) -> None:
    """Timings learned from jobs under 256x256 under the old rule (pixels alone) would price
    those machines up to 16 times too slow under the new one: migration c3d9a1e5b7f2 replays
    them from the journal's finished runs; a timing no small job taught keeps its value."""
    from datetime import timedelta

    from sqlalchemy import text
    from sqlmodel import create_engine as plain_engine

    from app.db.tables import utcnow
    from routing.timings import EMA_WEIGHT, MIN_SCALED_SIZE, REFERENCE_SIZE

    settings.data_dir.mkdir(parents=True, exist_ok=True)
    engine = plain_engine(settings.journal_url)
    try:
        upgrade(engine, "b7c4e2f19a30")
        start = utcnow()
        runs = [("m1", 64, 4, 2.0), ("m1", 64, 4, 4.0), ("m2", 512, 10, 5.0)]  # machine, side, steps, run_s
        for i, (machine, side, steps, run_s) in enumerate(runs):
            # the columns of that revision only (the ORM's Job has the newest ones)
            with engine.begin() as connection:
                connection.execute(
                    text(
                        "INSERT INTO job (id, state, model_id, kind, params, target, machine, created_at, run_s, "
                        "finished_at) VALUES (:id, 'succeeded', 'tiny-sd', 'txt2img', :params, :m, :m, :at, :run_s, "
                        ":at)"
                    ),
                    {
                        "id": f"job{i}",
                        "m": machine,
                        "run_s": run_s,
                        "at": start + timedelta(seconds=i),
                        "params": json.dumps({"prompt": "x", "steps": steps, "width": side, "height": side}),
                    },
                )
        with engine.begin() as connection:
            for machine, step_s in (("m1", 99999.0), ("m2", 12.5)):
                connection.execute(
                    text(
                        "INSERT INTO learnedtiming (machine, model_id, kind, load_s, step_s, samples, "
                        "load_samples, updated_at) VALUES (:m, 'tiny-sd', 'txt2img', 1.0, :s, 2, 0, :at)"
                    ),
                    {"m": machine, "s": step_s, "at": start},
                )
        upgrade(engine)
        with engine.connect() as connection:
            learned = dict(connection.execute(text("SELECT machine, step_s FROM learnedtiming")).all())
    finally:
        engine.dispose()
    first, second = (run_s / 4 * REFERENCE_SIZE / MIN_SCALED_SIZE for run_s in (2.0, 4.0))
    assert learned["m1"] == pytest.approx((1 - EMA_WEIGHT) * first + EMA_WEIGHT * second)  # 32 s and 64 s, in order
    assert learned["m2"] == 12.5  # 512x512: no small job taught it


def test_a_journal_url_with_a_percent_sign_migrates(settings: Settings, tmp_path: Path) -> None:
    """Alembic's config interpolates "%": a URL-escaped PostgreSQL password (``p%40ss``) or a
    data folder named ``100%`` failed every command with "invalid interpolation syntax"."""
    odd = settings.model_copy(update={"data_dir": tmp_path / "100%data", "database_url": None})
    engine = create_engine(odd)
    try:
        upgrade(engine)
        assert "learnedtiming" in inspect(engine).get_table_names()
        assert alembic_config(engine).get_main_option("sqlalchemy.url") == engine.url.render_as_string(
            hide_password=False
        )
    finally:
        engine.dispose()


def test_a_journal_from_before_migrations_is_stamped_and_migrated(settings: Settings) -> None:
    """Journals made before Alembic (tables created straight from the models) have exactly the
    first revision's tables and no alembic_version: every command failed with "table job
    already exists". They are stamped with the first revision, then migrated to the newest."""
    from sqlalchemy import text
    from sqlmodel import create_engine as plain_engine

    from app.db.migrations import INITIAL

    settings.data_dir.mkdir(parents=True, exist_ok=True)
    engine = plain_engine(settings.journal_url)
    try:
        upgrade(engine, INITIAL)
        with engine.begin() as connection:
            connection.execute(text("DROP TABLE alembic_version"))  # as a pre-migration journal is
            connection.execute(
                text(
                    "INSERT INTO learnedtiming (machine, model_id, kind, load_s, step_s, samples, "
                    "updated_at) VALUES ('old', 'm', 'txt2img', 1.0, 2.0, 3, '2026-01-01')"
                )
            )
        upgrade(engine)
        with engine.connect() as connection:
            diffs = compare_metadata(MigrationContext.configure(connection), SQLModel.metadata)
            kept = connection.execute(text("SELECT machine FROM learnedtiming")).scalars().all()
        assert diffs == [] and kept == ["old"]
    finally:
        engine.dispose()


def test_r1_models_registered_before_retirement_existed_are_in_service_after_the_upgrade(settings: Settings) -> None:
    """Migration c8e2a4f6d1b9 adds ``modelrecord.retired_at`` (NULL) to a journal that has
    models: they stay listed and can be retired."""
    from sqlalchemy import text
    from sqlmodel import create_engine as plain_engine

    from app.store.registry import Registry

    settings.data_dir.mkdir(parents=True, exist_ok=True)
    engine = plain_engine(settings.journal_url)
    try:
        upgrade(engine, "a9c2e4f6b813")
        with engine.begin() as connection:  # the columns of that revision only
            connection.execute(
                text(
                    "INSERT INTO modelrecord (id, family, kinds, pipeline_class, total_bytes, created_at, precision) "
                    "VALUES ('old-sd', 'sd1', :kinds, 'StableDiffusionPipeline', 10, '2026-01-01', 'fp32')"
                ),
                {"kinds": json.dumps(["txt2img"])},
            )
        upgrade(engine)
        registry = Registry(engine, settings.models_dir)
        assert [(m.id, m.retired_at) for m in registry.list()] == [("old-sd", None)]
        assert registry.retire("old-sd").retired_at is not None
        assert registry.list() == [] and registry.retired_at("old-sd") is not None
    finally:
        engine.dispose()


def test_r13_timings_learned_before_size_exponents_stay_linear_after_the_upgrade(settings: Settings) -> None:
    """Migration b1f7d3a9c5e2 adds the size exponent to ``learnedtiming``: a row learned before
    keeps its seconds per step and prices sizes linearly until two runs teach otherwise."""
    from sqlalchemy import text
    from sqlmodel import create_engine as plain_engine

    from app.journal.timings import TimingStore
    from routing.timings import run_seconds

    settings.data_dir.mkdir(parents=True, exist_ok=True)
    engine = plain_engine(settings.journal_url)
    try:
        upgrade(engine, "c8e2a4f6d1b9")
        with engine.begin() as connection:  # the columns of that revision only
            connection.execute(
                text(
                    "INSERT INTO learnedtiming (machine, model_id, kind, load_s, step_s, samples, load_samples, "
                    "prompt_s, updated_at) VALUES ('m1', 'sdxl', 'txt2img', 9.5, 0.6, 12, 3, 0, '2026-01-01')"
                )
            )
        upgrade(engine)
        timing = TimingStore(engine).load().get("m1", "sdxl", "txt2img")
        assert timing is not None and (timing.step_s, timing.samples, timing.load_s) == (0.6, 12, 9.5)
        assert (timing.size_exp, timing.size_samples, timing.anchor_size, timing.anchor_step_s) == (1.0, 0, 0, 0.0)
        assert timing.misses == 0  # and no large miss before (migration 51e5abdc5a4d)
        assert timing.small_step_s == 0.0  # nor a small image's step (a2d7aa0d74d6)
        assert run_seconds(timing, 30, 512 * 512) == pytest.approx(0.6 * 30 / 4)
    finally:
        engine.dispose()
