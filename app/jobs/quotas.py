"""Per-key quotas (docs/api.md, "Quotas"): how much of the fleet one API key may use.

A key's quota (``Settings.api_key_quotas``, :class:`app.core.limits.KeyQuota`) has two limits,
each checked by :meth:`KeyQuotas.check` inside ``Dispatcher.submit`` under the fleet lock (R14),
beside ``max_pending_total`` (R23): two submissions cannot both pass on the same count, because
the second one reads the journal after the first one's job is in it.

- ``max_queued_jobs``: the key's jobs queued or running (the journal's ``api_key_id``). At the
  limit a submission is refused, reason ``quota_queued``, with ``Retry-After`` =
  ``Settings.retry_after_s`` (a job of the key has to end first, which no one can foretell).
- ``max_gpu_seconds_per_hour``: the GPU-seconds of the key's jobs that ENDED in the last
  :data:`app.core.limits.GPU_WINDOW_S` seconds (a rolling hour), each job counting its measured
  load + run seconds (:func:`gpu_seconds`). Running and queued jobs do not count until they end
  (their time is not known before; ``max_queued_jobs`` bounds them). At the limit a submission
  is refused, reason ``quota_gpu_seconds``, with ``Retry-After`` = the seconds until enough of
  that usage leaves the window to bring it under the limit (:func:`gpu_retry_after_s`).

Both refusals are ``QuotaExceeded`` (429), journaled ``rejected`` as every refusal is. A key
under no quota, and the open API (no keys), are not checked and cost no query.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime

from app.core.config import Settings
from app.core.errors import QuotaExceeded
from app.core.limits import GPU_WINDOW_S, KeyQuota
from app.core.states import JobState
from app.journal.jobs import Journal

QUOTA_QUEUED = "quota_queued"
QUOTA_GPU_SECONDS = "quota_gpu_seconds"


@dataclass(frozen=True)
class Usage:
    """One ended job's use of the fleet: when it ended (unix seconds) and its GPU-seconds."""

    ended_s: float
    gpu_s: float


def unix_s(moment: datetime) -> float:
    """Unix seconds of a journal time (stored naive in UTC by SQLite, aware by PostgreSQL)."""
    return (moment if moment.tzinfo else moment.replace(tzinfo=UTC)).timestamp()


def gpu_seconds(finished: datetime, started: datetime | None, load_s: float | None, run_s: float | None) -> float:
    """The GPU-seconds of one ended job: its load + run seconds as its worker reported them; for
    a job that started but reported neither (interrupted: worker lost, hung, terminated), the
    time from its claim to its end, which it held its machine; 0 for one that never started
    (cancelled, or interrupted while queued)."""
    if load_s is not None or run_s is not None:
        return (load_s or 0.0) + (run_s or 0.0)
    if started is None:
        return 0.0
    return max(0.0, unix_s(finished) - unix_s(started))


def used_s(usage: Iterable[Usage], now_s: float, window_s: float = GPU_WINDOW_S) -> float:
    """GPU-seconds of the jobs of ``usage`` that ended in the ``window_s`` seconds up to ``now_s``
    (a job that ended exactly ``window_s`` seconds ago has left it)."""
    return sum(u.gpu_s for u in usage if u.ended_s > now_s - window_s)


def gpu_retry_after_s(usage: Sequence[Usage], limit_s: float, now_s: float, window_s: float = GPU_WINDOW_S) -> int:
    """Whole seconds (at least 1) until the usage still in the window is below ``limit_s``: a
    job's GPU-seconds leave the window ``window_s`` seconds after it ended, oldest first. Jobs
    ending meanwhile are not foreseen: a retry then may be refused again, with a new figure."""
    inside = sorted((u for u in usage if u.ended_s > now_s - window_s), key=lambda u: u.ended_s)
    total = sum(u.gpu_s for u in inside)
    until_s = now_s
    for one in inside:
        if total < limit_s:
            break
        total -= one.gpu_s
        until_s = one.ended_s + window_s
    return max(1, math.ceil(until_s - now_s))


@dataclass
class KeyUse:
    """One API key's row of ``homefleet keys``: its id (quota name or ``key:<12 hex>``), how many
    configured keys it stands for (0: it is in the journal only, no longer configured), its jobs
    queued and running, its GPU-seconds in the last hour, and its quota (None: unlimited)."""

    key_id: str
    keys: int
    queued: int = 0
    running: int = 0
    gpu_s_last_hour: float = 0.0
    quota: KeyQuota | None = None

    def as_dict(self) -> dict[str, object]:
        """The row as JSON (``homefleet keys --json``); a limit not set is null."""
        return {
            "key_id": self.key_id,
            "keys": self.keys,
            "queued": self.queued,
            "running": self.running,
            "gpu_s_last_hour": round(self.gpu_s_last_hour, 3),
            "max_queued_jobs": self.quota.max_queued_jobs if self.quota else None,
            "max_gpu_seconds_per_hour": self.quota.max_gpu_seconds_per_hour if self.quota else None,
        }


