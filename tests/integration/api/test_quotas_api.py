"""Per-key quotas through the real ASGI app on a real Redis and journal: the 429, its
``Retry-After`` and message on ``POST /v1/jobs``, through Homefleet's own client (``ApiError``
with the reason) and through the official ``openai`` SDK (``RateLimitError``; with its default
retries it waits the ``Retry-After`` and tries again, and one accepted call still makes one job,
R20). No worker runs: jobs stay queued until a test cancels or ends them."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from app.api.server import create_app
from app.client import ApiError, HomefleetClient
from app.context import ServerContext, build_context
from app.core.config import Settings
from app.core.states import JobState
from tests.helpers import TEST_API_KEY, bring_online, make_fleet, wait_for

MODEL = "tiny-sd"
CI_KEY = "ci-key-0123456789abcdef"
GPU_KEY = "gpu-key-0123456789abcdef"
QUEUED_MESSAGE = (
    "api key 'ci' is over its quota max_queued_jobs=1 (1 queued or running); retry once one of its jobs has ended"
)


@pytest.fixture
def api(settings: Settings, tiny_models_dir: Path) -> Iterator[tuple[TestClient, ServerContext]]:
    settings = Settings(
        **{
            **settings.model_dump(),
            "api_keys": [CI_KEY, GPU_KEY, TEST_API_KEY],
            "retry_after_s": 1,
            "api_key_quotas": {
                "ci": {"key_prefix": "ci-key-", "max_queued_jobs": 1},
                "gpu": {"key_prefix": "gpu-key-", "max_gpu_seconds_per_hour": 10},
            },
        }
    )
    ctx = build_context(settings, make_fleet("m1"), migrate=True)
    ctx.registry.add(tiny_models_dir / MODEL, MODEL)
    bring_online(ctx, "server", {MODEL})
    with TestClient(create_app(settings, ctx)) as client:
        yield client, ctx


def post_job(client: TestClient, key: str, prompt: str = "a cat") -> object:
    return client.post(
        "/v1/jobs",
        json={"model": MODEL, "kind": "txt2img", "params": {"prompt": prompt}},
        headers={"Authorization": f"Bearer {key}"},
    )


def rejected(ctx: ServerContext, reason: str) -> list[str]:
    return [job.id for job in ctx.journal.list([JobState.rejected]) if job.reason == reason]


def homefleet_client(client: TestClient, key: str) -> HomefleetClient:
    """Homefleet's own client over the in-process app (its httpx client swapped for the test's)."""
    own = HomefleetClient(str(client.base_url), api_key=key)
    own.http.close()
    own.http = client
    client.headers["Authorization"] = f"Bearer {key}"
    return own


def test_a_dry_run_over_the_key_quota_or_the_fleet_bound_shows_the_refusal(
    api: tuple[TestClient, ServerContext],
) -> None:
    """``?dry_run=true`` shows the decision a submission would get (docs/api.md, ``POST
    /v1/jobs``): at the key's quota (or the fleet's ``max_pending_total``, R23) a submission is
    429, so the dry run's ``machine`` is null and its ``error`` names that refusal, not a
    machine the job would never reach; nothing is journaled."""
    client, ctx = api
    body = {"model": MODEL, "kind": "txt2img", "params": {"prompt": "a cat"}}
    ci = {"Authorization": f"Bearer {CI_KEY}"}
    assert client.post("/v1/jobs", json=body, headers=ci).status_code == 202
    dry = client.post("/v1/jobs", params={"dry_run": "true"}, json=body, headers=ci)
    assert dry.status_code == 200, dry.text
    assert dry.json()["machine"] is None
    assert dry.json()["error"] == {"reason": "quota_queued", "message": QUEUED_MESSAGE}
    other = {"Authorization": f"Bearer {TEST_API_KEY}"}  # a key under no quota: still placed
    assert client.post("/v1/jobs", params={"dry_run": "true"}, json=body, headers=other).json()["machine"] == "server"
    ctx.settings.max_pending_total = 1
    full = client.post("/v1/jobs", params={"dry_run": "true"}, json=body, headers=other).json()
    assert (full["machine"], full["error"]["reason"]) == (None, "fleet_full")
    assert "max_pending_total = 1" in full["error"]["message"]
    assert len(ctx.journal.list()) == 1  # the one accepted job: a dry run journals nothing


def test_post_jobs_over_the_queued_quota_is_429_with_retry_after_and_names_the_quota(
    api: tuple[TestClient, ServerContext],
) -> None:
    client, ctx = api
    first = post_job(client, CI_KEY)
    assert first.status_code == 202, first.text
    refused = post_job(client, CI_KEY, prompt="second")
    assert refused.status_code == 429 and refused.headers["Retry-After"] == "1"
    error = refused.json()["error"]
    assert (error["reason"], error["message"]) == ("quota_queued", QUEUED_MESSAGE)
    journaled = ctx.journal.get(error["job_id"])
    assert (journaled.state, journaled.reason, journaled.api_key_id) == (JobState.rejected, "quota_queued", "ci")
    assert ctx.journal.get(first.json()["id"]).api_key_id == "ci"
    assert post_job(client, TEST_API_KEY).status_code == 202  # a key under no quota is not limited
    # Homefleet's own client: an ApiError with the reason, the status and the Retry-After.
    with pytest.raises(ApiError) as raised:
        homefleet_client(client, CI_KEY).submit(MODEL, "txt2img", {"prompt": "third"})
    assert (raised.value.status_code, raised.value.reason, raised.value.retry_after_s) == (429, "quota_queued", 1)
    assert raised.value.message == QUEUED_MESSAGE
    # Requeueing is a submission of the key that asks: the same quota.
    requeue = client.post(f"/v1/jobs/{first.json()['id']}/requeue", headers={"Authorization": f"Bearer {CI_KEY}"})
    assert requeue.status_code == 429 and requeue.json()["error"]["reason"] == "quota_queued"
    assert len(ctx.journal.list([JobState.queued])) == 2 and len(rejected(ctx, "quota_queued")) == 3


def test_the_gpu_seconds_quota_answers_when_the_hours_usage_will_have_expired(
    api: tuple[TestClient, ServerContext],
) -> None:
    client, ctx = api
    done = post_job(client, GPU_KEY).json()["id"]
    ctx.journal.claim(done, "server")
    ctx.journal.succeed(done, "server", load_s=2.0, run_s=9.0, finished_at=datetime.now(UTC) - timedelta(seconds=600))
    ctx.endings.finished(ctx.journal.get(done))
    refused = post_job(client, GPU_KEY)
    assert refused.status_code == 429
    assert 2999 <= int(refused.headers["Retry-After"]) <= 3001  # the 11 s leave the hour 3000 s from now
    error = refused.json()["error"]
    assert error["reason"] == "quota_gpu_seconds"
    assert error["message"].startswith("api key 'gpu' is over its quota max_gpu_seconds_per_hour=10 (11.0 GPU-seconds")
    with pytest.raises(ApiError) as raised:
        homefleet_client(client, GPU_KEY).submit(MODEL, "txt2img", {"prompt": "again"})
    assert (raised.value.status_code, raised.value.reason) == (429, "quota_gpu_seconds")
    assert raised.value.retry_after_s is not None and raised.value.retry_after_s >= 2999


def test_openai_sdk_sees_a_rate_limit_error_with_retry_after(api: tuple[TestClient, ServerContext]) -> None:
    import openai

    client, ctx = api
    assert post_job(client, CI_KEY).status_code == 202
    sdk = openai.OpenAI(api_key=CI_KEY, base_url=f"{client.base_url}/v1", http_client=client, max_retries=0)
    with pytest.raises(openai.RateLimitError) as raised:
        sdk.images.generate(model=MODEL, prompt="over quota", size="64x64")
    error = raised.value
    assert error.status_code == 429 and error.response.headers["retry-after"] == "1"
    assert error.code == "quota_queued" and error.type == "rate_limit_error"
    assert error.body["message"] == QUEUED_MESSAGE  # type: ignore[index]
    assert "x-should-retry" not in error.response.headers  # nothing was submitted: a retry is safe
    [journaled] = rejected(ctx, "quota_queued")
    assert ctx.journal.get(journaled).api_key_id == "ci"
    with pytest.raises(openai.RateLimitError):
        sdk.images.generate(model=MODEL, prompt="over quota again", size="64x64")
    assert len(ctx.journal.list([JobState.queued])) == 1


def test_openai_sdk_default_retries_wait_the_retry_after_and_one_call_makes_one_job(
    api: tuple[TestClient, ServerContext],
) -> None:
    """With ``max_retries=2`` (the default) the SDK retries a 429 after its Retry-After (1 s
    here). Still over the quota, the call ends in RateLimitError after 3 attempts, each refused
    and journaled. Once the key's job is cancelled between attempts, the retry is accepted and
    the call makes exactly one job, whose wait ends in 409 ``job_pending`` (no retry: R20)."""
    import openai

    client, ctx = api
    blocker = post_job(client, CI_KEY).json()["id"]
    sdk = openai.OpenAI(api_key=CI_KEY, base_url=f"{client.base_url}/v1", http_client=client)
    assert sdk.max_retries == 2
    start = time.monotonic()
    with pytest.raises(openai.RateLimitError):
        sdk.images.generate(model=MODEL, prompt="still over", size="64x64", timeout=5)
    assert time.monotonic() - start >= 2.0  # it waited Retry-After (1 s) before each of its 2 retries
    assert len(rejected(ctx, "quota_queued")) == 3  # 1 + 2 retries, all refused, nothing queued
    assert [j.id for j in ctx.journal.list([JobState.queued])] == [blocker]

    outcome: dict[str, BaseException] = {}

    def call() -> None:
        try:
            sdk.images.generate(model=MODEL, prompt="accepted on retry", size="64x64", timeout=3)
        except openai.APIStatusError as error:
            outcome["error"] = error

    caller = threading.Thread(target=call)
    caller.start()
    wait_for(lambda: len(rejected(ctx, "quota_queued")) == 4, timeout_s=10, what="the call's first refusal")
    ctx.dispatcher.cancel(blocker)  # the key's job ends: its retry, 1 s later, fits the quota
    caller.join(timeout=30)
    assert not caller.is_alive()
    error = outcome["error"]
    assert isinstance(error, openai.ConflictError) and error.code == "job_pending"  # type: ignore[attr-defined]
    assert error.response.headers["x-should-retry"] == "false"
    [job] = list(ctx.journal.list([JobState.queued]))
    assert job.params["prompt"] == "accepted on retry" and job.api_key_id == "ci"
    assert error.body["job_ids"] == [job.id]  # type: ignore[index]
    assert len(rejected(ctx, "quota_queued")) == 4  # the accepted retry was the call's second and last attempt


def test_openai_sdk_does_not_retry_a_gpu_quota_whose_retry_after_is_beyond_its_limit(
    api: tuple[TestClient, ServerContext],
) -> None:
    """The SDK honours a Retry-After of at most 2 minutes; a GPU-seconds quota that clears in an
    hour is reported at once, with the hint, instead of being retried in vain."""
    import openai

    client, ctx = api
    done = post_job(client, GPU_KEY).json()["id"]
    ctx.journal.claim(done, "server")
    ctx.endings.finished(ctx.journal.succeed(done, "server", load_s=0.5, run_s=20.0))
    sdk = openai.OpenAI(api_key=GPU_KEY, base_url=f"{client.base_url}/v1", http_client=client)
    start = time.monotonic()
    with pytest.raises(openai.RateLimitError) as raised:
        sdk.images.generate(model=MODEL, prompt="no gpu left", size="64x64", timeout=5)
    assert time.monotonic() - start < 60  # not the hour Retry-After names: the SDK did not wait to retry
    assert raised.value.code == "quota_gpu_seconds" and int(raised.value.response.headers["retry-after"]) >= 3590
    assert len(rejected(ctx, "quota_gpu_seconds")) == 1  # one attempt


@pytest.fixture
def text_api(settings: Settings, tiny_text_dir: Path) -> Iterator[tuple[TestClient, ServerContext]]:
    """The app with a tiny text model on the server machine; key 'ci' may have one job at once."""
    settings = Settings(
        **{
            **settings.model_dump(),
            "api_keys": [CI_KEY],
            "retry_after_s": 1,
            "api_key_quotas": {"ci": {"key_prefix": "ci-key-", "max_queued_jobs": 1}},
        }
    )
    ctx = build_context(settings, make_fleet(families=frozenset({"llama"})), migrate=True)
    ctx.registry.add(tiny_text_dir / "tiny-llama", "tiny-llama")
    bring_online(ctx, "server", {"tiny-llama"})
    with TestClient(create_app(settings, ctx), headers={"Authorization": f"Bearer {CI_KEY}"}) as client:
        yield client, ctx


def test_the_text_routes_answer_a_key_over_its_quota_with_429_in_their_shapes(
    text_api: tuple[TestClient, ServerContext],
) -> None:
    """OpenAI's completions and chat completions (also streaming: refused before any stream
    starts) raise RateLimitError in the SDK; TGI's routes answer its shape, ``overloaded``."""
    import openai

    client, ctx = text_api
    held = client.post(
        "/v1/jobs", json={"model": "tiny-llama", "kind": "text", "params": {"prompt": "hold", "max_new_tokens": 4}}
    )
    assert held.status_code == 202, held.text
    sdk = openai.OpenAI(api_key=CI_KEY, base_url=f"{client.base_url}/v1", http_client=client, max_retries=0)
    for stream in (False, True):
        with pytest.raises(openai.RateLimitError) as chat:
            sdk.chat.completions.create(
                model="tiny-llama", messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=stream
            )
        assert chat.value.code == "quota_queued" and chat.value.response.headers["retry-after"] == "1"
        with pytest.raises(openai.RateLimitError) as completion:
            sdk.completions.create(model="tiny-llama", prompt="hi", max_tokens=4, stream=stream)
        assert completion.value.code == "quota_queued"
    for route in ("/generate", "/generate_stream", "/"):
        tgi = client.post(route, json={"inputs": "hi", "model": "tiny-llama", "parameters": {"max_new_tokens": 4}})
        assert tgi.status_code == 429 and tgi.headers["Retry-After"] == "1", (route, tgi.text)
        assert tgi.json() == {"error": QUEUED_MESSAGE, "error_type": "overloaded", "reason": "quota_queued"}
    assert len(rejected(ctx, "quota_queued")) == 7 and len(ctx.journal.list([JobState.queued])) == 1
