"""Webhooks: when a job that named a ``webhook_url`` ends, the server POSTs its
record (the JSON of ``GET /v1/jobs/{id}``) there, signed with the secret of the API key that
submitted it. docs/api.md "Webhooks" is the receiver's side; docs/operations.md the operator's.

The signature (:func:`sign`)::

    X-Homefleet-Timestamp: <unix seconds of the attempt>
    X-Homefleet-Signature: sha256=<hex HMAC-SHA256(secret, "<timestamp>." + body bytes)>

so a receiver that checks the timestamp is recent (:func:`verify`, 300 s) refuses a replay. Each
attempt also carries ``X-Homefleet-Delivery`` (the delivery's id: the same on every attempt; a
receiver dedupes by it) and ``X-Homefleet-Event: job.ended``.

Delivery: the journal writes a ``WebhookDelivery`` with the job's terminal transition
(``app/journal/jobs.py``); :class:`WebhookLoop`, started by the server, attempts each due one
with httpx. A 2xx answer delivers it; anything else (another status, a redirect, which is never
followed, a timeout, a refused connection) is retried after :func:`backoff_s`, at most
``webhook_attempts`` times in all. Each attempt is a job event ``webhook`` ("attempt 2: HTTP 500;
next in 2 s", "delivered: HTTP 200 (attempt 3)"). A webhook never changes its job's state. A
pending delivery survives a restart: the next server's loop finds it in the journal.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime

import httpx

from app.core.config import Settings
from app.core.tls import tls_context, untrusted_certificate
from app.db.tables import Job, WebhookDelivery
from app.journal.jobs import Journal
from app.journal.webhooks import DELIVERED, FAILED, PENDING, WebhookOutbox
from app.metrics import Metrics

log = logging.getLogger(__name__)

SIGNATURE_HEADER = "X-Homefleet-Signature"
TIMESTAMP_HEADER = "X-Homefleet-Timestamp"
DELIVERY_HEADER = "X-Homefleet-Delivery"
EVENT_HEADER = "X-Homefleet-Event"
EVENT = "job.ended"
TOLERANCE_S = 300  # how old a timestamp verify() accepts, by default (seconds)
LEASE_ROOM_S = 5.0  # an attempt's lease outlasts its timeout by this much (seconds)


def answered(response: httpx.Response) -> str:
    """An attempt's outcome as its job event says it: ``HTTP <status>``, and for a redirect
    (never followed) where it pointed and the fix, ``make that URL the job's webhook_url``."""
    outcome = f"HTTP {response.status_code}"
    if response.is_redirect:
        location = response.headers["Location"][:300]
        outcome += f": a redirect to {location!r}, never followed; make that URL the job's webhook_url"
    return outcome


def unreached(error: httpx.HTTPError) -> str:
    """An attempt that got no answer, as its job event says it (``ConnectError: …``, at most 300
    characters of the error), and for a receiver certificate the server does not trust, the fix:
    its CA in the server's ``SSL_CERT_FILE`` (or ``SSL_CERT_DIR``), which :func:`tls_context` reads."""
    outcome = f"{type(error).__name__}: {error}"[:300]
    if untrusted_certificate(error) is not None:
        outcome += (
            "; the server does not trust the receiver's certificate: give `homefleet serve` its CA in "
            "SSL_CERT_FILE (or SSL_CERT_DIR) and start it again"
        )
    return outcome


def _unix_s(moment: datetime | None) -> float:
    """Unix seconds of a journal time (naive UTC from SQLite, aware from PostgreSQL); now when unset."""
    if moment is None:
        return time.time()
    return (moment if moment.tzinfo else moment.replace(tzinfo=UTC)).timestamp()


def signed_material(timestamp: int, body: bytes) -> bytes:
    """What the signature covers: the timestamp's decimal digits, a ``.``, then the body's exact bytes."""
    return f"{timestamp}.".encode() + body


