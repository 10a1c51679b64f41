"""Chat templates as people's downloads have them (R22): a template that refuses some roles
(Mistral's and Llama 2's raise on a system message) answers 422 ``invalid_messages`` quoting it,
never a 500, through the official ``openai`` SDK, streaming or not; a template that does not
compile, or refuses a lone user message, is refused at registration (``invalid_chat_template``);
one that stops compiling later answers 422 ``chat_template_broken``. The real ASGI app on a real
Redis and journal; no worker runs (nothing is queued by a refusal)."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from fastapi.testclient import TestClient

from app.api.server import create_app
from app.context import ServerContext, build_context
from app.core.config import Settings
from app.core.errors import Rejected
from app.core.textgen import ChatTemplateBroken, chat_prompt, load_tokenizer
from tests.helpers import TEST_API_KEY, bring_online, make_fleet

MISTRAL_STYLE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
    "{% elif m['role'] == 'assistant' %}{{ m['content'] }}{{ eos_token }}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}"
)
DOES_NOT_COMPILE = "{% for m in messages %}{{ m['content'] }}{% if %}{% endfor %}"
REFUSES_EVERYTHING = "{{ raise_exception('This model has no chat: use completions') }}"


def with_template(tiny_text_dir: Path, out: Path, template: str) -> Path:
    folder = Path(shutil.copytree(tiny_text_dir / "tiny-llama", out))
    (folder / "chat_template.jinja").write_text(template)
    return folder


@pytest.fixture
def api(settings: Settings, tiny_text_dir: Path, tmp_path: Path) -> Iterator[tuple[TestClient, ServerContext]]:
    ctx = build_context(settings, make_fleet(families=frozenset({"llama"})), migrate=True)
    ctx.registry.add(with_template(tiny_text_dir, tmp_path / "mistral-style", MISTRAL_STYLE), "mistral-style")
    bring_online(ctx, "server", {"mistral-style"})
    with TestClient(create_app(settings, ctx), headers={"Authorization": f"Bearer {TEST_API_KEY}"}) as client:
        yield client, ctx


def sdk(client: TestClient) -> openai.OpenAI:
    return openai.OpenAI(api_key=TEST_API_KEY, base_url=f"{client.base_url}/v1", http_client=client, timeout=2.0)


@pytest.mark.parametrize("stream", [False, True])
def test_r22_a_system_message_the_template_refuses_is_a_422_quoting_it_not_a_500(
    api: tuple[TestClient, ServerContext], stream: bool
) -> None:
    client, ctx = api
    messages: Any = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    with pytest.raises(openai.BadRequestError) as refused:
        sdk(client).chat.completions.create(model="mistral-style", messages=messages, max_tokens=4, stream=stream)
    body = refused.value.body
    assert isinstance(body, dict), body
    assert (body["code"], body["param"]) == ("invalid_messages", "messages"), body
    assert body["message"] == (
        "model 'mistral-style': the model's chat template refused these messages: Only user and assistant "
        "roles are supported!"
    )
    assert ctx.journal.list() == [] or all(job.state == "rejected" for job in ctx.journal.list())
    prompt = ctx.dispatcher.validator.chat_prompt("mistral-style", [{"role": "user", "content": "hi"}])
    assert prompt.endswith("[INST] hi [/INST]")  # the roles it takes are templated as it says


@pytest.mark.parametrize(
    ("template", "said"),
    [
        (DOES_NOT_COMPILE, "does not compile (line 1: "),
        (REFUSES_EVERYTHING, "refused these messages: This model has no chat: use completions"),
    ],
)
def test_r22_a_template_that_cannot_template_one_user_message_is_refused_at_registration(
    settings: Settings, tiny_text_dir: Path, tmp_path: Path, template: str, said: str
) -> None:
    ctx = build_context(settings, make_fleet(families=frozenset({"llama"})), migrate=True)
    try:
        folder = with_template(tiny_text_dir, tmp_path / "templated", template)
        with pytest.raises(Rejected) as refused:
            ctx.registry.add(folder, "templated")
        assert refused.value.reason == "invalid_chat_template"
        assert refused.value.message.startswith("templated: its chat template (chat_template.jinja) cannot template ")
        assert said in refused.value.message
        assert ctx.registry.list() == [] and not ctx.registry.folder("templated").exists()
    finally:
        ctx.close()


def test_r22_a_template_that_stops_compiling_answers_422_chat_template_broken(
    api: tuple[TestClient, ServerContext], tiny_text_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tokenizer the server holds, its template broken (as a transformers upgrade can
    break an old template): the request is not at fault, and the answer says who fixes what."""
    client, ctx = api
    broken = load_tokenizer(tiny_text_dir / "tiny-llama")
    broken.chat_template = DOES_NOT_COMPILE
    with pytest.raises(ChatTemplateBroken):
        chat_prompt(broken, [{"role": "user", "content": "hi"}])
    monkeypatch.setattr(ctx.dispatcher.validator.tokenizers, "tokenizer", lambda model_id: broken)
    answer = client.post(
        "/v1/chat/completions",
        json={"model": "mistral-style", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
    )
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert (error["code"], error["param"]) == ("chat_template_broken", "messages"), error
    assert "does not compile" in error["message"] and "homefleet models update" in error["message"]
