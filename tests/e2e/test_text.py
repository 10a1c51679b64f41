"""Text generation end to end: the OpenAI routes ``/v1/completions`` and ``/v1/chat/completions``
through the official ``openai`` SDK, a real API and a real ``celery worker`` running tiny
random-weight causal LMs of each architecture (Llama, Qwen2, GPT-2) built offline.

One module-scoped fleet: the API and ONE worker, machine ``m1``; a GPT-2 copy registered as
``small-gpt2`` has its own token limits in the fleet file (``[models.small-gpt2]``). The 422
limits (R22) are enforced by the server before any device, with the message naming the limit
and the figures; a refused submission is journaled ``rejected`` with its reason (R19).
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import huggingface_hub
import jsonschema
import openai
import pytest

from app.context import ServerContext, build_context
from app.core.digest import file_digest
from app.core.kinds import MAX_SEED
from app.core.states import ENDED, JobState
from app.core.tls import tls_context
from app.devtools.localfleet import LocalFleet
from app.fleet.config import ModelGuess
from tests.e2e.test_docs_browser import browser
from tests.e2e.test_fleet_page import open_page, wait_refreshes
from tests.helpers import TEST_API_KEY, fleet_files, make_fleet, wait_for

pytestmark = pytest.mark.e2e
__all__ = ["browser"]  # the fixture, shared with the /docs tests

MACHINE = "m1"
MODELS = {"tiny-llama": "tiny-llama", "tiny-qwen2": "tiny-qwen2", "tiny-gpt2": "tiny-gpt2", "small-gpt2": "tiny-gpt2"}


@dataclass
class TextFleet:
    local: LocalFleet
    ctx: ServerContext
    client: openai.OpenAI


@pytest.fixture(scope="module")
def tfleet(
    tmp_path_factory: pytest.TempPathFactory, redis_base_url: str, tiny_text_dir: Path, tiny_models_dir: Path
) -> Iterator[TextFleet]:
    fleet_config = make_fleet(MACHINE, families=frozenset({"llama", "qwen2", "gpt2", "sd1"}))
    fleet_config = fleet_config.model_copy(
        update={"models": {"small-gpt2": ModelGuess(max_input_tokens=8, max_total_tokens=12)}}
    )
    files = fleet_files(tmp_path_factory.mktemp("text-fleet"), f"{redis_base_url}/11", config=fleet_config)
    settings, fleet_file = files.settings, files.fleet_file
    ctx = build_context(settings, fleet_config, migrate=True)
    for model_id, folder in MODELS.items():
        ctx.registry.add(tiny_text_dir / folder, model_id=model_id)
    ctx.registry.add(tiny_models_dir / "tiny-sd", model_id="tiny-sd")  # prompt expansion's image model
    local = LocalFleet(settings, fleet_config, fleet_file, forkserver=True)
    client = openai.OpenAI(base_url=f"{local.api_url}/v1", api_key=TEST_API_KEY, max_retries=0, timeout=60)
    try:
        for model_id in [*MODELS, "tiny-sd"]:
            local.copy_model(model_id, MACHINE)
        local.start_api()
        local.start_worker(MACHINE)
        for model_id in [*MODELS, "tiny-sd"]:
            local.wait_online([MACHINE], model_id=model_id, timeout_s=120)
        yield TextFleet(local, ctx, client)
    finally:
        client.close()
        local.stop()
        ctx.close()


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-qwen2", "tiny-gpt2"])
def test_openai_completions_run_a_text_job_on_the_worker(tfleet: TextFleet, model: str) -> None:
    """The SDK's completion is the job's verified UTF-8 result, with the job's token counts."""
    done = tfleet.client.completions.create(
        model=model, prompt="hello", max_tokens=5, seed=7, extra_body={"target": MACHINE}
    )
    (choice,) = done.choices
    assert done.usage is not None
    assert done.usage.prompt_tokens == 5 and 1 <= done.usage.completion_tokens <= 5
    assert done.usage.total_tokens == done.usage.prompt_tokens + done.usage.completion_tokens
    assert choice.finish_reason in ("stop", "length")
    job = tfleet.ctx.journal.get(done.model_extra["job_id"])
    assert job.state == "succeeded" and job.kind == "text" and job.machine == MACHINE
    assert job.result_media_type == "text/plain" and file_digest(Path(job.result_path)) == job.result_digest  # R2
    assert Path(job.result_path).read_bytes().decode("utf-8") == choice.text
    assert job.provenance["usage"]["completion_tokens"] == done.usage.completion_tokens
    again = tfleet.client.completions.create(
        model=model, prompt="hello", max_tokens=5, seed=7, extra_body={"target": MACHINE}
    )
    assert again.choices[0].text == choice.text  # sampled at OpenAI's temperature 1 with seed 7: the same text


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-qwen2"])
def test_openai_chat_completions_template_the_messages(tfleet: TextFleet, model: str) -> None:
    """Through the SDK; tiny-qwen2's message in OpenAI's list-of-parts form, read as its text."""
    content: Any = "hi" if model == "tiny-llama" else [{"type": "text", "text": "hi"}]
    done = tfleet.client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": content}],
        max_completion_tokens=3,
        extra_body={"target": "auto"},
    )
    (choice,) = done.choices
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert done.usage is not None and done.usage.prompt_tokens > len("hi")  # the template's tokens counted
    job = tfleet.ctx.journal.get(done.model_extra["job_id"])
    assert job.params["chat"] is True and "hi" in job.params["prompt"] and job.params["max_new_tokens"] == 3


def test_the_fleet_page_shows_a_chats_last_user_message_as_its_prompt(tfleet: TextFleet, browser: object) -> None:
    """The job's prompt is the chat-templated text the model reads; the page shows the last user
    message (``params.user_message``, set by the chat route), as one would name the request."""
    from selenium.webdriver.common.by import By

    messages: Any = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "a first question"},
        {"role": "assistant", "content": "an answer"},
        {"role": "user", "content": "the question the page shows"},
    ]
    done = tfleet.client.chat.completions.create(
        model="tiny-qwen2", messages=messages, max_completion_tokens=2, extra_body={"target": MACHINE}
    )
    job = tfleet.ctx.journal.get(done.model_extra["job_id"])
    assert job.params["user_message"] == "the question the page shows"
    assert "a first question" in job.params["prompt"] and job.params["prompt"] != job.params["user_message"]
    driver = browser
    wait = open_page(driver, tfleet.local.api_url, "jobs")
    cell = f"#jobs tr[data-job='{job.id}'] td.prompt"
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, cell))  # type: ignore[union-attr]
    assert driver.find_element(By.CSS_SELECTOR, cell).text == "the question the page shows"  # type: ignore[attr-defined]
    # a chat without a user message shows its last message, never the template's tokens
    system_only = tfleet.client.chat.completions.create(
        model="tiny-qwen2",
        messages=[{"role": "system", "content": "only a system message"}],
        max_completion_tokens=1,
        extra_body={"target": MACHINE},
    )
    assert tfleet.ctx.journal.get(system_only.model_extra["job_id"]).params["user_message"] == "only a system message"


