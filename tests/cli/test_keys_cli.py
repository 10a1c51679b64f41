"""``homefleet keys`` as a user runs it: per key, jobs queued and running, GPU-seconds
of the last hour, the limits and whether it has a webhook secret, as a table and as JSON; it reads the journal and
migrates
nothing (an outdated journal is refused: tests/cli/test_db_revision.py)."""

from __future__ import annotations

import json
from pathlib import Path

from app.context import build_context
from app.core.config import Settings
from tests.helpers import bring_online, make_fleet, run_cli, settings_env

CI_KEY = "ci-key-0123456789abcdef"
OTHER_KEY = "other-key-0123456789abcdef"
QUOTAS = {"ci": {"key_prefix": "ci-key-", "max_queued_jobs": 3, "max_gpu_seconds_per_hour": 600}}
SECRET = "ci-webhook-secret-0123456789"  # webhook_secrets are keyed by these ids


def test_keys_lists_each_keys_jobs_gpu_seconds_and_limits(settings: Settings, tiny_models_dir: Path) -> None:
    settings = Settings(**{**settings.model_dump(), "api_keys": [CI_KEY, OTHER_KEY], "api_key_quotas": QUOTAS})
    ctx = build_context(settings, make_fleet("m1"), migrate=True)
    try:
        model = ctx.registry.add(tiny_models_dir / "tiny-sd").id
        bring_online(ctx, "server", {model})
        ids = [ctx.dispatcher.submit(model, "txt2img", {"prompt": p}, "server", api_key_id="ci").job.id for p in "abc"]
        ctx.journal.claim(ids[0], "server")
        ctx.journal.claim(ids[1], "server")
        ctx.endings.finished(ctx.journal.succeed(ids[1], "server", load_s=1.5, run_s=40.0))
        other_id = settings.api_key_id(OTHER_KEY)
    finally:
        ctx.close()
    env = {
        **settings_env(settings),
        "HOMEFLEET_API_KEYS": json.dumps([CI_KEY, OTHER_KEY]),
        "HOMEFLEET_API_KEY_QUOTAS": json.dumps(QUOTAS),
        "HOMEFLEET_WEBHOOK_SECRETS": json.dumps({"ci": SECRET}),
    }
    rows = json.loads(run_cli("keys", "--json", env=env).stdout)
    assert rows == [
        {
            "key_id": "ci",
            "keys": 1,
            "queued": 1,
            "running": 1,
            "gpu_s_last_hour": 41.5,
            "max_queued_jobs": 3,
            "max_gpu_seconds_per_hour": 600.0,
            "webhook_secret": True,
        },
        {
            "key_id": other_id,
            "keys": 1,
            "queued": 0,
            "running": 0,
            "gpu_s_last_hour": 0.0,
            "max_queued_jobs": None,
            "max_gpu_seconds_per_hour": None,
            "webhook_secret": False,
        },
    ]
    table = run_cli("keys", env={**env, "COLUMNS": "200"}).stdout  # one line per row, whatever the caller's terminal
    assert "max queued jobs" in table and "GPU seconds last hour" in table and "max GPU seconds per hour" in table
    [ci_line] = [line for line in table.splitlines() if " ci " in line]
    assert [cell.strip() for cell in ci_line.split("│")[1:9]] == ["ci", "1", "1", "1", "41.5", "3", "600", "yes"], (
        ci_line
    )
    assert CI_KEY not in table and OTHER_KEY not in table and SECRET not in table  # ids only, never a key or secret
    # at 80 columns (the table needs 81) one record a key: nothing cut short ("max_q…" was unreadable)
    narrow = run_cli("keys", env={**env, "COLUMNS": "80"}).stdout
    assert "…" not in narrow and max(len(line) for line in narrow.splitlines()) <= 80, narrow
    lines = narrow.splitlines()
    assert lines[lines.index("ci") + 1 :][:7] == [
        "  keys: 1",
        "  queued: 1",
        "  running: 1",
        "  GPU seconds last hour: 41.5",
        "  max queued jobs: 3",
        "  max GPU seconds per hour: 600",
        "  webhook secret: yes",
    ], narrow
    assert other_id in lines, narrow
