"""A record another process updated (``homefleet models update`` in the CLI while the server
runs) is seen by the running server: its kept records are dropped when the registry's change
mark moves (looked at every ``MARK_EVERY_S``), so sizes, digests and the priced weights that
placement, the dry run and ``GET /v1/models`` give are the new ones, not the first ones it read
until a restart (R4, R10)."""

from __future__ import annotations

from pathlib import Path

import pytest

import app.store.registry
from app.context import ServerContext, build_context
from app.core.config import Settings


def test_the_server_sees_a_models_update_made_by_another_process(
    ctx: ServerContext, settings: Settings, tiny_models_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(app.store.registry, "MARK_EVERY_S", 0.0)  # look at every get
    ctx.registry.add(tiny_models_dir / "tiny-sd", "tiny-sd")
    server = build_context(settings, ctx.fleet)  # the running server: another process's registry
    try:
        before = server.registry.get("tiny-sd")
        assert server.registry.get("tiny-sd") is before  # kept while nothing changes
        config = ctx.registry.folder("tiny-sd") / "scheduler" / "scheduler_config.json"
        config.write_text(config.read_text() + "\n")
        ctx.registry.update("tiny-sd")  # the operator's CLI: one more byte
        after = server.registry.get("tiny-sd")
        assert after.total_bytes == before.total_bytes + 1
        assert server.registry.manifest("tiny-sd").files == ctx.registry.manifest("tiny-sd").files
    finally:
        server.close()


def test_a_mark_redis_cannot_give_is_said_only_where_records_are_kept(
    ctx: ServerContext, tiny_models_dir: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Redis down: a server keeps its cached records and says so; a CLI command, which has none
    cached, says nothing before its one-line ``redis_down`` error (it printed this warning first)."""
    import redis

    ctx.registry.add(tiny_models_dir / "tiny-sd", "tiny-sd")
    monkeypatch.setattr(app.store.registry, "MARK_EVERY_S", 0.0)

    def down() -> object:
        raise redis.ConnectionError("Error 111 connecting to 127.0.0.1:1. Connection refused.")

    fresh = build_context(ctx.settings, ctx.fleet)  # a CLI command's process: nothing cached
    try:
        fresh.registry.change_mark = down
        with caplog.at_level("WARNING", logger="homefleet"):
            assert fresh.registry.get("tiny-sd").id == "tiny-sd"
        assert "change mark could not be read" not in caplog.text
        ctx.registry.get("tiny-sd")  # cached here, as in a running server
        ctx.registry.change_mark = down
        with caplog.at_level("WARNING"):
            assert ctx.registry.get("tiny-sd").id == "tiny-sd"
        assert "change mark could not be read" in caplog.text and "cached records kept" in caplog.text
    finally:
        fresh.close()
