"""A running job's per-step progress, in one place: written by the internal API from the
worker's reports, read by ``GET /v1/jobs/{id}``, its event stream and reconciliation's
watchdog (R19, R24).

Redis hash ``Keys.progress(job_id)``: ``step``, ``total`` and ``at`` (unix seconds of the last
report: the watchdog's sign of life), and ``first_step`` / ``first_at``, the first step
report's (the rate placement measures from, :func:`app.fleet.running.step_figures`), kept
``TTL_S`` after the last report. Each report is also published on ``Keys.job_changes`` so that
a follower (app/jobs/waiting.py) wakes without polling.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import cast

import redis

from app.core.keys import Keys

TTL_S = 24 * 3600


@dataclass(frozen=True)
class Progress:
    """Steps done of ``total`` (None before the first step report) and the last report's time."""

    step: int | None
    total: int | None
    at_s: float
    text: str | None = None  # a text job's text so far
    tokens: list[int] | None = None  # a text job's token ids so far
    logprobs: list[float] | None = None  # and each one's log probability

    def public(self) -> dict[str, int] | None:
        """``{"step", "total"}`` as the API shows it, or None before the first step report."""
        if self.step is None or self.total is None:
            return None
        return {"step": self.step, "total": self.total}


class ProgressStore:
    def __init__(self, client: redis.Redis, keyspace: Keys) -> None:
        self.redis = client
        self.keys = keyspace

    def report(
        self,
        job_id: str,
        step: int | None = None,
        total: int | None = None,
        text: str | None = None,
        tokens: list[int] | None = None,
        logprobs: list[float] | None = None,
    ) -> None:
        """Record a report now: steps done of ``total``, or (both None, at claim) only that the
        job lives; ``text``, ``tokens`` and ``logprobs``: a text job's text, token ids and their
        log probabilities so far."""
        now_s = time.time()
        fields: dict[str, float | str] = {"at": now_s}
        if step is not None and total is not None:
            fields.update(step=step, total=total)
        if text is not None:
            fields["text"] = text
        if tokens is not None:
            fields["tokens"] = json.dumps(tokens)
        if logprobs is not None:
            fields["logprobs"] = json.dumps(logprobs)
        key = self.keys.progress(job_id)
        with self.redis.pipeline(transaction=False) as pipe:
            pipe.hset(key, mapping=fields)  # type: ignore[arg-type]  # redis-py: a Mapping keyed by every encodable type
            if step is not None and total is not None:  # the first step report stays: the rate's start
                pipe.hsetnx(key, "first_step", step)
                pipe.hsetnx(key, "first_at", now_s)
            pipe.expire(key, TTL_S)
            pipe.publish(self.keys.job_changes(), json.dumps({"job": job_id, "progress": True}))  # app/jobs/waiting.py
            pipe.execute()

    def read(self, job_id: str) -> Progress | None:
        """The last report, or None when the job has reported nothing."""
        raw = cast("dict[str, str]", self.redis.hgetall(self.keys.progress(job_id)))  # decoded (create_redis)
        if not raw:
            return None
        step, total = raw.get("step"), raw.get("total")
        tokens, logprobs = raw.get("tokens"), raw.get("logprobs")
        return Progress(
            int(step) if step is not None else None,
            int(total) if total is not None else None,
            float(raw.get("at") or 0.0),
            raw.get("text"),
            json.loads(tokens) if tokens else None,
            json.loads(logprobs) if logprobs else None,
        )

    def watched_since(self, job_id: str, now_s: float) -> float:
        """When reconciliation first found this running job with no report kept (unix seconds;
        ``now_s`` the first time it asks): the watchdog's clock when Redis lost the reports
        (R19). Kept in field ``watched``, apart from ``at``: it is no sign of the worker's life."""
        key = self.keys.progress(job_id)
        with self.redis.pipeline(transaction=False) as pipe:
            pipe.hsetnx(key, "watched", now_s)
            pipe.hget(key, "watched")
            pipe.expire(key, TTL_S)
            _, since, _ = pipe.execute()
        return float(since)

    def last_at(self, job_id: str) -> float:
        """Unix seconds of the last report (0.0 when none)."""
        return float(self.redis.hget(self.keys.progress(job_id), "at") or 0.0)
