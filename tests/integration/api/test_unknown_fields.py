"""Unknown and misspelt fields on the OpenAI, TGI and Hugging Face routes are refused naming
them, never ignored (R22): ``max_tokenz`` would otherwise run with the default 16 tokens, and a
top-level ``paramters`` would drop every TGI parameter. Through the official ``openai`` SDK where
a user meets the behaviour through it (``extra_body``), through plain HTTP for TGI's and Hugging
Face's bodies (their clients send only the fields they know). The real ASGI app on a real Redis
and journal; no worker runs (an accepted call answers 409 ``job_pending`` once its wait is over)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from fastapi.testclient import TestClient

from app.api.server import create_app
from app.context import ServerContext, build_context
from app.core.config import Settings
from app.core.states import JobState
from tests.helpers import TEST_API_KEY, bring_online, make_fleet

TEXT, IMAGE = "tiny-llama", "tiny-sd"
MESSAGES: list[Any] = [{"role": "user", "content": "hi"}]


@pytest.fixture
def api(settings: Settings, tiny_text_dir: Path, tiny_models_dir: Path) -> Iterator[tuple[TestClient, ServerContext]]:
    ctx = build_context(settings, make_fleet(families=frozenset({"llama", "sd1"})), migrate=True)
    ctx.registry.add(tiny_text_dir / TEXT, TEXT)
    ctx.registry.add(tiny_models_dir / IMAGE, IMAGE)
    bring_online(ctx, "server", {TEXT, IMAGE})
    with TestClient(create_app(settings, ctx), headers={"Authorization": f"Bearer {TEST_API_KEY}"}) as client:
        yield client, ctx


def sdk(client: TestClient) -> openai.OpenAI:
    """The official SDK over the in-process app; a short timeout: an accepted call answers 409
    ``job_pending`` a fifth of it before (no worker runs)."""
    return openai.OpenAI(
        api_key=TEST_API_KEY, base_url=f"{client.base_url}/v1", http_client=client, max_retries=0, timeout=2.0
    )


def queued(ctx: ServerContext) -> int:
    return len(ctx.journal.list([JobState.queued]))


def refused_naming(error: openai.APIStatusError, field: str) -> None:
    body = error.body
    assert isinstance(body, dict), body
    assert (body["code"], body["param"]) == ("unknown_param", field), body
    assert f"`{field}`" in body["message"], body["message"]


@pytest.mark.parametrize("stream", [False, True])
def test_a_misspelt_openai_text_field_is_refused_naming_it(api: tuple[TestClient, ServerContext], stream: bool) -> None:
    """OpenAI answers ``Unrecognized request argument supplied: max_tokenz``; so does Homefleet,
    listing the fields it takes, before any job (streaming too: a plain error, no stream)."""
    client, ctx = api
    with pytest.raises(openai.APIStatusError) as chat:
        sdk(client).chat.completions.create(model=TEXT, messages=MESSAGES, stream=stream, extra_body={"max_tokenz": 3})
    assert chat.value.status_code == 400
    refused_naming(chat.value, "max_tokenz")
    assert "Unrecognized request argument supplied" in chat.value.body["message"]  # type: ignore[index]
    assert "max_completion_tokens" in chat.value.body["message"]  # type: ignore[index]  # what it takes
    with pytest.raises(openai.APIStatusError) as completion:
        sdk(client).completions.create(model=TEXT, prompt="hi", stream=stream, extra_body={"max_token": 3})
    refused_naming(completion.value, "max_token")
    with pytest.raises(openai.APIStatusError) as chat_field:  # a chat's own field is no completion's
        sdk(client).completions.create(model=TEXT, prompt="hi", extra_body={"max_completion_tokens": 3})
    refused_naming(chat_field.value, "max_completion_tokens")
    assert queued(ctx) == 0


def test_stream_options_without_stream_and_a_text_part_s_unknown_field_are_refused_naming_them(
    api: tuple[TestClient, ServerContext],
) -> None:
    """OpenAI refuses ``stream_options`` on a request that does not stream; so does Homefleet, with
    ``param`` ``stream_options``, rather than answering as if it had not been sent. A text part with
    a field it does not take (``{"type": "text", "text", "cache_control"}``) is refused naming
    ``messages.0.content`` and the field, as a message's own unknown field is: never dropped
    unread. Neither queues a job; the same requests without them run."""
    client, ctx = api
    for create in (
        lambda **extra: sdk(client).chat.completions.create(model=TEXT, messages=MESSAGES, max_tokens=2, **extra),
        lambda **extra: sdk(client).completions.create(model=TEXT, prompt="hi", max_tokens=2, **extra),
    ):
        with pytest.raises(openai.BadRequestError) as refused:
            create(stream_options={"include_usage": True})
        assert (refused.value.body["code"], refused.value.body["param"]) == (  # type: ignore[index]
            "invalid_stream_options",
            "stream_options",
        ), refused.value.body
        assert "`stream: true`" in refused.value.body["message"]  # type: ignore[index]
    part = {"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}
    with pytest.raises(openai.BadRequestError) as content:
        sdk(client).chat.completions.create(
            model=TEXT,
            messages=[{"role": "user", "content": [part]}],
            max_tokens=2,  # type: ignore[list-item]
        )
    body = content.value.body
    assert isinstance(body, dict) and body["param"] == "messages.0.content", body
    assert "'cache_control'" in body["message"], body
    assert queued(ctx) == 0
    with pytest.raises(openai.APIStatusError) as pending:  # accepted: no worker runs it here
        sdk(client).chat.completions.create(
            model=TEXT, messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}]}], max_tokens=2
        )
    assert pending.value.status_code == 409 and queued(ctx) == 1


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("frequency_penalty", 0.5),
        ("presence_penalty", -1),
        ("logit_bias", {"42": 5}),
        ("tools", [{"type": "function", "function": {"name": "f", "parameters": {}}}]),
        ("tool_choice", "required"),
        ("functions", [{"name": "f", "parameters": {}}]),
        ("modalities", ["text", "audio"]),
        ("service_tier", "flex"),
        ("parallel_tool_calls", "yes"),
    ],
)
def test_an_openai_chat_field_homefleet_does_not_run_is_refused_unless_neutral(
    api: tuple[TestClient, ServerContext], field: str, value: Any
) -> None:
    client, ctx = api
    with pytest.raises(openai.APIStatusError) as refused:
        sdk(client).chat.completions.create(model=TEXT, messages=MESSAGES, max_tokens=2, extra_body={field: value})
    refused_naming(refused.value, field)
    assert "not supported" in refused.value.body["message"]  # type: ignore[index]
    assert queued(ctx) == 0


def test_openai_fields_at_their_neutral_values_and_the_sdks_own_are_accepted(
    api: tuple[TestClient, ServerContext],
) -> None:
    """What changes nothing is taken (the call's job is queued: 409 ``job_pending`` with no worker)."""
    client, ctx = api
    with pytest.raises(openai.ConflictError) as pending:
        sdk(client).chat.completions.create(
            model=TEXT,
            messages=MESSAGES,
            max_tokens=2,
            frequency_penalty=0,
            presence_penalty=0.0,
            logit_bias={},
            logprobs=False,
            tools=[],
            tool_choice="none",
            modalities=["text"],
            stream_options=None,
            user="someone",  # labels the caller, many client libraries send it: any value
            service_tier="auto",  # OpenAI's default
            parallel_tool_calls=True,  # OpenAI's default: with no tools, no effect
            metadata={"run": "nightly"},
            extra_body={"target": "server", "top_logprobs": 0},
        )
    assert pending.value.code == "job_pending"
    with pytest.raises(openai.ConflictError):
        sdk(client).completions.create(model=TEXT, prompt="hi", max_tokens=2, echo=False, best_of=1, suffix=None)
    assert queued(ctx) == 2


@pytest.mark.parametrize("route", ["/generate", "/generate_stream", "/"])
def test_a_misspelt_tgi_field_is_refused_naming_it(api: tuple[TestClient, ServerContext], route: str) -> None:
    """TGI's serde ignores an unknown field; here ``paramters`` (every parameter dropped) and a
    misspelt parameter are refused in TGI's error shape, naming them."""
    client, ctx = api
    for body, field, takes in (
        ({"inputs": "hi", "paramters": {"max_new_tokens": 3}}, "paramters", "parameters"),
        ({"inputs": "hi", "parameters": {"max_new_token": 3}}, "parameters.max_new_token", "max_new_tokens"),
        ({"inputs": "hi", "parameters": {"foo": None}}, "parameters.foo", "max_new_tokens"),
    ):
        answer = client.post(route, json=body)
        assert answer.status_code == 422, answer.text
        error = answer.json()
        assert (error["error_type"], error["reason"]) == ("validation", "unknown_param"), error
        assert f"`{field}`" in error["error"] and takes in error["error"], error
    assert queued(ctx) == 0


def test_a_misspelt_hugging_face_field_is_refused_naming_it(api: tuple[TestClient, ServerContext]) -> None:
    client, ctx = api
    for path in (f"/hf/models/{IMAGE}", "/hf"):
        answer = client.post(path, json={"inputs": "a fox", "paramters": {"num_inference_steps": 1}})
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
        assert (error["code"], error["param"]) == ("unknown_param", "paramters"), error
        assert "`paramters`" in error["message"] and "parameters" in error["message"]
        typo = client.post(path, json={"inputs": "a fox", "parameters": {"num_inference_stepz": 1}})
        assert typo.status_code == 400 and typo.json()["error"]["param"] == "parameters.num_inference_stepz"
    assert queued(ctx) == 0


def test_a_field_post_v1_jobs_does_not_take_is_refused_naming_it_in_param(
    api: tuple[TestClient, ServerContext],
) -> None:
    """Homefleet's own route: a top-level field it does not take (``priority``), and one it
    needs left out, name the field in ``param`` as every domain refusal does, beside the
    validation's details."""
    client, ctx = api
    body = {"model": IMAGE, "kind": "txt2img", "params": {"prompt": "a fox"}, "target": "server"}
    extra = client.post("/v1/jobs", json={**body, "priority": 5})
    assert extra.status_code == 422, extra.text
    error = extra.json()["error"]
    assert (error["reason"], error["param"]) == ("invalid_request", "priority"), error
    assert error["message"] == "`body.priority`: Extra inputs are not permitted"
    assert extra.json()["detail"][0]["loc"] == ["body", "priority"]
    missing = client.post("/v1/jobs", json={k: v for k, v in body.items() if k != "model"})
    assert missing.status_code == 422 and missing.json()["error"]["param"] == "model", missing.text
    assert queued(ctx) == 0


def test_an_edit_asked_of_a_model_that_cannot_edit_says_what_an_edit_needs_and_where_its_kinds_run(
    api: tuple[TestClient, ServerContext],
) -> None:
    """OpenAI's ``images.edit`` names no kind: a refusal in Homefleet's words (``kind 'edit'``)
    alone leaves an SDK user nowhere; it says which models edit and where img2img runs."""
    import io

    from PIL import Image

    client, ctx = api
    png = io.BytesIO()
    Image.new("RGB", (64, 64), (200, 30, 30)).save(png, format="PNG")
    with pytest.raises(openai.BadRequestError) as refused:
        sdk(client).images.edit(model=IMAGE, image=("red.png", png.getvalue(), "image/png"), prompt="make it blue")
    body = refused.value.body
    assert isinstance(body, dict) and body["code"] == "kind_not_supported", body
    assert body["message"] == (
        f"model {IMAGE!r} runs kinds txt2img, img2img, inpaint; got kind 'edit': an edit (POST /v1/images/edits) "
        "changes an image from an instruction and needs a model of an edit family (sd1-pix2pix, qwen-image, "
        "flux-kontext); this model's img2img and inpaint run as jobs (POST /v1/jobs with `kind` img2img or "
        "inpaint, docs/api.md)"
    )
    assert queued(ctx) == 0


def test_a_text_model_s_form_offers_its_own_token_budget_not_the_family_s(
    api: tuple[TestClient, ServerContext],
) -> None:
    """``GET /v1/models/{id}``'s ranges build the fleet page's form: a text model's
    ``max_new_tokens`` goes up to its own budget (``max_total_tokens`` less one prompt token),
    not a family-wide million a submission would then refuse."""
    client, ctx = api
    budget = ctx.dispatcher.validator.token_limits(TEXT).max_total_tokens
    shown = client.get(f"/v1/models/{TEXT}").json()["params"]["text"]["ranges"]["max_new_tokens"]
    assert shown == {"min": 1, "max": budget - 1, "integer": True}
    assert budget < 1_000_000
