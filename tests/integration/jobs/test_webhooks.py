"""Webhooks through the API in-process, on a real Redis and journal, with a real HTTP
receiver on a free port: the body is the job record, the signature verifies with the key's
secret, retries are bounded, journaled and never change the job, and a pending delivery is
resumed by the next server on the same journal."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from app.api.server import create_app
from app.context import ServerContext, build_context
from app.core.config import Settings
from app.core.limits import key_id
from app.core.states import JobState
from app.db.tables import Job
from app.fleet.config import Fleet, WebhookConfig
from app.jobs.webhooks import sign, verify
from app.journal.webhooks import DELIVERED, EVENT, FAILED, PENDING
from tests.cli.test_join_tls import tls_server
from tests.helpers import (
    TEST_API_KEY,
    TEST_WEBHOOK_SECRET,
    bring_online,
    make_fleet,
    wait_for,
    webhook_receiver,
)

__all__ = ["tls_server"]  # the fixture: an https listener of a self-signed certificate

OTHER_KEY = "other-api-key-0123456789"  # a key without a webhook secret
AUTH = {"Authorization": f"Bearer {TEST_API_KEY}"}


def hook_settings(tmp_path: Path, redis_url: str, **overrides: object) -> Settings:
    values: dict[str, object] = {"webhook_backoff_s": 0.05, "webhook_attempts": 5, **overrides}
    return Settings(
        data_dir=tmp_path / "server",
        redis_url=redis_url,
        fleet_lock_ttl_s=5,
        fleet_lock_wait_s=5,
        api_keys=[TEST_API_KEY, OTHER_KEY],
        webhook_secrets={key_id({}, TEST_API_KEY): TEST_WEBHOOK_SECRET},
        **values,
    )  # type: ignore[arg-type]


def hook_fleet() -> Fleet:
    return make_fleet("m1", "m2").model_copy(update={"webhooks": WebhookConfig(allow_hosts=["127.0.0.1"])})


@pytest.fixture
def hook_ctx(tmp_path: Path, redis_url: str, tiny_models_dir: Path) -> Iterator[ServerContext]:
    context = build_context(hook_settings(tmp_path, redis_url), hook_fleet(), migrate=True)
    context.registry.add(tiny_models_dir / "tiny-sd")
    bring_online(context, "m1", {"tiny-sd"})
    try:
        yield context
    finally:
        context.close()


def submit(client: TestClient, url: str | None, **body: object) -> dict[str, object]:
    answer = client.post(
        "/v1/jobs",
        json={
            "model": "tiny-sd",
            "kind": "txt2img",
            "params": {"prompt": "a cat"},
            "target": "m1",
            "webhook_url": url,
            **body,
        },
    )
    assert answer.status_code == 202, answer.text
    return answer.json()  # type: ignore[no-any-return]


def webhook_events(ctx: ServerContext, job_id: str) -> list[str]:
    return [event.detail for event in ctx.journal.events(job_id) if event.event == EVENT]


def test_the_body_is_the_job_record_signed_with_the_key_secret(hook_ctx: ServerContext) -> None:
    with webhook_receiver() as receiver, TestClient(create_app(hook_ctx.settings, hook_ctx), headers=AUTH) as client:
        job_id = str(submit(client, receiver.url)["id"])
        assert client.get(f"/v1/jobs/{job_id}").json()["webhook_url"] == receiver.url
        assert client.post(f"/v1/jobs/{job_id}/cancel").json()["state"] == "cancelled"
        [got] = wait_for(lambda: receiver.received, timeout_s=10, what="the webhook")
        # the receiver answers before the server journals the attempt: wait for the journal
        wait_for(lambda: hook_ctx.outbox.of_job(job_id)[0].state == DELIVERED, timeout_s=10, what="delivered")
        record = client.get(f"/v1/jobs/{job_id}").json()
    assert got.path == "/hook"
    assert record["webhook"] == {
        "state": DELIVERED,
        "attempts": 1,
        "max_attempts": 5,
        "next_attempt_at": None,
        "detail": "delivered: HTTP 200 (attempt 1)",
    }  # GET shows the delivery's attempts
    assert json.loads(got.body) == {**record, "webhook": None}  # the same JSON as GET /v1/jobs/{id}
    assert record["state"] == "cancelled" and record["id"] == job_id
    assert got.headers["content-type"] == "application/json"
    assert got.headers["x-homefleet-event"] == "job.ended"
    timestamp = got.headers["x-homefleet-timestamp"]
    assert abs(int(timestamp) - time.time()) < 60
    assert got.headers["x-homefleet-signature"] == sign(TEST_WEBHOOK_SECRET, int(timestamp), got.body)
    assert verify(TEST_WEBHOOK_SECRET, timestamp, got.headers["x-homefleet-signature"], got.body)
    assert not verify("another-secret-0123456789", timestamp, got.headers["x-homefleet-signature"], got.body)
    assert not verify(TEST_WEBHOOK_SECRET, timestamp, got.headers["x-homefleet-signature"], got.body + b" ")
    [delivery] = hook_ctx.outbox.of_job(job_id)
    assert got.headers["x-homefleet-delivery"] == str(delivery.id)
    assert (delivery.state, delivery.attempts, delivery.job_state) == (DELIVERED, 1, "cancelled")
    assert webhook_events(hook_ctx, job_id) == ["delivered: HTTP 200 (attempt 1)"]
    job = hook_ctx.journal.get(job_id)
    assert job.api_key_id == key_id({}, TEST_API_KEY) and TEST_API_KEY not in json.dumps(record)


def test_a_receiver_that_fails_twice_gets_three_attempts_each_journaled(hook_ctx: ServerContext) -> None:
    with (
        webhook_receiver(statuses=[500, 502]) as receiver,
        TestClient(create_app(hook_ctx.settings, hook_ctx), headers=AUTH) as client,
    ):
        job_id = str(submit(client, receiver.url)["id"])
        client.post(f"/v1/jobs/{job_id}/cancel")
        wait_for(lambda: hook_ctx.outbox.of_job(job_id)[0].state == DELIVERED, timeout_s=10, what="delivered")
        time.sleep(0.3)  # nothing more comes
        metrics = client.get("/metrics").text
    assert 'homefleet_webhook_attempts_total{outcome="retry"} 2.0' in metrics
    assert 'homefleet_webhook_attempts_total{outcome="delivered"} 1.0' in metrics
    assert "homefleet_webhook_delivery_seconds_count 1.0" in metrics
    assert len(receiver.received) == 3
    assert webhook_events(hook_ctx, job_id) == [
        "attempt 1: HTTP 500; next in 0.05 s",
        "attempt 2: HTTP 502; next in 0.1 s",
        "delivered: HTTP 200 (attempt 3)",
    ]
    first, second, third = receiver.received
    assert second.at_s - first.at_s >= 0.05 and third.at_s - second.at_s >= 0.1  # the backoff was waited out
    assert len({r.headers["x-homefleet-delivery"] for r in receiver.received}) == 1  # one delivery, three attempts
    assert all(json.loads(r.body) == json.loads(first.body) for r in receiver.received)
    assert all(
        verify(TEST_WEBHOOK_SECRET, r.headers["x-homefleet-timestamp"], r.headers["x-homefleet-signature"], r.body)
        for r in receiver.received
    )
    assert hook_ctx.outbox.of_job(job_id)[0].attempts == 3


def test_a_receiver_that_always_fails_stops_at_the_bound_and_leaves_the_job_alone(
    tmp_path: Path, redis_url: str, tiny_models_dir: Path
) -> None:
    ctx = build_context(hook_settings(tmp_path, redis_url, webhook_attempts=3), hook_fleet(), migrate=True)
    ctx.registry.add(tiny_models_dir / "tiny-sd")
    bring_online(ctx, "m1", {"tiny-sd"})
    with webhook_receiver(then=503) as receiver, TestClient(create_app(ctx.settings, ctx), headers=AUTH) as client:
        job_id = str(submit(client, receiver.url)["id"])
        ended = client.post(f"/v1/jobs/{job_id}/cancel").json()
        wait_for(lambda: ctx.outbox.of_job(job_id)[0].state == FAILED, timeout_s=10, what="given up")
        time.sleep(0.5)  # well past the next pause (0.2 s): no fourth attempt
        after = client.get(f"/v1/jobs/{job_id}").json()
    assert len(receiver.received) == 3
    assert webhook_events(ctx, job_id) == [
        "attempt 1: HTTP 503; next in 0.05 s",
        "attempt 2: HTTP 503; next in 0.1 s",
        "attempt 3: HTTP 503; gave up after 3 attempts (webhook_attempts)",
    ]
    assert after["webhook"]["state"] == FAILED and after["webhook"]["attempts"] == 3, after["webhook"]
    assert after["webhook"]["detail"].endswith("gave up after 3 attempts (webhook_attempts)")
    assert {**after, "webhook": None} == ended  # the job's record is unchanged: state, reason, message, times
    assert (after["state"], after["reason"]) == ("cancelled", "cancelled")
    assert ctx.outbox.count(PENDING) == 0


def test_an_unreachable_receiver_is_an_attempt_too(hook_ctx: ServerContext) -> None:
    with webhook_receiver() as receiver:
        dead = receiver.url  # its port is closed once the block ends
    ctx = hook_ctx
    ctx.settings.webhook_attempts = 2
    with TestClient(create_app(ctx.settings, ctx), headers=AUTH) as client:
        job_id = str(submit(client, dead)["id"])
        client.post(f"/v1/jobs/{job_id}/cancel")
        wait_for(lambda: ctx.outbox.of_job(job_id)[0].state == FAILED, timeout_s=10, what="given up")
    first, last = webhook_events(ctx, job_id)
    assert first.startswith("attempt 1: ConnectError: ") and first.endswith("; next in 0.05 s")
    assert last.startswith("attempt 2: ConnectError: ") and last.endswith(
        "; gave up after 2 attempts (webhook_attempts)"
    )
    assert ctx.journal.get(job_id).state == JobState.cancelled


def test_a_redirecting_receiver_is_told_to_give_the_url_it_redirects_to(hook_ctx: ServerContext) -> None:
    """A receiver behind a redirect (http -> https, a moved path) is never followed (docs/api.md
    "Webhooks"); each attempt's detail names where it pointed and the fix, not a bare
    ``HTTP 308`` repeated until the server gives up."""
    hook_ctx.settings.webhook_attempts = 2
    with (
        webhook_receiver(then=308, location="https://127.0.0.1/hooks/new") as receiver,
        TestClient(create_app(hook_ctx.settings, hook_ctx), headers=AUTH) as client,
    ):
        job_id = str(submit(client, receiver.url)["id"])
        client.post(f"/v1/jobs/{job_id}/cancel")
        wait_for(lambda: hook_ctx.outbox.of_job(job_id)[0].state == FAILED, timeout_s=10, what="given up")
    first, last = webhook_events(hook_ctx, job_id)
    hint = "HTTP 308: a redirect to 'https://127.0.0.1/hooks/new', never followed; make that URL the job's webhook_url"
    assert first == f"attempt 1: {hint}; next in 0.05 s"
    assert last == f"attempt 2: {hint}; gave up after 2 attempts (webhook_attempts)"
    assert len(receiver.received) == 2


def test_a_receiver_whose_certificate_the_server_does_not_trust_is_told_to_give_its_ca(
    hook_ctx: ServerContext, tls_server: tuple[str, Path]
) -> None:
    """An HTTPS receiver with a self-signed certificate (or a private CA's) fails every attempt
    in the TLS handshake; the detail says so and names the fix: the CA in the server's
    ``SSL_CERT_FILE`` (or ``SSL_CERT_DIR``), as for a joining worker."""
    url, _cert = tls_server
    hook_ctx.settings.webhook_attempts = 1
    with TestClient(create_app(hook_ctx.settings, hook_ctx), headers=AUTH) as client:
        job_id = str(submit(client, url + "/hook")["id"])
        client.post(f"/v1/jobs/{job_id}/cancel")
        wait_for(lambda: hook_ctx.outbox.of_job(job_id)[0].state == FAILED, timeout_s=10, what="given up")
    [detail] = webhook_events(hook_ctx, job_id)
    assert detail.startswith("attempt 1: ConnectError: ") and "CERTIFICATE_VERIFY_FAILED" in detail, detail
    assert (
        "the server does not trust the receiver's certificate: give `homefleet serve` its CA in SSL_CERT_FILE "
        "(or SSL_CERT_DIR) and start it again" in detail
    ), detail
    assert detail.endswith("; gave up after 1 attempts (webhook_attempts)"), detail


def test_hosts_outside_the_allow_list_and_keys_without_a_secret_are_refused(hook_ctx: ServerContext) -> None:
    with TestClient(create_app(hook_ctx.settings, hook_ctx), headers=AUTH) as client:
        body = {"model": "tiny-sd", "kind": "txt2img", "params": {"prompt": "a cat"}, "target": "m1"}
        evil = client.post("/v1/jobs", json={**body, "webhook_url": "https://evil.example/hook"})
        assert evil.status_code == 422
        assert evil.json()["error"] == {
            "reason": "invalid_webhook_url",
            "job_id": evil.json()["error"]["job_id"],
            "param": "webhook_url",
            "message": "webhook_url: host 'evil.example' is not in the fleet's webhook allow-list ['127.0.0.1'] "
            "(the fleet file's [webhooks] allow_hosts)",
        }
        refused = hook_ctx.journal.get(evil.json()["error"]["job_id"])
        assert (refused.state, refused.reason, refused.webhook_url) == (JobState.rejected, "invalid_webhook_url", None)
        assert hook_ctx.outbox.of_job(refused.id) == []  # nothing is ever sent to a refused host
        dry = client.post("/v1/jobs?dry_run=true", json={**body, "webhook_url": "http://evil.example/"})
        assert dry.status_code == 422 and "allow-list" in dry.json()["error"]["message"]
        for url, says in [
            ("ftp://127.0.0.1/x", "must be an absolute http:// or https:// URL, got 'ftp://127.0.0.1/x'"),
            ("/relative", "must be an absolute http:// or https:// URL"),
            ("http://u:p@127.0.0.1/", "must not carry credentials"),
            ("http://127.0.0.1:99999/", "'http://127.0.0.1:99999/' has an invalid port (99999; 1-65535)"),
            ("http://127.0.0.1/\n", "must not contain white space or control characters"),
        ]:
            answer = client.post("/v1/jobs", json={**body, "webhook_url": url})
            assert answer.status_code == 422 and answer.json()["error"]["message"].startswith(f"webhook_url: {says}"), (
                answer.text
            )
        other = client.post(
            "/v1/jobs",
            json={**body, "webhook_url": "http://127.0.0.1:1/hook"},
            headers={"Authorization": f"Bearer {OTHER_KEY}"},
        )
        assert other.status_code == 422
        assert other.json()["error"]["message"] == (
            f"webhook_url: the API key (id {key_id({}, OTHER_KEY)}) that submitted it has no webhook secret, and every "
            "webhook is signed; the operator sets webhook_secrets (HOMEFLEET_WEBHOOK_SECRETS) for it"
        )
        too_long = client.post("/v1/jobs", json={**body, "webhook_url": "http://127.0.0.1/" + "x" * 2048})
        assert too_long.status_code == 422 and "webhook_url" in too_long.json()["error"]["message"]


def test_a_job_refused_after_its_webhook_passed_is_delivered_rejected(hook_ctx: ServerContext) -> None:
    with webhook_receiver() as receiver, TestClient(create_app(hook_ctx.settings, hook_ctx), headers=AUTH) as client:
        refused = client.post(
            "/v1/jobs",
            json={
                "model": "tiny-sd",
                "kind": "txt2img",
                "params": {"prompt": "a cat"},
                "target": "m2",
                "webhook_url": receiver.url,
            },
        )  # m2 is offline
        assert refused.status_code == 503
        [got] = wait_for(lambda: receiver.received, timeout_s=10, what="the webhook")
        record = client.get(f"/v1/jobs/{refused.json()['error']['job_id']}").json()
    assert json.loads(got.body) == {**record, "webhook": None}  # GET adds the delivery's attempts
    assert (record["state"], record["reason"]) == ("rejected", "machine_unavailable")


def test_only_an_end_writes_a_delivery_in_its_transition(hook_ctx: ServerContext) -> None:
    """Every terminal transition goes through Journal.transition (or add, for rejected): the
    claim (queued -> running) writes none, the end writes one, a job without a webhook none."""
    with webhook_receiver() as receiver:
        hooked = hook_ctx.dispatcher.submit(
            "tiny-sd", "txt2img", {"prompt": "a"}, "m1", webhook_url=receiver.url, api_key_id=key_id({}, TEST_API_KEY)
        ).job
    plain = hook_ctx.dispatcher.submit("tiny-sd", "txt2img", {"prompt": "b"}, "m1").job
    for job in (hooked, plain):
        hook_ctx.journal.claim(job.id, "m1", "boot", "claim")
    assert hook_ctx.outbox.of_job(hooked.id) == []
    hook_ctx.journal.fail(hooked.id, "m1", "error", "boom")
    hook_ctx.journal.fail(plain.id, "m1", "error", "boom")
    [delivery] = hook_ctx.outbox.of_job(hooked.id)
    assert (delivery.state, delivery.job_state, delivery.url, delivery.attempts) == (PENDING, "failed", receiver.url, 0)
    assert hook_ctx.outbox.of_job(plain.id) == []
    assert hook_ctx.webhook_wakeup.is_set()  # the journal woke the (here absent) delivery loop


def test_a_pending_delivery_is_resumed_by_the_next_server(
    tmp_path: Path, redis_url: str, tiny_models_dir: Path
) -> None:
    settings = hook_settings(tmp_path, redis_url, webhook_backoff_s=1.5)
    first = build_context(settings, hook_fleet(), migrate=True)
    first.registry.add(tiny_models_dir / "tiny-sd")
    bring_online(first, "m1", {"tiny-sd"})
    with webhook_receiver(then=500) as receiver:
        with TestClient(create_app(settings, first), headers=AUTH) as client:
            job_id = str(submit(client, receiver.url)["id"])
            client.post(f"/v1/jobs/{job_id}/cancel")
            wait_for(lambda: webhook_events(first, job_id), timeout_s=10, what="the first attempt")
        # the first server stopped (its loop with it) during the 1.5 s pause: the delivery waits in the journal
        [pending] = first.outbox.of_job(job_id)
        assert (pending.state, pending.attempts) == (PENDING, 1)
        receiver.then = 200
        second = build_context(settings, hook_fleet())  # a new server on the same journal
        with TestClient(create_app(settings, second), headers=AUTH):
            wait_for(lambda: second.outbox.of_job(job_id)[0].state == DELIVERED, timeout_s=10, what="resumed")
    assert len(receiver.received) == 2
    assert webhook_events(second, job_id) == ["attempt 1: HTTP 500; next in 1.5 s", "delivered: HTTP 200 (attempt 2)"]


def test_an_end_made_while_no_server_runs_is_delivered_when_one_starts(hook_ctx: ServerContext) -> None:
    """A CLI command (``homefleet purge``) ends jobs with no delivery loop in its process."""
    with webhook_receiver() as receiver:
        job = hook_ctx.dispatcher.submit(
            "tiny-sd", "txt2img", {"prompt": "a"}, "m1", webhook_url=receiver.url, api_key_id=key_id({}, TEST_API_KEY)
        ).job
        [purged] = hook_ctx.dispatcher.purge("m1")
        assert purged.id == job.id and hook_ctx.outbox.of_job(job.id)[0].state == PENDING
        with TestClient(create_app(hook_ctx.settings, hook_ctx), headers=AUTH):
            [got] = wait_for(lambda: receiver.received, timeout_s=10, what="the webhook")
    assert (json.loads(got.body)["state"], json.loads(got.body)["reason"]) == ("cancelled", "purged")


def test_a_lease_lets_one_server_attempt_a_delivery_and_expires(sql_ctx: ServerContext) -> None:
    """On SQLite and PostgreSQL: two delivery loops on one journal never attempt the same
    delivery at once; a loop killed mid-attempt leaves a lease that expires."""
    job = sql_ctx.journal.add(
        Job(
            state=JobState.queued,
            model_id="m",
            kind="txt2img",
            params={},
            target="m1",
            machine="m1",
            webhook_url="http://127.0.0.1:1/hook",
        )
    )
    assert sql_ctx.outbox.next_due_s(time.time()) is None  # not ended: nothing to deliver
    sql_ctx.journal.cancel(job.id)
    [delivery] = sql_ctx.outbox.of_job(job.id)
    now = time.time()
    assert delivery.due_s <= now and sql_ctx.outbox.next_due_s(now) == delivery.due_s
    assert [d.id for d in sql_ctx.outbox.due(now, 10)] == [delivery.id]
    assert sql_ctx.outbox.due(now, 10, skip=[delivery.id or 0]) == []
    assert sql_ctx.outbox.lease(delivery.id or 0, now, now + 15)
    assert not sql_ctx.outbox.lease(delivery.id or 0, now + 1, now + 16)  # a second server is refused
    assert sql_ctx.outbox.due(now + 1, 10) == [] and sql_ctx.outbox.next_due_s(now + 1) == now + 15
    assert [d.id for d in sql_ctx.outbox.due(now + 16, 10)] == [delivery.id]  # the lease expired: resumed
    assert sql_ctx.outbox.lease(delivery.id or 0, now + 16, now + 31)
    sql_ctx.outbox.record(delivery, 1, DELIVERED, "delivered: HTTP 200 (attempt 1)", delivery.due_s)
    assert not sql_ctx.outbox.lease(delivery.id or 0, now + 40, now + 55)  # delivered: never again
    assert sql_ctx.outbox.next_due_s(now + 40) is None
    assert [(e.event, e.detail) for e in sql_ctx.journal.events(job.id)][-1] == (
        EVENT,
        "delivered: HTTP 200 (attempt 1)",
    )
    assert sql_ctx.journal.get(job.id).state == JobState.cancelled


def test_a_secret_removed_before_the_attempt_sends_nothing_unsigned(hook_ctx: ServerContext) -> None:
    with webhook_receiver() as receiver, TestClient(create_app(hook_ctx.settings, hook_ctx), headers=AUTH) as client:
        job_id = str(submit(client, receiver.url)["id"])
        hook_ctx.settings.webhook_secrets = {}  # as a restart with the secret taken out of the settings
        client.post(f"/v1/jobs/{job_id}/cancel")
        wait_for(lambda: hook_ctx.outbox.of_job(job_id)[0].state == FAILED, timeout_s=10, what="given up")
    assert receiver.received == []
    assert webhook_events(hook_ctx, job_id) == [
        f"attempt 1: not sent: API key (id {key_id({}, TEST_API_KEY)}) has no webhook secret (webhook_secrets); gave up"
    ]