def test_the_fleet_page_saves_a_text_answer_as_the_servers_txt_file(tfleet: TextFleet, browser: object) -> None:
    """A text job's answer, opened in the Jobs view, is shown as its text and its Download link
    saves it under the server's name, ``<job id>.txt`` (Content-Disposition, docs/api.md); the page
    named it ``<job id>.plain`` from its media type's subtype. The answer stays shown as the page
    refreshes (the details' JSON was written over it)."""
    from selenium.webdriver.common.by import By

    done = tfleet.client.completions.create(
        model="tiny-gpt2", prompt="a text to save", max_tokens=3, seed=3, extra_body={"target": MACHINE}
    )
    job_id = done.model_extra["job_id"]
    answer = httpx.get(
        f"{tfleet.local.api_url}/v1/jobs/{job_id}/result",
        headers={"Authorization": f"Bearer {TEST_API_KEY}"},
        verify=tls_context(),
    )
    assert answer.headers["content-disposition"] == f'attachment; filename="{job_id}.txt"'
    driver = browser
    wait = open_page(driver, tfleet.local.api_url, "jobs")
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, f"#jobs tr[data-job='{job_id}']"))  # type: ignore[union-attr]
    driver.execute_script(f"document.querySelector(\"#jobs tr[data-job='{job_id}'] button\").click()")  # type: ignore[attr-defined]
    link = "#job-detail .download:not([aria-disabled])"
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, link))  # type: ignore[union-attr]
    assert driver.find_element(By.CSS_SELECTOR, link).get_attribute("download") == f"{job_id}.txt"  # type: ignore[attr-defined]
    answer_shown = "#job-detail .text-result"
    wait.until(lambda d: d.find_element(By.CSS_SELECTOR, answer_shown).text == done.choices[0].text.strip())  # type: ignore[union-attr]
    wait_refreshes(driver, wait, 2)  # the job's details, refreshed, were written over the answer's <pre>
    assert driver.find_element(By.CSS_SELECTOR, answer_shown).text == done.choices[0].text.strip()  # type: ignore[attr-defined]
    assert '"model_id": "tiny-gpt2"' in driver.find_element(By.CSS_SELECTOR, "#job-detail pre.details").text  # type: ignore[attr-defined]


def test_the_limits_are_400_context_length_exceeded_naming_the_limit_and_the_figures(tfleet: TextFleet) -> None:
    """R22: refused before any device; the fleet file's own limits for small-gpt2 (8 / 12); the
    OpenAI SDK's ``BadRequestError`` with OpenAI's code ``context_length_exceeded``, on which
    client libraries fall back to a larger context."""
    with pytest.raises(openai.BadRequestError) as long_prompt:
        tfleet.client.completions.create(model="small-gpt2", prompt="x" * 9, max_tokens=1)
    assert "at most 8 tokens (max_input_tokens), got 9" in long_prompt.value.message
    with pytest.raises(openai.BadRequestError) as too_many:
        tfleet.client.completions.create(model="small-gpt2", prompt="x" * 8, max_tokens=5)
    assert "at most 12 (max_total_tokens), got 8 + 5 = 13" in too_many.value.message
    body = too_many.value.body
    assert isinstance(body, dict) and body.get("code") == "context_length_exceeded"
    rejected = tfleet.ctx.journal.list(states=[JobState.rejected])
    assert {job.reason for job in rejected} >= {"context_length_exceeded"}  # R19
    with pytest.raises(openai.BadRequestError) as no_template:
        tfleet.client.chat.completions.create(model="tiny-gpt2", messages=[{"role": "user", "content": "hi"}])
    assert "no chat template" in no_template.value.message


@pytest.mark.parametrize("chat", [False, True])
def test_streaming_sends_the_text_as_it_is_generated_then_the_finish_and_usage(tfleet: TextFleet, chat: bool) -> None:
    """SSE through the SDK's ``stream=True``: several text chunks arrive while the job runs, in
    order; joined they are exactly the job's verified result; the last choice chunk carries the
    finish reason; the stream ends (``[DONE]``). The usage: on the finish chunk by default
    (completions here); with ``stream_options={"include_usage": True}`` (the chat here), as
    OpenAI sends it, in a last chunk of its own with no choices, no other chunk carrying one; and a
    chat's role only in its first delta."""
    if chat:
        stream = tfleet.client.chat.completions.create(
            model="tiny-qwen2",
            messages=[{"role": "user", "content": "go"}],
            max_completion_tokens=40,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"target": MACHINE},
        )
    else:
        stream = tfleet.client.completions.create(
            model="tiny-llama", prompt="go", max_tokens=40, temperature=0, stream=True, extra_body={"target": MACHINE}
        )
    chunks: list[Any] = list(stream)
    if chat:
        alone, chunks = chunks[-1], chunks[:-1]
        assert alone.choices == [] and all(c.usage is None for c in chunks)
        usage = alone.usage
        roles = [c.choices[0].delta.role for c in chunks]
        assert roles[0] == "assistant" and not any(roles[1:]), roles
    else:
        usage = chunks[-1].usage
    texts = [(c.choices[0].delta.content if chat else c.choices[0].text) or "" for c in chunks]
    last = chunks[-1]
    assert last.choices[0].finish_reason in ("stop", "length")
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    assert usage is not None and usage.completion_tokens >= 1
    job = tfleet.ctx.journal.get(last.model_extra["job_id"])
    assert job.state == "succeeded"
    assert "".join(texts) == Path(job.result_path).read_bytes().decode("utf-8")
    # the tiny models (seed 0, greedy) never end their turn within 40 tokens: 40 reports, streamed in pieces
    assert usage.completion_tokens == 40 and last.choices[0].finish_reason == "length"
    assert sum(1 for text in texts[:-1] if text) >= 2


@pytest.mark.parametrize("client", ["completions", "chat", "tgi"])
def test_a_stream_closed_by_its_client_cancels_its_job_and_the_machine_takes_the_next(
    tfleet: TextFleet, client: str
) -> None:
    """The SDK's ``stream.close()`` after a few chunks: the job ends ``cancelled`` between steps,
    far short of its ``max_tokens``, as vLLM and TGI abort a generation whose client left (it ran
    all its tokens, and the next request waited behind it); the next request runs at once."""
    asked = {"max_tokens": 400, "temperature": 0, "stream": True, "extra_body": {"target": MACHINE}}
    if client == "chat":
        stream: Any = tfleet.client.chat.completions.create(
            model="tiny-qwen2", messages=[{"role": "user", "content": "go"}], **asked
        )
    elif client == "completions":
        stream = tfleet.client.completions.create(model="tiny-qwen2", prompt="go", **asked)
    else:  # TGI's /generate_stream through huggingface_hub, on the model's own URL
        hub_client = huggingface_hub.InferenceClient(
            base_url=f"{tfleet.local.api_url}/hf/models/tiny-qwen2", token=TEST_API_KEY, timeout=60
        )
        stream = hub_client.text_generation("go", max_new_tokens=400, stream=True, details=True)
    job_id = ""
    for index, chunk in enumerate(stream):
        job_id = chunk.model_extra["job_id"] if client != "tgi" else latest_job(tfleet).id
        if index == 2:
            break
    stream.close()
    job = wait_for(
        lambda: (found := tfleet.ctx.journal.get(job_id)).state in ENDED and found,
        timeout_s=60,
        what=f"job {job_id} to end after its stream closed",
    )
    assert (job.state, job.reason) == (JobState.cancelled, "cancelled"), (job.state, job.reason, job.message)
    assert "cancelled by request while running, after " in (job.message or "")
    steps = int((job.message or "").split("after ")[1].split(" of ")[0])
    assert steps < 400, job.message
    after = tfleet.client.completions.create(
        model="tiny-qwen2", prompt="x", max_tokens=3, extra_body={"target": MACHINE}
    )
    assert after.usage is not None and after.usage.completion_tokens >= 1