def sign(secret: str, timestamp: int, body: bytes) -> str:
    """``X-Homefleet-Signature``'s value: ``"sha256=" + hex HMAC-SHA256(secret, "<timestamp>." + body)``
    (the secret's UTF-8 bytes are the key)."""
    digest = hmac.new(secret.encode(), signed_material(timestamp, body), hashlib.sha256).hexdigest()
    return f"sha256={digest}"


def verify(
    secret: str,
    timestamp: str,
    signature: str,
    body: bytes,
    now_s: float | None = None,
    tolerance_s: float = TOLERANCE_S,
) -> bool:
    """A receiver's check: the signature is the body's under ``secret`` and the timestamp is
    within ``tolerance_s`` seconds of ``now_s`` (default: now). Constant-time comparison."""
    try:
        moment = int(timestamp)
    except ValueError:
        return False
    if abs((time.time() if now_s is None else now_s) - moment) > tolerance_s:
        return False
    return hmac.compare_digest(sign(secret, moment, body), signature)


def backoff_s(attempt: int, base_s: float, max_s: float) -> float:
    """The pause after failed attempt number ``attempt`` (1 = the first) before the next one:
    ``base_s x 2^(attempt - 1)``, at most ``max_s`` (seconds)."""
    return min(max_s, base_s * 2 ** (attempt - 1))


def schedule(attempts: int, base_s: float, max_s: float) -> list[float]:
    """The pauses between ``attempts`` attempts that all fail: ``attempts - 1`` of them (seconds)."""
    return [backoff_s(n, base_s, max_s) for n in range(1, attempts)]


class WebhookSender:
    """Makes one attempt of a delivery and records it (``settings``: the secrets, the bound, the
    backoff, the timeout). ``render``: a job's record as the body's bytes (the server's JSON of
    ``GET /v1/jobs/{id}``, app/api/server.py). ``metrics``: each attempt is counted there."""

    def __init__(
        self,
        settings: Settings,
        journal: Journal,
        outbox: WebhookOutbox,
        render: Callable[[Job], bytes],
        client: httpx.Client | None = None,
        metrics: Metrics | None = None,
    ) -> None:
        self.settings = settings
        self.metrics = metrics
        self.journal = journal
        self.outbox = outbox
        self.render = render
        self.client = client or httpx.Client(
            timeout=settings.webhook_timeout_s,
            follow_redirects=False,
            headers={"User-Agent": "homefleet-webhooks"},
            verify=tls_context(),
        )

    def close(self) -> None:
        self.client.close()

    def attempt(self, delivery: WebhookDelivery) -> str:
        """POST ``delivery`` once and record the outcome (module docstring); returns it:
        ``delivered``, ``pending`` (another attempt is due later) or ``failed`` (gave up). Never
        raises for the receiver's faults; the job's state is never changed."""
        number = delivery.attempts + 1
        job = self.journal.get(delivery.job_id)
        secret = self.settings.webhook_secrets.get(job.api_key_id or "")
        if secret is None:  # the secret was removed since the submission: nothing unsigned is ever sent
            detail = (
                f"attempt {number}: not sent: API key (id {job.api_key_id}) has no webhook secret "
                "(webhook_secrets); gave up"
            )
            self.outbox.record(delivery, number, FAILED, detail, delivery.due_s)
            self._count(FAILED)
            log.warning("job %s: webhook %s", job.id, detail)
            return FAILED
        body = self.render(job)
        timestamp = int(time.time())
        headers = {
            "Content-Type": "application/json",
            TIMESTAMP_HEADER: str(timestamp),
            SIGNATURE_HEADER: sign(secret, timestamp, body),
            DELIVERY_HEADER: str(delivery.id),
            EVENT_HEADER: EVENT,
        }
        try:  # streamed, and the answer's body never read: a receiver cannot make the server hold a large one
            with self.client.stream("POST", delivery.url, content=body, headers=headers) as response:
                delivered, outcome = response.is_success, answered(response)
        except httpx.HTTPError as error:
            delivered, outcome = False, unreached(error)
        if delivered:
            self.outbox.record(delivery, number, DELIVERED, f"delivered: {outcome} (attempt {number})", delivery.due_s)
            self._count(DELIVERED, time.time() - _unix_s(job.finished_at))
            return DELIVERED
        if number >= self.settings.webhook_attempts:
            detail = f"attempt {number}: {outcome}; gave up after {number} attempts (webhook_attempts)"
            self.outbox.record(delivery, number, FAILED, detail, delivery.due_s)
            self._count(FAILED)
            log.warning("job %s: webhook to %s %s", job.id, delivery.url, detail)
            return FAILED
        pause = backoff_s(number, self.settings.webhook_backoff_s, self.settings.webhook_backoff_max_s)
        self.outbox.record(
            delivery, number, PENDING, f"attempt {number}: {outcome}; next in {pause:g} s", time.time() + pause
        )
        self._count("retry")
        return PENDING

    def _count(self, outcome: str, delivered_after_s: float | None = None) -> None:
        if self.metrics is not None:
            self.metrics.webhook(outcome, delivered_after_s)