@dataclass
class KeyQuotas:
    """The quota check of a submission, and ``homefleet keys``' figures, from the journal."""

    settings: Settings
    journal: Journal
    window_s: float = field(default=GPU_WINDOW_S)

    def quota(self, api_key_id: str | None) -> KeyQuota | None:
        """The quota of key id ``api_key_id``, or None (unlimited; no key)."""
        return None if api_key_id is None else self.settings.api_key_quotas.get(api_key_id)

    def usage(self, api_key_id: str, now_s: float) -> list[Usage]:
        """The jobs of key ``api_key_id`` that ended in the window up to ``now_s``, oldest first."""
        since = datetime.fromtimestamp(now_s - self.window_s, UTC)
        return [
            Usage(unix_s(finished), gpu_seconds(finished, started, load_s, run_s))
            for _, finished, started, load_s, run_s in self.journal.ended_since(since, api_key_id)
        ]

    def check(self, api_key_id: str | None, now_s: float | None = None) -> None:
        """Refuse a submission of key ``api_key_id`` at either limit of its quota (module
        docstring); call it under the fleet lock. No quota: returns at once, reading nothing.

        Raises:
            QuotaExceeded: reason ``quota_queued`` (``Retry-After``: ``retry_after_s``) or
                ``quota_gpu_seconds`` (``Retry-After``: until the usage falls under the limit);
                the message names the key id, the quota, its limit and the key's figure.
        """
        quota = self.quota(api_key_id)
        if quota is None or api_key_id is None:
            return
        now_s = time.time() if now_s is None else now_s
        gpu_limit = quota.max_gpu_seconds_per_hour
        since = None if gpu_limit is None else datetime.fromtimestamp(now_s - self.window_s, UTC)
        active, timed_s, untimed = self.journal.key_load(api_key_id, since)  # sums in SQL: no row read
        if quota.max_queued_jobs is not None and active >= quota.max_queued_jobs:
            raise QuotaExceeded(
                f"api key {api_key_id!r} is over its quota max_queued_jobs={quota.max_queued_jobs} "
                f"({active} queued or running); retry once one of its jobs has ended",
                reason=QUOTA_QUEUED,
                retry_after_s=self.settings.retry_after_s,
            )
        if gpu_limit is None:
            return
        used = timed_s + sum(gpu_seconds(finished, started, None, None) for finished, started in untimed)
        if used >= gpu_limit:
            usage = self.usage(api_key_id, now_s)  # each job's end, for when enough has left the window
            retry_s = gpu_retry_after_s(usage, gpu_limit, now_s, self.window_s)
            raise QuotaExceeded(
                f"api key {api_key_id!r} is over its quota max_gpu_seconds_per_hour={gpu_limit:g} "
                f"({used:.1f} GPU-seconds used by its jobs that ended in the last {self.window_s:g} s); "
                f"retry in {retry_s} s",
                reason=QUOTA_GPU_SECONDS,
                retry_after_s=retry_s,
            )

    def by_key(self, now_s: float | None = None) -> list[KeyUse]:
        """Every key's use (``homefleet keys``): the configured keys, one row per quota name and
        one per key under no quota, in configuration order, then the key ids the journal holds
        jobs of (queued, running or ended in the last hour) that no configured key has."""
        now_s = time.time() if now_s is None else now_s
        rows: dict[str, KeyUse] = {
            name: KeyUse(name, 0, quota=quota) for name, quota in self.settings.api_key_quotas.items()
        }
        for key in self.settings.api_keys:
            key_id = self.settings.api_key_id(key)
            rows.setdefault(key_id, KeyUse(key_id, 0)).keys += 1
        for key_id, states in self.journal.active_by_key().items():
            row = rows.setdefault(key_id, KeyUse(key_id, 0))
            row.queued, row.running = states.get(JobState.queued, 0), states.get(JobState.running, 0)
        since = datetime.fromtimestamp(now_s - self.window_s, UTC)
        for key_id, finished, started, load_s, run_s in self.journal.ended_since(since):
            rows.setdefault(key_id, KeyUse(key_id, 0)).gpu_s_last_hour += gpu_seconds(finished, started, load_s, run_s)
        return list(rows.values())