@pytest.mark.parametrize("stream", [False, True])
def test_openai_logprobs_are_each_generated_tokens_from_the_job(tfleet: TextFleet, stream: bool) -> None:
    """``logprobs=True`` (chat) and ``logprobs=0`` (completions): each generated token's natural-log
    probability as the worker computed it (``provenance.logprobs``), its text its share of the
    answer (the shares join into it); streamed, the chunks' entries join into the same list.
    Alternatives (``top_logprobs`` > 0, ``logprobs`` > 0) are refused naming the field."""
    asked: dict[str, Any] = {"max_tokens": 6, "temperature": 0, "extra_body": {"target": MACHINE}}
    messages: Any = [{"role": "user", "content": "go"}]
    if stream:
        chunks = list(
            tfleet.client.chat.completions.create(
                model="tiny-qwen2", messages=messages, logprobs=True, stream=True, **asked
            )
        )
        entries = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
        job = tfleet.ctx.journal.get(chunks[0].model_extra["job_id"])
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    else:
        done = tfleet.client.chat.completions.create(model="tiny-qwen2", messages=messages, logprobs=True, **asked)
        assert done.choices[0].logprobs is not None and done.choices[0].logprobs.content is not None
        entries = done.choices[0].logprobs.content
        job = tfleet.ctx.journal.get(done.model_extra["job_id"])
        text = done.choices[0].message.content or ""
    assert [e.logprob for e in entries] == job.provenance["logprobs"] and len(entries) == 6
    assert "".join(e.token for e in entries) == text and all(e.logprob <= 0 for e in entries)
    assert all(e.bytes == list(e.token.encode()) for e in entries)
    plain = tfleet.client.completions.create(model="tiny-llama", prompt="go", logprobs=0, **asked)
    legacy = plain.choices[0].logprobs
    assert legacy is not None and legacy.tokens is not None and legacy.token_logprobs is not None
    plain_job = tfleet.ctx.journal.get(plain.model_extra["job_id"])
    assert legacy.token_logprobs == plain_job.provenance["logprobs"] and "".join(legacy.tokens) == plain.choices[0].text
    assert legacy.text_offset == [sum(len(t) for t in legacy.tokens[:i]) for i in range(len(legacy.tokens))]
    without = tfleet.client.completions.create(model="tiny-llama", prompt="go", **asked)
    assert without.choices[0].logprobs is None
    # a stop sequence's tokens add no text (the texts join into the cut answer), streamed too
    steered = {"target": MACHINE, "response_format": {"type": "regex", "value": "abbbcdd"}}
    cut = tfleet.client.completions.create(
        model="tiny-qwen2", prompt="x", logprobs=0, max_tokens=20, temperature=0, stop=["c"], extra_body=steered
    )
    assert cut.choices[0].text == "abbb" and cut.choices[0].logprobs is not None
    assert "".join(cut.choices[0].logprobs.tokens or []) == "abbb"
    streamed = list(
        tfleet.client.chat.completions.create(
            model="tiny-qwen2",
            messages=messages,
            logprobs=True,
            max_tokens=20,
            temperature=0,
            stop=["c"],
            stream=True,
            extra_body=steered,
        )
    )
    streamed_text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    shares = [e.token for c in streamed if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert streamed_text == "abbb" and "".join(shares) == "abbb", (streamed_text, shares)
    # an answer cut inside a character ends with U+FFFD, its last token's share too
    emoji = tfleet.client.chat.completions.create(
        model="tiny-qwen2",
        messages=messages,
        logprobs=True,
        max_tokens=6,
        temperature=0,
        extra_body={"target": MACHINE, "response_format": {"type": "regex", "value": "\U0001f600{10}"}},
    )
    content = emoji.choices[0].message.content or ""
    assert content.endswith("\ufffd") and emoji.choices[0].logprobs is not None
    assert "".join(e.token for e in emoji.choices[0].logprobs.content or []) == content
    with pytest.raises(openai.BadRequestError) as alternatives:
        tfleet.client.chat.completions.create(
            model="tiny-qwen2", messages=messages, logprobs=True, top_logprobs=2, **asked
        )
    assert alternatives.value.body["param"] == "top_logprobs"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as legacy_alternatives:
        tfleet.client.completions.create(model="tiny-llama", prompt="go", logprobs=2, **asked)
    assert legacy_alternatives.value.body["param"] == "logprobs"  # type: ignore[index]


def test_an_answers_message_sent_back_as_history_is_taken_from_either_client(tfleet: TextFleet) -> None:
    """A conversation: the previous answer's message object goes back in ``messages`` as each
    client returns it (huggingface_hub's ``ChatCompletionOutputMessage`` carries ``reasoning``
    and ``tool_call_id`` null; the openai SDK's ``model_dump()`` ``refusal``, ``annotations``,
    ``audio``, ``function_call``, ``tool_calls`` null): the next turn runs, with the answer in its prompt."""
    hub_client = huggingface_hub.InferenceClient(
        base_url=f"{tfleet.local.api_url}/hf/models/tiny-qwen2", token=TEST_API_KEY, timeout=60
    )
    first = hub_client.chat_completion([{"role": "user", "content": "hi"}], max_tokens=3, temperature=0)
    answer = first.choices[0].message
    again = hub_client.chat_completion(
        [{"role": "user", "content": "hi"}, answer, {"role": "user", "content": "more"}], max_tokens=3, temperature=0
    )
    assert again.choices[0].message.content is not None
    assert (answer.content or "") in latest_job(tfleet).params["prompt"]
    sdk_first = tfleet.client.chat.completions.create(
        model="tiny-qwen2",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=3,
        temperature=0,
        extra_body={"target": MACHINE},
    )
    history: Any = [{"role": "user", "content": "hi"}, sdk_first.choices[0].message.model_dump()]
    sdk_again = tfleet.client.chat.completions.create(
        model="tiny-qwen2",
        messages=[*history, {"role": "user", "content": "more"}],
        max_tokens=3,
        temperature=0,
        extra_body={"target": MACHINE},
    )
    assert sdk_again.choices[0].finish_reason in ("stop", "length")


def test_a_streaming_request_over_the_limits_is_a_plain_422(tfleet: TextFleet) -> None:
    with pytest.raises(openai.BadRequestError, match="max_total_tokens"):
        tfleet.client.completions.create(model="small-gpt2", prompt="x", max_tokens=20, stream=True)


# --- TGI's API (huggingface_hub's InferenceClient) and constrained output --------------------------------------------


def hub(tfleet: TextFleet) -> huggingface_hub.InferenceClient:
    """The official TGI client, pointed at the server's root (text_generation posts to ``/``,
    chat_completion to ``/v1/chat/completions``), the API key as its token. TGI serves one
    model: requests without ``model`` get the first registered text model, ``small-gpt2``
    (max_total_tokens 12); a chat without one the first with a chat template, ``tiny-llama``."""
    return huggingface_hub.InferenceClient(base_url=tfleet.local.api_url, token=TEST_API_KEY, timeout=60)


def latest_job(tfleet: TextFleet) -> Any:
    return tfleet.ctx.journal.list()[-1]


def test_tgi_text_generation_runs_a_text_job_with_tgis_details(tfleet: TextFleet) -> None:
    """``text_generation(details=True)``: the job's verified text, TGI's details (finish reason,
    token count, the tokens with the ids the worker generated, their texts joining into the
    text, a natural-log logprob each), a null seed for greedy decoding; plain ``text_generation``
    gives the same string."""
    client = hub(tfleet)
    out = client.text_generation("hello", max_new_tokens=6, details=True)
    job = latest_job(tfleet)
    assert job.state == "succeeded" and job.kind == "text" and job.params["temperature"] == 0.0
    assert out.generated_text == Path(job.result_path).read_bytes().decode("utf-8")
    details = out.details
    assert details is not None and details.finish_reason == "length" and details.generated_tokens == 6
    assert [t.id for t in details.tokens] == job.provenance["tokens"] and len(details.tokens) == 6
    assert "".join(t.text for t in details.tokens) == out.generated_text
    assert all(t.logprob <= 0.0 for t in details.tokens) and details.seed is None
    assert client.text_generation("hello", max_new_tokens=6) == out.generated_text  # greedy: the same
    sampled = client.text_generation("hello", max_new_tokens=4, do_sample=True, seed=11, details=True)
    assert (
        sampled.details is not None and sampled.details.seed == 11 and latest_job(tfleet).params["temperature"] == 1.0
    )


def test_tgi_streaming_sends_one_event_per_token_then_the_text_and_details(tfleet: TextFleet) -> None:
    """``text_generation(stream=True, details=True)`` against ``POST /`` (``stream: true``): one
    event per generated token, in order, indexed 1..n, their ids the worker's; the last carries
    ``generated_text`` (the verified result) and the details; token texts join into it. Plain
    ``stream=True`` yields the token texts."""
    client = hub(tfleet)
    events = list(client.text_generation("go", max_new_tokens=10, stream=True, details=True))
    job = latest_job(tfleet)
    result = Path(job.result_path).read_bytes().decode("utf-8")
    assert [e.index for e in events] == list(range(1, 11))
    assert [e.token.id for e in events] == job.provenance["tokens"]
    assert all(e.generated_text is None and e.details is None for e in events[:-1])
    last = events[-1]
    assert last.generated_text == result == "".join(e.token.text for e in events)
    assert last.details is not None and last.details.finish_reason == "length" and last.details.generated_tokens == 10
    assert last.details.input_length == job.provenance["usage"]["prompt_tokens"]
    texts = list(client.text_generation("go", max_new_tokens=10, stream=True))
    assert "".join(texts) == result and len(texts) == 10


def test_hub_text_generation_on_a_models_own_url_runs_that_model(tfleet: TextFleet) -> None:
    """``InferenceClient(base_url=".../hf/models/<model>").text_generation``, as Hugging Face's own
    Inference API serves a model on its URL: the path's text model runs (not the first one, which
    ``POST /`` would take), with TGI's details and stream; a parameter Homefleet does not run is
    the client's ``ValidationError`` naming it, and a body ``model`` naming another is refused
    (R22); its ``chat_completion`` (``<base_url>/v1/chat/completions``, as Hugging Face's router
    serves a model's chat) runs the path's model too. Before, the path ran text-to-image only
    and refused ``max_new_tokens`` as unknown."""
    url = f"{tfleet.local.api_url}/hf/models/tiny-qwen2"
    client = huggingface_hub.InferenceClient(base_url=url, token=TEST_API_KEY, timeout=60)
    out = client.text_generation("hello", max_new_tokens=5, details=True)
    job = latest_job(tfleet)
    assert job.model_id == "tiny-qwen2" and job.kind == "text" and job.state == "succeeded"
    assert out.generated_text == Path(job.result_path).read_bytes().decode("utf-8")
    assert out.details is not None and out.details.generated_tokens == 5
    assert [t.id for t in out.details.tokens] == job.provenance["tokens"]
    events = list(client.text_generation("hello", max_new_tokens=5, stream=True, details=True))
    streamed = latest_job(tfleet)
    assert streamed.model_id == "tiny-qwen2" and streamed.id != job.id
    assert events[-1].generated_text == out.generated_text  # greedy: the same text, streamed
    assert [e.token.id for e in events] == streamed.provenance["tokens"]
    with pytest.raises(huggingface_hub.errors.ValidationError, match=r"parameters\.top_k"):
        client.text_generation("hello", max_new_tokens=2, top_k=5)
    auth = {"Authorization": f"Bearer {TEST_API_KEY}"}
    other = httpx.post(url, headers=auth, json={"inputs": "x", "model": "tiny-gpt2"}, verify=tls_context())
    assert other.status_code == 422 and other.json()["error_type"] == "validation"
    assert other.json()["reason"] == "invalid_model" and "'tiny-gpt2'" in other.json()["error"]
    empty = httpx.post(url, headers=auth, json={"inputs": "x", "parameters": {"stream": 1}}, verify=tls_context())
    assert empty.status_code == 422 and "parameters.stream" in empty.json()["error"]
    assert latest_job(tfleet).id == streamed.id  # no refusal ran a job
    # the same client's chat_completion posts to <base_url>/v1/chat/completions, model "dummy":
    # the path's model (the first with a chat template, tiny-llama, would be taken otherwise)
    chat = client.chat_completion([{"role": "user", "content": "hi"}], max_tokens=4, temperature=0)
    chatted = latest_job(tfleet)
    assert (chatted.model_id, chatted.params["chat"], chatted.state) == ("tiny-qwen2", True, JobState.succeeded)
    assert chat.choices[0].message.content == Path(chatted.result_path).read_bytes().decode("utf-8")
    chunks = list(client.chat_completion([{"role": "user", "content": "hi"}], max_tokens=4, temperature=0, stream=True))
    assert latest_job(tfleet).model_id == "tiny-qwen2"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == chat.choices[0].message.content
    with pytest.raises(huggingface_hub.errors.HfHubHTTPError) as refused:
        client.chat_completion([{"role": "user", "content": "hi"}], model="tiny-llama", max_tokens=4)
    assert refused.value.response.status_code == 400
    assert refused.value.response.json()["error"]["code"] == "invalid_model"
    # a seed the body's schema refuses is TGI's ValidationError too, as on POST / (a user pass: OpenAI's shape)
    with pytest.raises(huggingface_hub.errors.ValidationError, match=r"parameters\.seed"):
        client.text_generation("hi", max_new_tokens=2, seed=-5)
    # text_to_image on a text model's URL: a 422 naming the kind, no text job answered as an image
    jobs = len(tfleet.ctx.journal.list())
    with pytest.raises(huggingface_hub.errors.HfHubHTTPError) as refused:
        client.text_to_image("a fox")
    assert refused.value.response.status_code == 422 and refused.value.response.json()["reason"] == "unsupported_kind"
    assert "runs text" in refused.value.response.json()["error"] and len(tfleet.ctx.journal.list()) == jobs
    # text_generation with a text parameter on an image model's URL: a 422 naming the kind, not an
    # unknown parameter, and no image job (with no parameter its payload is text_to_image's exactly:
    # {"inputs", "parameters": {}} with Accept */*, which runs txt2img as on Hugging Face)
    drawn = huggingface_hub.InferenceClient(
        base_url=f"{tfleet.local.api_url}/hf/models/tiny-sd", token=TEST_API_KEY, timeout=60
    )
    with pytest.raises(huggingface_hub.errors.HfHubHTTPError) as refused:
        drawn.text_generation("a fox", max_new_tokens=3)
    assert refused.value.response.status_code == 400, refused.value.response.text
    error = refused.value.response.json()["error"]
    assert error["code"] == "unsupported_kind" and "runs txt2img" in error["message"], error
    assert "not text_generation" in error["message"] and len(tfleet.ctx.journal.list()) == jobs
    # an unknown model on that URL is 404 naming those in service, not a refusal of a TGI parameter
    typo = huggingface_hub.InferenceClient(base_url=url + "x", token=TEST_API_KEY, timeout=60)
    with pytest.raises(huggingface_hub.errors.HfHubHTTPError) as unknown:
        typo.text_generation("hi", max_new_tokens=3)
    assert unknown.value.response.status_code == 404
    assert unknown.value.response.json()["error"]["code"] == "unknown_model"
    assert "'tiny-qwen2x' is not registered; in service:" in unknown.value.response.json()["error"]["message"]


def test_tgi_generate_routes_and_their_errors_have_tgis_shape(tfleet: TextFleet) -> None:
    """``POST /generate`` and ``/generate_stream`` directly (with Homefleet's ``model`` and
    ``target``); the token limits and an unsupported parameter are 422 ``validation``
    (huggingface_hub's ValidationError), journaled ``rejected`` (R19); no key: 401."""
    url, auth = tfleet.local.api_url, {"Authorization": f"Bearer {TEST_API_KEY}"}
    done = httpx.post(
        f"{url}/generate",
        headers=auth,
        timeout=60,
        json={"inputs": "hi", "model": "tiny-qwen2", "target": MACHINE, "parameters": {"max_new_tokens": 3}},
        verify=tls_context(),
    )
    assert done.status_code == 200, done.text
    job = tfleet.ctx.journal.get(done.json()["job_id"])
    assert job.model_id == "tiny-qwen2" and job.machine == MACHINE and "details" not in done.json()
    assert done.json()["generated_text"] == Path(job.result_path).read_bytes().decode("utf-8")
    with httpx.stream(
        "POST",
        f"{url}/generate_stream",
        headers=auth,
        timeout=60,
        json={"inputs": "hi", "model": "tiny-gpt2", "parameters": {"max_new_tokens": 3}},
        verify=tls_context(),
    ) as stream:
        assert stream.status_code == 200 and stream.headers["content-type"].startswith("text/event-stream")
        lines = [json.loads(line[5:]) for line in stream.iter_lines() if line.startswith("data:")]
    assert len(lines) == 3 and lines[-1]["details"]["generated_tokens"] == 3
    too_long = httpx.post(
        f"{url}/generate",
        headers=auth,
        timeout=60,
        json={"inputs": "x" * 8, "model": "small-gpt2", "parameters": {"max_new_tokens": 5}},
        verify=tls_context(),
    )
    assert too_long.status_code == 422
    assert too_long.json() == {
        "error": "prompt tokens + max_new_tokens must be at most 12 (max_total_tokens), got "
        "8 + 5 = 13; lower max_new_tokens to at most 4",
        "error_type": "validation",
        "reason": "context_length_exceeded",
    }
    with pytest.raises(huggingface_hub.errors.ValidationError, match=r"at most 8 tokens \(max_input_tokens\), got 9"):
        hub(tfleet).text_generation("x" * 9, max_new_tokens=1)  # the default model: small-gpt2 (the first id)
    unsupported = httpx.post(
        f"{url}/generate", headers=auth, json={"inputs": "x", "parameters": {"top_k": 5}}, verify=tls_context()
    )
    assert unsupported.status_code == 422 and unsupported.json()["error_type"] == "validation"
    assert "parameters.top_k" in unsupported.json()["error"]
    bad = httpx.post(f"{url}/generate", headers=auth, json={"inputs": "", "parameters": {}}, verify=tls_context())
    assert bad.status_code == 422 and bad.json()["error_type"] == "validation" and "inputs" in bad.json()["error"]
    anonymous = httpx.post(f"{url}/generate", json={"inputs": "x"}, verify=tls_context())
    assert anonymous.status_code == 401 and anonymous.json()["reason"] == "missing_api_key", anonymous.text
    assert httpx.get(f"{url}/", verify=tls_context()).status_code == 200  # the fleet page stays open


def test_a_wrong_key_or_an_unknown_model_on_tgis_routes_is_the_hubs_http_error(tfleet: TextFleet) -> None:
    """huggingface_hub raises a non-HTTP ``UnknownError`` (its status lost) for any TGI
    ``error_type`` it does not know; TGI's routes therefore answer 401, 403 and 404 without one:
    ``text_generation`` with a key not of this server's raises ``HfHubHTTPError`` with status 401,
    streamed or not, on the root and on a text model's own URL; an unknown ``model`` on
    ``/generate`` is a 404 without one either (docs/api.md, "OpenAI and Hugging Face routes")."""
    url = tfleet.local.api_url
    for base in (url, f"{url}/hf/models/tiny-qwen2"):
        for stream in (False, True):
            client = huggingface_hub.InferenceClient(base_url=base, token="bad", timeout=60)
            with pytest.raises(huggingface_hub.errors.HfHubHTTPError) as refused:
                list(client.text_generation("x", stream=True)) if stream else client.text_generation("x")
            assert refused.value.response is not None and refused.value.response.status_code == 401, (base, stream)
            assert "error_type" not in refused.value.response.json(), refused.value.response.text
    unknown = httpx.post(
        f"{url}/generate",
        headers={"Authorization": f"Bearer {TEST_API_KEY}"},
        json={"inputs": "x", "model": "no-such-model"},
        timeout=60,
        verify=tls_context(),
    )
    assert unknown.status_code == 404 and unknown.json()["reason"] == "unknown_model", unknown.text
    assert "error_type" not in unknown.json()  # without one, huggingface_hub raises its HTTP error as it is


def test_a_temperature_of_5e_324_decodes_greedily_through_generate(tfleet: TextFleet) -> None:
    """``temperature`` 5e-324 is above 0 (TGI takes it) but divides the logits to inf: the job
    failed and the route answered 500. Below GREEDY_TEMPERATURE it is greedy decoding (journaled
    0.0, no seed answered): 200 with the text of temperature 0 (R22)."""
    url, auth = tfleet.local.api_url, {"Authorization": f"Bearer {TEST_API_KEY}"}
    answers = [
        httpx.post(
            f"{url}/generate",
            headers=auth,
            timeout=60,
            json={
                "inputs": "hello",
                "model": "tiny-llama",
                "target": MACHINE,
                "parameters": {"max_new_tokens": 5, "details": True, **parameters},
            },
            verify=tls_context(),
        )
        for parameters in ({"temperature": 5e-324, "seed": 4}, {})
    ]
    assert [answer.status_code for answer in answers] == [200, 200], [answer.text for answer in answers]
    tiny, greedy_answer = (answer.json() for answer in answers)
    job = tfleet.ctx.journal.get(tiny["job_id"])
    assert job.state == "succeeded" and job.params["temperature"] == 0.0 and tiny["details"]["seed"] is None
    assert tiny["generated_text"] == greedy_answer["generated_text"] == Path(job.result_path).read_text("utf-8")


@pytest.mark.parametrize("stream", [False, True])
def test_hub_chat_completion_against_the_openai_chat_route(tfleet: TextFleet, stream: bool) -> None:
    """``InferenceClient.chat_completion`` (streaming and not) posts to ``/v1/chat/completions``:
    the model's chat template, the job's verified text, the finish reason."""
    client = hub(tfleet)
    messages = [{"role": "user", "content": "hi"}]
    if stream:
        chunks = list(
            client.chat_completion(
                messages, model="tiny-qwen2", max_tokens=12, stream=True, extra_body={"target": MACHINE}
            )
        )
        text = "".join(c.choices[0].delta.content or "" for c in chunks)
        finish = chunks[-1].choices[0].finish_reason
    else:
        done = client.chat_completion(messages, model="tiny-qwen2", max_tokens=12, extra_body={"target": "auto"})
        text, finish = done.choices[0].message.content, done.choices[0].finish_reason
        assert done.usage.completion_tokens == 12
    job = latest_job(tfleet)
    assert (
        job.model_id == "tiny-qwen2" and job.params["chat"] is True and "<|im_start|>user\nhi" in job.params["prompt"]
    )
    assert text == Path(job.result_path).read_bytes().decode("utf-8") and finish == "length"


def test_hub_chat_completion_with_the_hf_base_url_and_a_model(tfleet: TextFleet) -> None:
    """``InferenceClient(base_url=".../hf").chat_completion(messages, model=...)`` posts to
    ``/hf/v1/chat/completions`` (a bare 404 before): that model's chat, Auto by default as on
    the other Hugging Face routes."""
    client = huggingface_hub.InferenceClient(base_url=f"{tfleet.local.api_url}/hf", token=TEST_API_KEY, timeout=60)
    done = client.chat_completion([{"role": "user", "content": "hi there"}], model="tiny-qwen2", max_tokens=3)
    job = latest_job(tfleet)
    assert (job.model_id, job.target, job.params["user_message"]) == ("tiny-qwen2", "auto", "hi there")
    assert done.choices[0].message.content == Path(job.result_path).read_text("utf-8")


def test_hub_chat_completion_without_a_model_gets_the_first_text_model_with_a_chat_template(
    tfleet: TextFleet,
) -> None:
    """Given no model, ``InferenceClient.chat_completion`` sends ``"model": "dummy"`` (TGI ignores
    it): the chat goes to the first text model whose tokenizer has a chat template, ``tiny-llama``
    (``small-gpt2`` and ``tiny-gpt2``, first by id, have none and would refuse every chat), not to
    an unregistered ``dummy``."""
    done = hub(tfleet).chat_completion(
        [{"role": "user", "content": "hi"}], max_tokens=4, extra_body={"target": MACHINE}
    )
    job = latest_job(tfleet)
    assert (job.model_id, job.params["chat"], job.state) == ("tiny-llama", True, JobState.succeeded)
    assert done.choices[0].message.content == Path(job.result_path).read_bytes().decode("utf-8")


def test_hub_chat_completion_with_a_misspelt_extra_is_refused_naming_it(tfleet: TextFleet) -> None:
    """``extra_body={"max_tokenz": 3}`` is refused before any job (422 ``unknown_param``), not run
    with the default 16 tokens."""
    jobs = len(tfleet.ctx.journal.list())
    with pytest.raises(huggingface_hub.errors.HfHubHTTPError) as refused:
        hub(tfleet).chat_completion(
            [{"role": "user", "content": "hi"}], model="tiny-llama", extra_body={"max_tokenz": 3}
        )
    assert refused.value.response.status_code in (400, 422), refused.value.response.text
    error = refused.value.response.json()["error"]
    assert (error["code"], error["param"]) == ("unknown_param", "max_tokenz") and "`max_tokenz`" in error["message"]
    assert len(tfleet.ctx.journal.list()) == jobs


SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name", "age", "ok", "tag", "scores"],
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "ok": {"type": "boolean"},
        "tag": {"enum": ["red", "green", "blue"]},
        "scores": {
            "type": "array",
            "items": {"type": "integer", "minimum": 0, "maximum": 9},
            "minItems": 1,
            "maxItems": 3,
        },
    },
}
REGEX = r"[a-z]{2,6}@[a-z]{2,5}\.(com|org)"


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-qwen2", "tiny-gpt2"])
def test_constrained_output_of_random_weights_validates_through_the_api_and_workers(
    tfleet: TextFleet, model: str
) -> None:
    """The key property: the constraint is enforced while decoding, so even a random-weight
    model's output parses and validates against the JSON schema (OpenAI ``response_format``
    ``json_schema``, sampled) and fullmatches the regex (TGI ``grammar``, through
    ``/generate_stream``); both end with EOS (``stop`` / ``eos_token``), not at the token limit."""
    done = tfleet.client.completions.create(
        model=model,
        prompt="person:",
        max_tokens=160,
        temperature=1.0,
        seed=3,
        extra_body={
            "target": MACHINE,
            "response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}},
        },
    )
    jsonschema.validate(json.loads(done.choices[0].text), SCHEMA)
    assert done.choices[0].finish_reason == "stop"
    job = tfleet.ctx.journal.get(done.model_extra["job_id"])
    assert job.params["grammar"] == {"type": "json", "value": SCHEMA}
    url, auth = tfleet.local.api_url, {"Authorization": f"Bearer {TEST_API_KEY}"}
    with httpx.stream(
        "POST",
        f"{url}/generate_stream",
        headers=auth,
        timeout=60,
        json={
            "inputs": "mail:",
            "model": model,
            "parameters": {
                "max_new_tokens": 40,
                "do_sample": True,
                "seed": 9,
                "grammar": {"type": "regex", "value": REGEX},
            },
        },
        verify=tls_context(),
    ) as stream:
        events = [json.loads(line[5:]) for line in stream.iter_lines() if line.startswith("data:")]
    assert re.fullmatch(REGEX, events[-1]["generated_text"]), events[-1]
    assert events[-1]["details"]["finish_reason"] == "eos_token" and events[-1]["token"]["special"] is True


