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
    assert refused.status_code == 400, refused.text
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


@pytest.fixture
def split_fleet(settings: Settings, tiny_text_dir: Path) -> Iterator[tuple[TestClient, ServerContext]]:
    """A server that runs images only and m1 that runs text: the server verifies every model in
    its own folder (text ones too), m1 only what was synced there."""
    fleet = make_fleet("m1", families=frozenset({"gpt2", "llama"}))
    server = fleet.machines["server"].model_copy(update={"families": frozenset({"sd1"})})
    fleet = fleet.model_copy(update={"machines": {**fleet.machines, "server": server}})
    ctx = build_context(settings, fleet, migrate=True)
    for model in ("a-unsynced-llama", CHAT):
        ctx.registry.add(tiny_text_dir / CHAT, model)
    bring_online(ctx, "server", {"a-unsynced-llama", CHAT})
    bring_online(ctx, "m1", {CHAT})
    with TestClient(create_app(settings, ctx), headers={"Authorization": f"Bearer {TEST_API_KEY}"}) as client:
        yield client, ctx


def test_the_default_is_a_model_the_request_s_target_runs_now(split_fleet: tuple[TestClient, ServerContext]) -> None:
    """R4, R9, R10: a model counts as runnable on a machine that supports its family, verified
    it and is online, not draining; for ``auto`` on any such machine, for a named target there."""
    client, ctx = split_fleet
    assert default_model(ctx, "text", chat=True, target="auto") == CHAT  # not the one m1 lacks
    assert default_model(ctx, "text", target="m1") == CHAT
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "target": "auto"}
    answer = client.post("/v1/chat/completions", json=body, headers={"Prefer": "wait=1"})
    assert answer.status_code == 409 and answer.json()["error"]["code"] == "job_pending", answer.text
    [job] = ctx.journal.list([JobState.queued])
    assert (job.model_id, job.machine) == (CHAT, "m1")
    generate = client.post(
        "/generate", json={"inputs": "hi", "parameters": {"max_new_tokens": 2}}, headers={"Prefer": "wait=1"}
    )
    assert generate.status_code == 409, generate.text  # TGI's target is auto: queued on m1 too
    assert {j.model_id for j in ctx.journal.list([JobState.queued])} == {CHAT}

    # The server runs no text: nothing is runnable there, so the order is by id, and the pinned
    # request is refused naming why (the default target is the server, R9).
    assert default_model(ctx, "text", target="server") == "a-unsynced-llama"
    refused = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "family_not_supported", refused.text

    ctx.redis.set(ctx.keys.draining("m1"), "1")  # nothing new is placed there
    assert default_model(ctx, "text", chat=True, target="auto") == "a-unsynced-llama"
