"""Per-key quotas' arithmetic and configuration, in-process: the GPU-seconds of a job,
of a rolling hour and the Retry-After until enough of it expires; key ids; which settings are
refused."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import pytest
from pydantic import ValidationError

from app.core.config import Settings
from app.core.limits import GPU_WINDOW_S, KeyQuota, key_id
from app.jobs.quotas import Usage, gpu_retry_after_s, gpu_seconds, unix_s, used_s

NOW = 1_800_000_000.0
KEYS = ["ci-0123456789abcdef", "ci-fedcba9876543210", "alice-0123456789", "plain-key-0123456789"]


def test_a_jobs_gpu_seconds_are_its_reported_load_and_run_else_its_claim_to_end() -> None:
    end = datetime(2026, 12, 3, 8, 0, 0)  # naive, as SQLite returns it: UTC
    start = end - timedelta(seconds=42.5)
    assert gpu_seconds(end, start, 1.5, 10.0) == 11.5  # measured: the worker's report, not the wall time
    assert gpu_seconds(end, start, None, 3.0) == 3.0
    assert gpu_seconds(end, start, 2.0, None) == 2.0
    assert gpu_seconds(end, start, None, None) == 42.5  # interrupted mid-run: it held the machine that long
    assert gpu_seconds(end, None, None, None) == 0.0  # never started (cancelled while queued)
    assert gpu_seconds(end.replace(tzinfo=UTC), start.replace(tzinfo=UTC), None, None) == 42.5  # PostgreSQL: aware
    assert unix_s(end) == unix_s(end.replace(tzinfo=UTC))


def test_the_rolling_hour_counts_only_jobs_that_ended_within_it() -> None:
    usage = [Usage(NOW - GPU_WINDOW_S - 1, 500.0), Usage(NOW - GPU_WINDOW_S, 7.0), Usage(NOW - 10, 3.0)]
    assert used_s(usage, NOW) == 3.0  # the first ended 3601 s ago; the second exactly an hour ago: it has left
    assert used_s(usage, NOW, window_s=60) == 3.0
    assert used_s([], NOW) == 0.0


@pytest.mark.parametrize(
    ("usage", "limit_s", "expected"),
    [
        # 60 + 50 = 110 >= 100: once the oldest (ended 3000 s ago) leaves the window, 50 < 100: in 600 s
        ([Usage(NOW - 3000, 60.0), Usage(NOW - 1000, 50.0)], 100.0, 600),
        # both must leave: 60 + 50 >= 50 and 50 >= 50 (at the limit is over it); the second leaves in 2600 s
        ([Usage(NOW - 3000, 60.0), Usage(NOW - 1000, 50.0)], 50.0, 2600),
        # order of the rows does not matter: the oldest end leaves first
        ([Usage(NOW - 1000, 50.0), Usage(NOW - 3000, 60.0)], 100.0, 600),
        # a fraction of a second is rounded up: the retry never comes before the usage has left
        ([Usage(NOW - 3000.4, 100.0)], 100.0, 600),
        # leaving in a fraction of a second still says 1 s (Retry-After is at least 1)
        ([Usage(NOW - GPU_WINDOW_S + 0.2, 100.0)], 100.0, 1),
        # a job that ended before the window does not count and is not waited for
        ([Usage(NOW - 4000, 999.0), Usage(NOW - 100, 100.0)], 100.0, 3500),
    ],
)
def test_gpu_retry_after_is_the_time_until_enough_of_the_hours_usage_expires(
    usage: list[Usage], limit_s: float, expected: int
) -> None:
    assert gpu_retry_after_s(usage, limit_s, NOW) == expected
    later = NOW + expected
    remaining = used_s(usage, later)
    assert remaining < limit_s  # at the announced time the key is under its limit...
    if expected > 1:
        assert used_s(usage, later - 1) >= limit_s  # ...and one second earlier it was not


def test_key_ids_are_the_quota_name_or_a_short_digest_never_the_key() -> None:
    quotas = {"ci": KeyQuota(key_prefix="ci-"), "alice": KeyQuota(key_prefix="alice-0123456789")}
    assert key_id(quotas, KEYS[0]) == key_id(quotas, KEYS[1]) == "ci"  # one quota, two keys: counted together
    assert key_id(quotas, KEYS[2]) == "alice"
    unnamed = key_id(quotas, KEYS[3])
    assert unnamed.startswith("key:") and len(unnamed) == len("key:") + 12
    assert "plain" not in unnamed and unnamed == key_id({}, KEYS[3])  # stable, whatever the quotas
    assert key_id({}, KEYS[0]) != key_id({}, KEYS[1])


def test_quotas_come_from_the_environment_as_json(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOMEFLEET_API_KEYS", json.dumps(KEYS))
    monkeypatch.setenv(
        "HOMEFLEET_API_KEY_QUOTAS",
        json.dumps(
            {
                "ci": {"key_prefix": "ci-", "max_queued_jobs": 3, "max_gpu_seconds_per_hour": 600},
                "alice": {"key_prefix": "alice-", "max_gpu_seconds_per_hour": 1.5},
            }
        ),
    )
    settings = Settings()
    assert settings.api_keys == KEYS  # the plain list of strings is unchanged
    assert settings.api_key_quotas["ci"] == KeyQuota(key_prefix="ci-", max_queued_jobs=3, max_gpu_seconds_per_hour=600)
    assert settings.api_key_quotas["alice"].max_queued_jobs is None  # a limit left out is not checked
    assert settings.api_key_id(KEYS[1]) == "ci" and settings.api_key_id(KEYS[3]).startswith("key:")
    monkeypatch.delenv("HOMEFLEET_API_KEY_QUOTAS")
    assert Settings().api_key_quotas == {}  # no quotas: nothing limited


@pytest.mark.parametrize(
    ("quotas", "fragment"),
    [
        ({"ci": {"key_prefix": "nobody-"}}, "api_key_quotas['ci']: no key of api_keys starts with its key_prefix"),
        (
            {"ci": {"key_prefix": "ci-"}, "all-ci": {"key_prefix": "ci-0"}},
            "api_keys[0] starts with the key_prefix of 2 quotas ('ci', 'all-ci')",
        ),
        ({"ci": {"key_prefix": "ci-", "max_queud_jobs": 3}}, "max_queud_jobs"),  # misspelt: refused, not ignored
        ({"ci": {"key_prefix": "ci-", "max_queued_jobs": 0}}, "max_queued_jobs"),
        ({"ci": {"key_prefix": "ci-", "max_gpu_seconds_per_hour": -1}}, "max_gpu_seconds_per_hour"),
        ({"ci": {"key_prefix": ""}}, "key_prefix"),
        ({"c:i": {"key_prefix": "ci-"}}, "the name 'c:i' must be 1-32 letters"),  # ':' is the digest ids'
    ],
)
def test_a_quota_that_would_apply_to_nothing_or_twice_or_is_misspelt_is_refused(
    quotas: dict[str, object], fragment: str
) -> None:
    with pytest.raises(ValidationError) as refused:
        Settings(api_keys=KEYS, api_key_quotas=quotas)
    assert fragment in str(refused.value)
    assert "0123456789abcdef" not in str(refused.value)  # the message never shows a key