def test_hub_text_generation_grammar_and_chat_json_object(tfleet: TextFleet) -> None:
    """TGI's ``grammar`` through ``InferenceClient.text_generation`` (greedy) and OpenAI's
    ``response_format: json_object`` on a chat: valid JSON."""
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 5}},
        "required": ["n"],
        "additionalProperties": False,
    }
    text = hub(tfleet).text_generation("n=", max_new_tokens=10, grammar={"type": "json", "value": schema})
    jsonschema.validate(json.loads(text), schema)  # small-gpt2: 2 + 10 tokens, {"n":3} fits
    chat = tfleet.client.chat.completions.create(
        model="tiny-llama",
        messages=[{"role": "user", "content": "json"}],
        max_completion_tokens=200,
        response_format={"type": "json_object"},
        temperature=1.0,
        seed=2,
        extra_body={"target": MACHINE},
    )
    content = chat.choices[0].message.content or ""
    if chat.choices[0].finish_reason == "stop":  # any JSON object may be longer than any limit: valid when complete
        assert isinstance(json.loads(content), dict)
    assert content.startswith("{")


def test_a_constraint_that_does_not_compile_is_a_422_before_any_device(tfleet: TextFleet) -> None:
    """R22: compiled on the server with the model's tokenizer; refused naming the field and
    llguidance's message, journaled ``rejected`` ``invalid_grammar``; a malformed
    ``response_format`` is refused too."""
    with pytest.raises(openai.BadRequestError) as bad_regex:
        tfleet.client.completions.create(
            model="tiny-gpt2",
            prompt="x",
            max_tokens=4,
            extra_body={
                "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}
            },
        )
    assert "response_format does not compile" in bad_regex.value.message  # the client's field (R22)
    assert isinstance(bad_regex.value.body, dict) and bad_regex.value.body.get("code") == "invalid_grammar"
    url, auth = tfleet.local.api_url, {"Authorization": f"Bearer {TEST_API_KEY}"}
    refused = httpx.post(
        f"{url}/generate",
        headers=auth,
        json={"inputs": "x", "model": "tiny-gpt2", "parameters": {"grammar": {"type": "regex", "value": "(unclosed"}}},
        verify=tls_context(),
    )
    assert refused.status_code == 422 and refused.json()["error_type"] == "validation"
    assert refused.json()["reason"] == "invalid_grammar" and "does not compile" in refused.json()["error"]
    assert latest_job(tfleet).state == JobState.rejected and latest_job(tfleet).reason == "invalid_grammar"
    with pytest.raises(openai.BadRequestError, match="response_format"):
        tfleet.client.completions.create(model="tiny-gpt2", prompt="x", extra_body={"response_format": {"type": "xml"}})