class WebhookLoop:
    """The server's delivery loop, in a daemon thread from :meth:`start` to :meth:`stop`: it
    leases the due deliveries (at most ``webhook_concurrency`` in flight) and attempts each in a
    pool thread. It wakes when ``wakeup`` is set (the journal sets it when a transition writes a
    delivery), when an attempt finishes, when the next retry is due, and every
    ``webhook_poll_s`` (deliveries written by another process, e.g. a CLI command)."""

    def __init__(
        self,
        sender: WebhookSender,
        outbox: WebhookOutbox,
        settings: Settings,
        wakeup: threading.Event | None = None,
        leads: Callable[[], bool] = lambda: True,
    ) -> None:
        self.sender = sender
        self.leads = leads  # deliveries are taken only while this server leads (app/db/leadership.py)
        self.outbox = outbox
        self.poll_s = settings.webhook_poll_s
        self.concurrency = settings.webhook_concurrency
        self.lease_for_s = settings.webhook_timeout_s + LEASE_ROOM_S
        self.join_s = settings.webhook_timeout_s + LEASE_ROOM_S
        self.wakeup = wakeup or threading.Event()
        self._stop = threading.Event()
        self._inflight: set[int] = set()
        self._guard = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="homefleet-webhooks", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop taking deliveries; wait (up to the timeout of an attempt) for those in flight."""
        self._stop.set()
        self.wakeup.set()
        self._thread.join(timeout=self.join_s)
        self.sender.close()

    def _attempt(self, delivery: WebhookDelivery) -> None:
        try:
            self.sender.attempt(delivery)
        except Exception:  # the journal failed (logged); the lease expires and the attempt is made again
            log.exception(
                "webhook delivery %s of job %s: the attempt could not be recorded", delivery.id, delivery.job_id
            )
        finally:
            with self._guard:
                self._inflight.discard(delivery.id or 0)
            self.wakeup.set()

    def _take(self, pool: ThreadPoolExecutor) -> None:
        """Lease and start the due deliveries the free slots take."""
        now_s = time.time()
        with self._guard:
            inflight = set(self._inflight)
        free = self.concurrency - len(inflight)
        if free <= 0 or not self.leads():
            return
        for delivery in self.outbox.due(now_s, free, skip=inflight):
            if delivery.id is not None and self.outbox.lease(delivery.id, now_s, now_s + self.lease_for_s):
                with self._guard:
                    self._inflight.add(delivery.id)
                pool.submit(self._attempt, delivery)

    def _run(self) -> None:
        with ThreadPoolExecutor(self.concurrency, thread_name_prefix="homefleet-webhook") as pool:
            while not self._stop.is_set():
                self.wakeup.clear()
                wait_s = self.poll_s
                try:
                    self._take(pool)
                    next_s = self.outbox.next_due_s(time.time())
                    with self._guard:
                        full = len(self._inflight) >= self.concurrency
                    if next_s is not None and not full:
                        wait_s = min(self.poll_s, max(0.05, next_s - time.time()))
                except Exception:  # the journal does not answer (logged); the next round tries again
                    log.exception("webhook delivery loop: a round failed")
                self.wakeup.wait(wait_s)
