"""A worker survives any message its queue can hold (R8, R19): undecodable
messages are moved aside to the dead-letter list with their raw text, the worker goes on
consuming, and a real job queued behind them runs. ``homefleet status`` counts them,
``homefleet deadletter`` lists and clears them. Real ``celery worker``, real Redis."""

from __future__ import annotations

import json
import re

import pytest

from app.core import keys
from app.devtools.drills import dead_letter_drill
from tests.e2e.conftest import RunningFleet
from tests.helpers import run_cli, settings_env, wait_for

pytestmark = pytest.mark.e2e

MACHINE = "m1"


def test_undecodable_messages_are_moved_aside_and_the_next_job_runs(fleet: RunningFleet) -> None:
    """Garbage, a body that is not base64, JSON of the wrong shape and bytes that are not UTF-8
    are LPUSHed onto machine.m1 ahead of a real job: the same worker process (its lease's boot
    id unchanged) runs the job, and each message is a dead letter naming its queue and error."""
    ctx = fleet.ctx
    ctx.redis.delete(ctx.keys.dead_letters())
    boot = ctx.redis.get(ctx.keys.worker_lease(MACHINE))
    result = dead_letter_drill(ctx, fleet.client, MACHINE, fleet.model)
    assert result.job_state == "succeeded", result
    assert ctx.redis.get(ctx.keys.worker_lease(MACHINE)) == boot  # the same worker, never restarted
    letters = [json.loads(raw) for raw in ctx.redis.lrange(ctx.keys.dead_letters(), 0, -1)]
    assert len(letters) == len(result.pushed) == result.dead_letters
    assert {letter["queue"] for letter in letters} == {keys.queue(MACHINE)}
    raws = [letter["raw"] for letter in letters]
    assert "not json {" in raws  # the raw text, as it was pushed
    assert any("!!! not base64" in raw for raw in raws)
    assert any(letter["error"].startswith("JSONDecodeError") for letter in letters)
    assert any("Error" in letter["error"] and "not base64" in letter["raw"] for letter in letters)


def test_status_counts_dead_letters_and_deadletter_lists_and_clears_them(fleet: RunningFleet) -> None:
    ctx = fleet.ctx
    ctx.redis.delete(ctx.keys.dead_letters())
    ctx.redis.lpush(ctx.keys.queue_list(MACHINE), "garbage for the CLI")
    env = {**settings_env(fleet.local.settings), "COLUMNS": "250"}
    wait_for(lambda: ctx.redis.llen(ctx.keys.dead_letters()) == 1, 30, "the dead letter")
    assert "dead letters: 1" in run_cli("status", env=env).stdout
    listed = run_cli("deadletter", env=env).stdout
    assert "garbage for the CLI" in listed and keys.queue(MACHINE) in listed and "JSONDecodeError" in listed
    narrow = run_cli("deadletter", env={**env, "COLUMNS": "80"}).stdout  # one record per row: no word cut
    assert re.search(r"at \(UTC\): \d{4}-\d\d-\d\dT\d\d:\d\d:\d\d", narrow) and "…" not in narrow, narrow
    assert "cleared 1 dead letters" in run_cli("deadletter", "--clear", env=env).stdout
    assert ctx.redis.llen(ctx.keys.dead_letters()) == 0
    assert "dead letters: 0" in run_cli("status", env=env).stdout