def test_prompt_expansion_runs_a_journaled_text_job_before_the_image_job(tfleet: TextFleet) -> None:
    """``expand_prompt`` on a txt2img submission: the text model writes the prompt first, as its
    own journaled job (chat-templated for a model with a template); the image job runs with the
    user's prompt, a comma and the expansion, its params naming the text job (``expanded_by``,
    embedded in its provenance) and the text job's events naming the image job. A bad
    expansion model is refused before any job; an image route that cannot expand refuses
    instead of ignoring it; an Idempotency-Key retry gets the first image job, no second text job."""
    url, auth = tfleet.local.api_url, {"Authorization": f"Bearer {TEST_API_KEY}"}
    body = {
        "model": "tiny-sd",
        "kind": "txt2img",
        "target": MACHINE,
        "params": {"prompt": "a fox", "steps": 1, "expand_prompt": "tiny-qwen2"},
    }
    accepted = httpx.post(
        f"{url}/v1/jobs", headers={**auth, "Idempotency-Key": "expand-1"}, json=body, timeout=120, verify=tls_context()
    )
    assert accepted.status_code == 202, accepted.text
    image_id = accepted.json()["id"]
    deadline = time.monotonic() + 120
    while (image := tfleet.ctx.journal.get(image_id)).state not in ("succeeded", "failed", "rejected"):
        assert time.monotonic() < deadline, image.state
        time.sleep(0.2)
    assert image.state == "succeeded", (image.reason, image.message)
    text_job = tfleet.ctx.journal.get(image.params["expanded_by"])
    expansion = Path(text_job.result_path).read_bytes().decode("utf-8")
    assert text_job.state == "succeeded" and text_job.kind == "text" and text_job.model_id == "tiny-qwen2"
    assert text_job.params["chat"] is True and "a fox" in text_job.params["prompt"]
    assert image.params["prompt"].startswith("a fox") and image.params["expand_prompt"] == "tiny-qwen2"
    if " ".join(expansion.split()):
        assert image.params["prompt"].startswith("a fox, ")
        assert image.params["prompt"][len("a fox, ") :] in " ".join(expansion.split())
    assert text_job.created_at < image.created_at
    assert image.provenance is not None and image.provenance["params"]["expanded_by"] == text_job.id
    assert [e.detail for e in tfleet.ctx.journal.events(text_job.id) if e.event == "expanded_for"] == [image_id]
    texts_before = sum(1 for job in tfleet.ctx.journal.list() if job.kind == "text")
    again = httpx.post(
        f"{url}/v1/jobs", headers={**auth, "Idempotency-Key": "expand-1"}, json=body, timeout=120, verify=tls_context()
    )
    assert again.status_code == 202 and again.json()["id"] == image_id
    assert again.headers.get("Idempotency-Replayed") == "true"
    assert sum(1 for job in tfleet.ctx.journal.list() if job.kind == "text") == texts_before
    jobs_before = len(tfleet.ctx.journal.list())
    for bad in ("tiny-sd", "nope"):
        refused = httpx.post(
            f"{url}/v1/jobs",
            headers=auth,
            json={**body, "params": {**body["params"], "expand_prompt": bad}},
            verify=tls_context(),
        )
        assert refused.status_code == 422 and refused.json()["error"]["reason"] == "invalid_expand_prompt"
    spoofed = httpx.post(
        f"{url}/v1/jobs",
        headers=auth,
        json={**body, "params": {**body["params"], "expanded_by": text_job.id}},
        verify=tls_context(),
    )
    assert spoofed.status_code == 422 and "set by the server" in spoofed.json()["error"]["message"]
    assert len(tfleet.ctx.journal.list()) == jobs_before  # refused before any job: nothing journaled
    with pytest.raises(openai.BadRequestError, match="expand_prompt"):
        tfleet.client.images.generate(
            model="tiny-sd",
            prompt="a fox",
            size="64x64",
            extra_body={"steps": 1, "target": MACHINE, "expand_prompt": "tiny-qwen2"},
        )


