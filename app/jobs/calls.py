"""One job per client call, whatever the client's retries (R20, case C10).

The official ``openai`` SDK resends a request it timed out on (and one answered 408, 409,
429 or 5xx without ``x-should-retry: false``) and sends no idempotency key, but each of its
requests says how many times it was already retried (``x-stainless-retry-count``). A call of
the OpenAI and Hugging Face image routes is remembered under its *fingerprint*: a digest of
the caller's API key, the route and the canonical request body (what was asked, not how its
bytes were laid out: a multipart body is fingerprinted by its fields and its file's digest).
A retried request (retry count > 0) with the fingerprint of a call seen within
``sdk_retry_window_s`` gets that call's jobs instead of new ones. A first request (retry count
0, or none said) always submits: two deliberate calls with the same body are two calls.

A request with an ``Idempotency-Key`` (a deliberate resend, as on ``POST /v1/jobs``) is
remembered under the key instead (:func:`keyed_fingerprint`) for ``idempotency_ttl_s``, with its
body's fingerprint: a request with the same key gets that call's jobs, retried or not; with
another body it is refused ``idempotency_key_reused``.

Redis key :meth:`app.core.keys.Keys.call` holds JSON ``{"jobs": [id...], "complete": bool,
"body": fingerprint or null}``: ``complete`` is false while the first request is still
submitting its jobs (a retry waits for it), with a TTL of ``sdk_retry_window_s`` (keyed:
``idempotency_ttl_s``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import redis

from app.core.digest import bytes_digest
from app.core.keys import Keys


def call_fingerprint(api_key: str, route: str, body: dict[str, Any]) -> str:
    """Digest (``blake3:<hex>``) of one call: the API key (digested: the key itself is never
    stored), the route (e.g. ``/v1/images/generations``) and ``body`` as canonical JSON (keys
    sorted)."""
    canonical = json.dumps(
        {"key": bytes_digest(api_key.encode()), "route": route, "body": body},
        sort_keys=True,
        separators=(",", ":"),
        ensure_ascii=True,
    )
    return bytes_digest(canonical.encode())


def keyed_fingerprint(api_key: str, route: str, idempotency_key: str) -> str:
    """The fingerprint of a call sent with an ``Idempotency-Key``: the API key, the route and
    that key, whatever the body (:func:`call_fingerprint`)."""
    return call_fingerprint(api_key, route, {"idempotency_key": idempotency_key})


@dataclass(frozen=True)
class Call:
    """A remembered call: the ids of the jobs it submitted, in order, whether it has submitted
    all it will (false while its first request is still submitting), and, for a call with an
    ``Idempotency-Key``, its body's fingerprint."""

    jobs: tuple[str, ...]
    complete: bool
    body: str | None = None


class CallRecords:
    """The remembered calls of the image routes, in Redis (see the module docstring)."""

    def __init__(self, client: redis.Redis, keyspace: Keys, window_s: float, keyed_ttl_s: float = 24 * 3600) -> None:
        self.redis = client
        self.keys = keyspace
        self.window_ms = max(1, int(window_s * 1000))
        self.keyed_ttl_ms = max(1, int(keyed_ttl_s * 1000))

    def record(self, fingerprint: str, jobs: list[str], *, complete: bool, body: str | None = None) -> None:
        """Remember the call's jobs so far (``complete``: all it will submit), for ``window_s``;
        a keyed call's (``body``: its body's fingerprint) for ``keyed_ttl_s``."""
        value = json.dumps({"jobs": list(jobs), "complete": complete, "body": body})
        ttl_ms = self.window_ms if body is None else self.keyed_ttl_ms
        self.redis.set(self.keys.call(fingerprint), value, px=ttl_ms)

    def find(self, fingerprint: str) -> Call | None:
        """The call remembered under ``fingerprint``, or None (never seen, or forgotten)."""
        raw = self.redis.get(self.keys.call(fingerprint))
        if raw is None:
            return None
        data = json.loads(raw)
        return Call(jobs=tuple(data["jobs"]), complete=bool(data["complete"]), body=data.get("body"))

    def forget(self, fingerprint: str) -> None:
        """Forget a call that submitted nothing (its first submission was refused): a retry of
        it submits afresh, as it should."""
        self.redis.delete(self.keys.call(fingerprint))
