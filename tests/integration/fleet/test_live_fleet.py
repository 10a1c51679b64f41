"""The live fleet file and join tokens (app/fleet/live.py, app/api/fleet_reload.py) over real
Redis and a real journal: single-use, expiring, hashed join tokens; the atomic rewrite keeps the
operator's comments and mode 0600; SIGHUP reloads the running server's fleet; a file that cannot
be used is refused and the old fleet kept."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from pydantic import ValidationError

from app.api.fleet_reload import FleetReloader
from app.context import ServerContext, build_checked_context
from app.core.errors import ConfigError, Unauthorized
from app.fleet import live
from app.fleet.config import Backend

MACHINE_TOKEN = "token-of-the-machine-".ljust(32, "x")


def test_a_join_token_is_single_use_expiring_and_stored_hashed(ctx: ServerContext) -> None:
    tokens = live.JoinTokens(ctx.redis, ctx.keys, ttl_s=900)
    token = tokens.issue("m1", MACHINE_TOKEN)
    assert token.startswith(live.JOIN_TOKEN_PREFIX) and len(token) > 40
    stored = [str(key) for key in ctx.redis.scan_iter(f"{ctx.keys.prefix}:join:*")]
    assert stored == [ctx.keys.join_token(live.token_digest(token))]  # only its SHA-256 names it
    assert all(
        secret not in str(value) for value in ctx.redis.hgetall(stored[0]).values() for secret in (token, MACHINE_TOKEN)
    )
    assert 900 < ctx.redis.ttl(stored[0]) <= 900 + live.JOIN_TOKEN_MEMORY_S
    assert tokens.peek(token) == "m1"  # peeking spends nothing
    assert tokens.redeem(token) == "m1"
    with pytest.raises(Unauthorized) as used:
        tokens.redeem(token)
    assert used.value.reason == "join_token_used" and "'m1'" in used.value.message
    expiring = tokens.issue("m2", MACHINE_TOKEN, ttl_s=0.05)
    time.sleep(0.2)
    with pytest.raises(Unauthorized) as expired:
        tokens.redeem(expiring)
    assert expired.value.reason == "join_token_expired"
    with pytest.raises(Unauthorized) as unknown:
        tokens.redeem(live.JOIN_TOKEN_PREFIX + "never-issued")
    assert unknown.value.reason == "join_token_unknown"


def test_of_two_concurrent_redemptions_one_wins(ctx: ServerContext) -> None:
    tokens = live.JoinTokens(ctx.redis, ctx.keys, ttl_s=900)
    token = tokens.issue("m1", MACHINE_TOKEN)
    outcomes: list[str] = []
    start = threading.Barrier(8)

    def redeem() -> None:
        start.wait()
        try:
            outcomes.append(tokens.redeem(token))
        except Unauthorized as error:
            outcomes.append(error.reason)

    threads = [threading.Thread(target=redeem) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(outcomes) == ["join_token_used"] * 7 + ["m1"]


def test_an_added_machine_keeps_the_files_comments_and_mode_0600(ctx: ServerContext, tmp_path: Path) -> None:
    path = tmp_path / "fleet.toml"
    path.write_text("# the operator's note\n" + ctx.fleet.to_toml().replace('name = "m1"', 'name = "m1"  # desk'))
    path.chmod(0o644)
    entry = live.new_machine_entry("m9", Backend.cuda, 24_000_000_000, ["sd1"])
    new = live.edit(path.read_text(), lambda entries: entries.append(entry))
    live.write_atomically(path, new)
    assert path.stat().st_mode & 0o777 == 0o600
    text = path.read_text()
    assert text.startswith("# the operator's note") and 'name = "m1"  # desk' in text
    fleet = live.parse(text, path)
    assert fleet.machines["m9"].memory_kind == "dedicated" and fleet.machines["m9"].memory_bytes == 24_000_000_000
    assert len(fleet.machines["m9"].token) >= 32
    with pytest.raises(ValueError, match="listed twice"):
        live.edit(text, lambda entries: entries.append(entry))
    assert not list(tmp_path.glob(".fleet.toml.*"))  # no temporary file left
    # a table after the machines ([models.*]) stays apart from the appended entry by a blank line
    with_models = text + "\n[models.tiny-sd]\nstep_s = 1.0\n"
    other = live.new_machine_entry("m10", Backend.cuda, 24_000_000_000, ["sd1"])
    added = live.edit(with_models, lambda entries: entries.append(other))
    assert "speed = 1.0\n\n[models.tiny-sd]" in added and added.count("\n\n[[machines]]") == added.count("[[machines]]")
    assert "\n\n\n" not in added


@pytest.fixture
def sighup_restored() -> Iterator[None]:
    previous = signal.getsignal(signal.SIGHUP)
    try:
        yield
    finally:
        signal.signal(signal.SIGHUP, previous)


def test_sighup_reloads_the_fleet_and_a_broken_file_is_refused_with_the_old_fleet_kept(
    ctx: ServerContext, tmp_path: Path, sighup_restored: None
) -> None:
    path = tmp_path / "fleet.toml"
    path.write_text(ctx.fleet.to_toml())
    reloader = FleetReloader(ctx, path, interval_s=3600)  # only SIGHUP makes it look again
    reloader.start()
    try:
        wait_for(
            lambda: (live.loaded_report(ctx.redis, ctx.keys) or {}).get("digest") == live.text_digest(path.read_text())
        )
        entry = live.new_machine_entry("m9", Backend.cpu, 2_000_000_000, ["sd1"], speed=2.0)
        live.write_atomically(path, live.edit(path.read_text(), lambda entries: entries.append(entry)))
        os.kill(os.getpid(), signal.SIGHUP)
        wait_for(lambda: "m9" in ctx.fleet.machines)
        assert "m9" in ctx.machines.fleet.machines and ctx.dispatcher.speed["m9"] == 2.0
        assert ctx.dispatcher.costs.estimator().machines["m9"].usable_bytes == 2_000_000_000
        assert any(row["name"] == "m9" for row in ctx.status())
        report = live.loaded_report(ctx.redis, ctx.keys)
        assert report is not None and report["state"] == "loaded" and report["pid"] == os.getpid()
        path.write_text("[[machines]\nname = ")  # not TOML
        os.kill(os.getpid(), signal.SIGHUP)
        wait_for(lambda: (live.loaded_report(ctx.redis, ctx.keys) or {}).get("state") == "refused")
        reason = live.loaded_report(ctx.redis, ctx.keys)["reason"]  # type: ignore[index]
        assert "is not valid TOML" in reason and reason.count("is not valid") == 1, reason  # said once
        assert "m9" in ctx.fleet.machines  # the old fleet kept
        # a command run meanwhile (`homefleet status`, `machines list`) cannot read the file: it
        # says so, and what the running server did with it
        mine = ctx.settings.model_copy(update={"fleet_file": path})
        with pytest.raises(ConfigError) as unreadable:
            build_checked_context(mine)
        said = unreadable.value.message
        assert said.startswith(f"the fleet file {path} is not valid TOML"), said
        assert f"; the running server (pid {os.getpid()}) refused this file at " in said, said
        assert said.endswith("keeps running the fleet it loaded before: fix the file and it reloads it by itself")

        path.write_text('[[machines]]\nname = "server"\nbackend = "tpu"\n')  # TOML, but no fleet
        os.kill(os.getpid(), signal.SIGHUP)
        wait_for(lambda: "backend" in (live.loaded_report(ctx.redis, ctx.keys) or {}).get("reason", ""))
        with pytest.raises(ValidationError) as invalid:
            build_checked_context(mine)
        assert any("refused this file" in note for note in invalid.value.__notes__), invalid.value
    finally:
        reloader.stop()


def wait_for(condition: object, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met")
        time.sleep(0.05)