def test_a_dry_run_prices_a_text_job_by_its_tokens_with_learned_per_token_timings(tfleet: TextFleet) -> None:
    """R13: a finished text job teaches (machine, model) seconds per new token and per
    prompt token from its usage; a dry run then prices max_new_tokens linearly on top of the
    prompt's tokens."""
    url, auth = tfleet.local.api_url, {"Authorization": f"Bearer {TEST_API_KEY}"}
    done = tfleet.client.completions.create(
        model="tiny-gpt2", prompt="a b c d e", max_tokens=6, extra_body={"target": MACHINE}
    )
    assert done.usage is not None and done.usage.completion_tokens >= 1
    learned = tfleet.ctx.dispatcher.timings.load().get(MACHINE, "tiny-gpt2", "text")
    assert learned is not None and learned.samples >= 1 and learned.step_s > 0 and learned.prompt_s > 0

    def run_s(prompt: str, new_tokens: int) -> float:
        body = {
            "model": "tiny-gpt2",
            "kind": "text",
            "target": MACHINE,
            "params": {"prompt": prompt, "max_new_tokens": new_tokens},
        }
        answer = httpx.post(f"{url}/v1/jobs?dry_run=true", headers=auth, json=body, timeout=30, verify=tls_context())
        assert answer.status_code == 200, answer.text
        return float(answer.json()["machines"][MACHINE]["run_s"])

    # token counts far apart, so that the figures' rounding to the millisecond does not matter
    ten, hundred_ten, two_hundred_ten = (run_s("a b c d e", n) for n in (10, 110, 210))
    assert 0 < ten < hundred_ten < two_hundred_ten
    assert two_hundred_ten - hundred_ten == pytest.approx(hundred_ten - ten, abs=2.5e-3)  # linear in new tokens
    # the current learned figures (other tests' jobs may have folded in more than ours)
    learned = tfleet.ctx.dispatcher.timings.load().get(MACHINE, "tiny-gpt2", "text")
    assert learned is not None and learned.prompt_s > 0
    assert hundred_ten - ten == pytest.approx(100 * learned.step_s, abs=1.5e-3)
    # longer prompts cost more, prompt_s per prompt token (as the server's tokenizer counts them): a
    # prompt of 50 more words costs as much again as the 50 before
    short, middle, long = (run_s("a" + " a" * words, 10) for words in (50, 100, 150))
    assert ten < short < middle < long
    assert long - middle == pytest.approx(middle - short, abs=2.5e-3)


