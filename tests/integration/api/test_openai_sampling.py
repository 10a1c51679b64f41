"""What the OpenAI text routes send to a text job when the client leaves a field out, as
OpenAI's API reads it: ``temperature`` 1 (not greedy), unless the model's own defaults
(``models add --default``, R9) say otherwise; a chat's ``max_tokens`` the rest of the context;
a field sent as null taken as not given. TGI's ``/generate`` keeps TGI's greedy default. The
real ASGI app on a real Redis and journal; no worker runs (each job stays queued and the call
answers 409 ``job_pending`` once its announced wait is over)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from app.api.server import create_app
from app.context import ServerContext, build_context
from app.core.config import Settings
from app.core.states import JobState
from app.core.textgen import prompt_ids
from app.db.tables import Job
from app.devtools.tiny_text import MAX_POSITIONS
from tests.helpers import TEST_API_KEY, bring_online, make_fleet

MODEL, WARM = "tiny-llama", "warm-llama"
CHAT = [{"role": "user", "content": "hi"}]


@pytest.fixture
def api(settings: Settings, tiny_text_dir: Path) -> Iterator[tuple[TestClient, ServerContext]]:
    ctx = build_context(settings, make_fleet(families=frozenset({"llama"})), migrate=True)
    ctx.registry.add(tiny_text_dir / MODEL, MODEL)
    ctx.registry.add(tiny_text_dir / MODEL, WARM, defaults={"temperature": 0.3})
    bring_online(ctx, "server", {MODEL, WARM})
    with TestClient(create_app(settings, ctx), headers={"Authorization": f"Bearer {TEST_API_KEY}"}) as client:
        yield client, ctx


def queued(api: tuple[TestClient, ServerContext], path: str, body: dict[str, Any]) -> Job:
    """POST ``body`` to ``path`` (waiting at most 1 s) and return the one job it queued."""
    client, ctx = api
    before = {job.id for job in ctx.journal.list()}
    answer = client.post(path, json=body, headers={"Prefer": "wait=1"})
    assert answer.status_code == 409, answer.text  # job_pending: queued, no worker here
    [job] = [job for job in ctx.journal.list([JobState.queued]) if job.id not in before]
    return job


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_an_openai_request_without_a_temperature_samples_at_openais_default(
    api: tuple[TestClient, ServerContext], path: str
) -> None:
    """OpenAI's default temperature is 1: ``n``, ``seed`` and ``top_p`` change the answer only
    when sampling (a request without one decoded greedily, so ``n=3`` gave three equal choices)."""
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 2}
    body |= {"messages": CHAT} if path.endswith("chat/completions") else {"prompt": "hi"}
    assert queued(api, path, body).params["temperature"] == 1.0
    assert queued(api, path, {**body, "temperature": 0}).params["temperature"] == 0.0  # greedy when asked
    assert queued(api, path, {**body, "temperature": 0.7}).params["temperature"] == 0.7
    assert queued(api, path, {**body, "model": WARM}).params["temperature"] == 0.3  # the model's own default


def test_tgi_generate_keeps_tgis_greedy_default(api: tuple[TestClient, ServerContext]) -> None:
    job = queued(api, "/generate", {"inputs": "hi", "model": MODEL, "parameters": {"max_new_tokens": 2}})
    assert job.params.get("temperature", 0.0) == 0.0


def test_a_chat_without_max_tokens_may_use_the_rest_of_the_context(api: tuple[TestClient, ServerContext]) -> None:
    """OpenAI's chat default: a reply is not cut at 16 tokens; the job may run to the context's end."""
    job = queued(api, "/v1/chat/completions", {"model": MODEL, "messages": CHAT})
    tokenizer = api[1].dispatcher.validator.tokenizers.tokenizer(MODEL)
    prompt_tokens = len(prompt_ids(tokenizer, job.params["prompt"], chat=True))  # chat-templated: more than "hi"
    assert prompt_tokens > 2 and job.params["max_new_tokens"] == MAX_POSITIONS - prompt_tokens
    plain = queued(api, "/v1/completions", {"model": MODEL, "prompt": "x" * (MAX_POSITIONS - 4)})
    assert plain.params["max_new_tokens"] == 4  # the completion default 16, cut to the rest (it was a 422)


@pytest.mark.parametrize("field", ["n", "stream", "max_tokens", "temperature", "seed"])
def test_a_field_sent_as_null_is_not_given(api: tuple[TestClient, ServerContext], field: str) -> None:
    job = queued(api, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2, field: None})
    assert job.params["prompt"] == "hi"
