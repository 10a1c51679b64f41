"""The model a chat gets when it names none (``huggingface_hub``'s ``InferenceClient`` sends
``"model": "dummy"`` then): the first text model by id whose tokenizer has a chat template, not
the first text model (``tiny-gpt2`` has no template and would refuse every chat). The real ASGI
app on a real Redis and journal; no worker runs (the job stays queued; the call answers 409
``job_pending`` once its announced wait is over)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from app.api.routes.images import default_model
from app.api.server import create_app
from app.context import ServerContext, build_context
from app.core.config import Settings
from app.core.states import JobState
from tests.helpers import TEST_API_KEY, bring_online, make_fleet

NO_TEMPLATE, CHAT = "tiny-gpt2", "tiny-llama"  # NO_TEMPLATE sorts first


@pytest.fixture
def api(settings: Settings, tiny_text_dir: Path) -> Iterator[tuple[TestClient, ServerContext]]:
    ctx = build_context(settings, make_fleet(families=frozenset({"gpt2", "llama"})), migrate=True)
    for model in (NO_TEMPLATE, CHAT):
        ctx.registry.add(tiny_text_dir / model, model)
    bring_online(ctx, "server", {NO_TEMPLATE, CHAT})
    with TestClient(create_app(settings, ctx), headers={"Authorization": f"Bearer {TEST_API_KEY}"}) as client:
        yield client, ctx


@pytest.mark.parametrize("body_model", [None, "dummy"])
def test_a_chat_without_a_model_gets_the_first_text_model_with_a_chat_template(
    api: tuple[TestClient, ServerContext], body_model: str | None
) -> None:
    client, ctx = api
    body: dict[str, object] = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    if body_model is not None:
        body["model"] = body_model
    answer = client.post("/v1/chat/completions", json=body, headers={"Prefer": "wait=1"})
    assert answer.status_code == 409 and answer.json()["error"]["code"] == "job_pending", answer.text
    [job] = ctx.journal.list([JobState.queued])
    assert job.model_id == CHAT and job.params["chat"] is True
    assert default_model(ctx, "text") == NO_TEMPLATE  # a plain completion's default stays the first


def test_with_no_chat_template_anywhere_the_chat_names_the_first_text_model(
    api: tuple[TestClient, ServerContext],
) -> None:
    client, ctx = api
    ctx.registry.retire(CHAT)
    assert default_model(ctx, "text", chat=True) == NO_TEMPLATE
    refused = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert refused.status_code == 422, refused.text
    error = refused.json()["error"]
    assert (
        error["code"] == "invalid_messages" and NO_TEMPLATE in error["message"] and "chat template" in error["message"]
    )


def test_a_model_no_online_machine_holds_is_chosen_last(
    api: tuple[TestClient, ServerContext], tiny_text_dir: Path
) -> None:
    """A model registered but synced nowhere yet (its id sorts first) is not the default while
    others run somewhere: a request naming no model would only wait or be refused. With no
    machine online, the order is by id again."""
    client, ctx = api
    unsynced = "a-unsynced-llama"
    ctx.registry.add(tiny_text_dir / CHAT, unsynced)
    assert default_model(ctx, "text", chat=True) == CHAT and default_model(ctx, "text") == NO_TEMPLATE
    answer = client.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        headers={"Prefer": "wait=1"},
    )
    assert answer.status_code == 409 and answer.json()["error"]["code"] == "job_pending", answer.text
    assert [job.model_id for job in ctx.journal.list([JobState.queued])] == [CHAT]

    bring_online(ctx, "server", {unsynced, NO_TEMPLATE, CHAT})
    assert default_model(ctx, "text", chat=True) == unsynced  # verified now: by id
    ctx.redis.delete(ctx.keys.heartbeat("server"))  # offline: nothing runs anywhere
    assert default_model(ctx, "text", chat=True) == unsynced and default_model(ctx, "text") == unsynced