# --- what real clients send (docs/api.md, "OpenAI and Hugging Face routes") ---------------------------------------


def test_openai_sdk_lists_and_retrieves_models(tfleet: TextFleet) -> None:
    """``client.models.list()`` reads OpenAI's list shape; each model has OpenAI's fields and
    Homefleet's own (kinds, params); ``models.retrieve`` one; an unknown id is a NotFoundError
    with OpenAI's error body (param ``model``, code ``unknown_model``)."""
    listed = {m.id: m for m in tfleet.client.models.list()}
    assert set(listed) == {*MODELS, "tiny-sd"}
    model = listed["tiny-qwen2"]
    assert model.object == "model" and model.owned_by == "homefleet" and model.created > 1_600_000_000
    assert model.model_extra["kinds"] == ["text"] and "max_new_tokens" in model.model_extra["params"]["text"]["params"]
    assert listed["tiny-sd"].model_extra["family"] == "sd1"
    one = tfleet.client.models.retrieve("tiny-sd")
    assert one.id == "tiny-sd" and one.model_extra["kinds"] == listed["tiny-sd"].model_extra["kinds"]
    with pytest.raises(openai.NotFoundError) as missing:
        tfleet.client.models.retrieve("no-such-model")
    body = missing.value.body
    assert isinstance(body, dict) and body["code"] == "unknown_model" and body["param"] == "model"
    assert body["type"] == "not_found_error" and "'no-such-model' is not registered" in body["message"]


@pytest.mark.parametrize(
    "response_format",
    [
        {"type": "json", "value": SCHEMA},  # huggingface_hub's and TGI's own form
        {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}},  # rewritten by the client
    ],
)
def test_hub_chat_completion_with_a_schema_is_constrained_by_it(
    tfleet: TextFleet, response_format: dict[str, Any]
) -> None:
    """``InferenceClient.chat_completion(response_format=...)``: TGI's ``json`` form was a 422 and
    the ``json_schema`` form (which the client sends as ``{"type": "json_object", "value":
    schema}``) ran unconstrained; both now carry the schema to the job, and a random-weight
    model's answer validates. A form that cannot be honoured is a 422 naming the field."""
    done = hub(tfleet).chat_completion(
        [{"role": "user", "content": "person"}],
        model="tiny-llama",
        max_tokens=160,
        response_format=response_format,
        temperature=1.0,
        seed=5,
        extra_body={"target": MACHINE},
    )
    job = latest_job(tfleet)
    assert job.params["grammar"] == {"type": "json", "value": SCHEMA}
    content = done.choices[0].message.content
    jsonschema.validate(json.loads(content), SCHEMA)
    assert done.choices[0].finish_reason == "stop" and content == Path(job.result_path).read_text("utf-8")
    with pytest.raises(huggingface_hub.errors.HfHubHTTPError) as refused:
        hub(tfleet).chat_completion(
            [{"role": "user", "content": "x"}],
            model="tiny-llama",
            max_tokens=4,
            response_format={"type": "json_object", "schema": SCHEMA},
        )
    assert refused.value.response.status_code == 400
    assert refused.value.response.json()["error"]["param"] == "response_format.schema"


def stop_of(tfleet: TextFleet, model: str, prompt: str, tokens: int) -> tuple[str, str]:
    """A stop sequence the sampled continuation of ``prompt`` (seed :data:`STOP_SEED`) will
    write after its first characters, and that text: tiny random weights write what they write,
    so the test reads it first (the same seed writes the same text again)."""
    whole = (
        tfleet.client.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=tokens,
            temperature=1.0,
            seed=STOP_SEED,
            extra_body={"target": MACHINE},
        )
        .choices[0]
        .text
    )
    for at in range(max(1, len(whole) // 3), len(whole) - 2):
        stop = whole[at : at + 2]
        if whole.find(stop) == at and stop.strip():
            return stop, whole
    raise AssertionError(f"no stop sequence found in {whole!r}")


STOP_SEED = 12


@pytest.mark.parametrize("stream", [False, True])
def test_openai_stop_cuts_the_text_before_the_sequence(tfleet: TextFleet, stream: bool) -> None:
    """``stop`` ends generation once the decoded text holds a sequence; the answer (streamed or
    not) is the text before it, ``finish_reason`` ``stop``; the job's verified result is the cut
    text and it generated fewer tokens than the limit."""
    stop, whole = stop_of(tfleet, "tiny-llama", "once upon", 30)
    expected = whole[: whole.find(stop)]
    if stream:
        chunks = list(
            tfleet.client.completions.create(
                model="tiny-llama",
                prompt="once upon",
                max_tokens=30,
                stop=[stop, "never-written"],
                stream=True,
                temperature=1.0,
                seed=STOP_SEED,
                extra_body={"target": MACHINE},
            )
        )
        text = "".join(c.choices[0].text for c in chunks)
        finish, job_id = chunks[-1].choices[0].finish_reason, chunks[-1].model_extra["job_id"]
    else:
        done = tfleet.client.completions.create(
            model="tiny-llama",
            prompt="once upon",
            max_tokens=30,
            stop=stop,
            temperature=1.0,
            seed=STOP_SEED,
            extra_body={"target": MACHINE},
        )
        text, finish, job_id = done.choices[0].text, done.choices[0].finish_reason, done.model_extra["job_id"]
        assert done.usage is not None and done.usage.completion_tokens < 30
    job = tfleet.ctx.journal.get(job_id)
    assert text == expected and finish == "stop" and stop not in text
    assert Path(job.result_path).read_text("utf-8") == expected and job.provenance["usage"]["stop_sequence"] == stop
    assert job.params["stop"] == ([stop, "never-written"] if stream else [stop])


def test_a_chat_stream_cut_before_any_text_still_sends_its_role(tfleet: TextFleet) -> None:
    """A stop sequence that the answer begins with: no text is sent, and the choice's only
    chunk, its finish, still carries ``role`` (OpenAI sends it in every choice's first chunk)."""
    common: dict[str, Any] = {
        "model": "tiny-qwen2",
        "messages": [{"role": "user", "content": "go"}],
        "max_completion_tokens": 8,
        "temperature": 1.0,
        "seed": STOP_SEED,
        "extra_body": {"target": MACHINE},
    }
    whole = tfleet.client.chat.completions.create(**common).choices[0].message.content
    assert whole and whole[:2].strip(), whole
    chunks = list(tfleet.client.chat.completions.create(**common, stop=[whole[:2]], stream=True))
    assert not any(c.choices[0].delta.content for c in chunks)
    assert [c.choices[0].delta.role for c in chunks] == ["assistant"] + [None] * (len(chunks) - 1)
    assert chunks[-1].choices[0].finish_reason == "stop"


@pytest.mark.parametrize("stream", [False, True])
def test_openai_n_gives_n_choices_one_job_each(tfleet: TextFleet, stream: bool) -> None:
    """``n=2``: two choices, each a journaled job (seeds 40 and 41, sampled; from the largest
    seed, the second wraps to 0: the fuzz's seed + 1 had been refused), their texts the jobs'
    verified results; the usage counts the prompt once and sums both completions."""
    messages = [{"role": "user", "content": "hi"}]
    seed = 40 if stream else MAX_SEED
    if stream:
        chunks = list(
            tfleet.client.chat.completions.create(
                model="tiny-qwen2",
                messages=messages,
                max_completion_tokens=6,
                n=2,
                seed=seed,
                temperature=1.0,
                stream=True,
                extra_body={"target": MACHINE},
            )
        )
        texts = {0: "", 1: ""}
        for c in chunks:
            for choice in c.choices:
                texts[choice.index] += choice.delta.content or ""
        job_ids = [
            next(c.model_extra["job_id"] for c in chunks if c.choices and c.choices[0].index == i) for i in (0, 1)
        ]
        usage = chunks[-1].usage
        assert chunks[-1].choices == [] and sum(1 for c in chunks if c.choices and c.choices[0].finish_reason) == 2
    else:
        done = tfleet.client.chat.completions.create(
            model="tiny-qwen2",
            messages=messages,
            max_completion_tokens=6,
            n=2,
            seed=seed,
            temperature=1.0,
            extra_body={"target": MACHINE},
        )
        assert [c.index for c in done.choices] == [0, 1]
        texts = {c.index: c.message.content for c in done.choices}
        job_ids, usage = done.model_extra["job_ids"], done.usage
    jobs = [tfleet.ctx.journal.get(job_id) for job_id in job_ids]
    assert len(set(job_ids)) == 2 and [job.params["seed"] for job in jobs] == ([40, 41] if stream else [MAX_SEED, 0])
    assert [texts[i] for i in (0, 1)] == [Path(job.result_path).read_text("utf-8") for job in jobs]
    assert usage is not None
    assert usage.completion_tokens == sum(j.provenance["usage"]["completion_tokens"] for j in jobs)
    assert usage.prompt_tokens == jobs[0].provenance["usage"]["prompt_tokens"]  # the prompt once, as OpenAI counts
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    with pytest.raises(openai.BadRequestError) as too_many:
        tfleet.client.completions.create(model="tiny-qwen2", prompt="x", n=9)
    assert too_many.value.body["param"] == "n"


def test_tgi_stop_through_hub_text_generation(tfleet: TextFleet) -> None:
    """``InferenceClient.text_generation(stop=[...])``, streamed or not: the text before the
    sequence, TGI's ``stop_sequence`` finish reason; the tokens' texts join into it."""
    stop, whole = stop_of(tfleet, "small-gpt2", "ab", 8)
    out = hub(tfleet).text_generation(
        "ab", max_new_tokens=8, stop=[stop], details=True, do_sample=True, temperature=1.0, seed=STOP_SEED
    )
    assert out.generated_text == whole[: whole.find(stop)]
    assert out.details is not None and out.details.finish_reason == "stop_sequence"
    assert "".join(t.text for t in out.details.tokens) == out.generated_text  # no token text past the stop
    assert latest_job(tfleet).params["stop"] == [stop]
    client = hub(tfleet)  # held while its stream is read
    events = list(
        client.text_generation(
            "ab",
            max_new_tokens=8,
            stop=[stop],
            details=True,
            do_sample=True,
            temperature=1.0,
            seed=STOP_SEED,
            stream=True,
        )
    )
    assert "".join(e.token.text for e in events) == events[-1].generated_text == out.generated_text
    assert events[-1].details is not None and events[-1].details.finish_reason == "stop_sequence"


def test_tgi_details_give_each_token_its_own_text_while_a_stop_sequence_partly_matches(tfleet: TextFleet) -> None:
    """``text_generation(stop=[...], details=True)`` whose text starts as the stop sequence does
    but never completes it: each token's ``text`` is its own (as without ``stop``), not ``""``
    for the tokens a stream would hold back and the held text on a later token; they join into
    ``generated_text``. Holding a partial match back is for the stream only (docs/api.md,
    "OpenAI and Hugging Face routes")."""
    client = hub(tfleet)
    plain = client.text_generation("x", max_new_tokens=10, details=True)  # greedy: the same tokens again
    assert plain.details is not None and len(plain.generated_text) >= 2, plain
    absent = next(c for c in "~#%^|" if c not in plain.generated_text)
    stop = plain.generated_text[:2] + absent  # the text's first two characters begin it; it never completes
    cut = client.text_generation("x", max_new_tokens=10, stop=[stop], details=True)
    assert cut.details is not None and cut.generated_text == plain.generated_text
    assert [(t.id, t.text) for t in cut.details.tokens] == [(t.id, t.text) for t in plain.details.tokens]
    assert cut.details.tokens[0].text == plain.generated_text[0]
    assert "".join(t.text for t in cut.details.tokens) == cut.generated_text
    assert latest_job(tfleet).params["stop"] == [stop]


def test_a_refusal_names_the_field_the_client_sent(tfleet: TextFleet) -> None:
    """The job's ``max_new_tokens`` comes from ``max_tokens`` (``max_completion_tokens`` on a
    chat): a refusal's ``param`` and message name that, not ``params.max_new_tokens``; TGI's
    message names ``parameters.max_new_tokens``."""
    with pytest.raises(openai.BadRequestError) as completion:
        tfleet.client.completions.create(model="small-gpt2", prompt="x" * 8, max_tokens=5)
    body = completion.value.body
    assert isinstance(body, dict) and body["param"] == "max_tokens" and body["code"] == "context_length_exceeded"
    assert "lower max_tokens to at most 4" in body["message"] and "max_new_tokens" not in body["message"]
    with pytest.raises(openai.BadRequestError) as chat:
        tfleet.client.chat.completions.create(
            model="tiny-qwen2",
            messages=[{"role": "user", "content": "x"}],
            max_completion_tokens=5,
            extra_body={"response_format": {"type": "json", "value": {"type": "nonsense"}}},
        )
    assert isinstance(chat.value.body, dict) and chat.value.body["param"] == "response_format"
    assert "params.grammar" not in chat.value.body["message"]
    url, auth = tfleet.local.api_url, {"Authorization": f"Bearer {TEST_API_KEY}"}
    tgi = httpx.post(
        f"{url}/generate",
        headers=auth,
        timeout=60,
        json={"inputs": "x", "model": "tiny-gpt2", "parameters": {"grammar": {"type": "regex", "value": "(unclosed"}}},
        verify=tls_context(),
    )
    assert tgi.status_code == 422 and tgi.json()["error"].startswith("parameters.grammar does not compile")
