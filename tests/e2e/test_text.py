"""Issue 20 end to end: the OpenAI routes ``/v1/completions`` and ``/v1/chat/completions``
through the official ``openai`` SDK, a real API and a real ``celery worker`` running tiny
random-weight causal LMs of each architecture (Llama, Qwen2, GPT-2) built offline.

One module-scoped fleet: the API and ONE worker, machine ``m1``; a GPT-2 copy registered as
``small-gpt2`` has its own token limits in the fleet file (``[models.small-gpt2]``). The 422
limits (R22) are enforced by the server before any device, with the message naming the limit
and the figures; a refused submission is journaled ``rejected`` with its reason (R19).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest
import redis

from app.context import ServerContext, build_context
from app.core.config import Settings
from app.core.digest import file_digest
from app.core.states import JobState
from app.devtools.localfleet import LocalFleet
from app.devtools.redis_server import free_port
from app.fleet.config import ModelGuess
from tests.helpers import TEST_API_KEY, make_fleet

pytestmark = pytest.mark.e2e

MACHINE = "m1"
MODELS = {"tiny-llama": "tiny-llama", "tiny-qwen2": "tiny-qwen2", "tiny-gpt2": "tiny-gpt2", "small-gpt2": "tiny-gpt2"}


@dataclass
class TextFleet:
    local: LocalFleet
    ctx: ServerContext
    client: openai.OpenAI


@pytest.fixture(scope="module")
def tfleet(tmp_path_factory: pytest.TempPathFactory, redis_base_url: str, tiny_text_dir: Path) -> Iterator[TextFleet]:
    data_dir = tmp_path_factory.mktemp("text-fleet")
    redis_url = f"{redis_base_url}/11"
    redis.Redis.from_url(redis_url).flushdb()
    fleet_config = make_fleet(MACHINE, families=frozenset({"llama", "qwen2", "gpt2"}))
    fleet_config = fleet_config.model_copy(
        update={"models": {"small-gpt2": ModelGuess(max_input_tokens=8, max_total_tokens=12)}})
    fleet_file = data_dir / "fleet.toml"
    fleet_file.write_text(fleet_config.to_toml())
    settings = Settings(data_dir=data_dir, redis_url=redis_url, fleet_file=fleet_file, api_port=free_port(),
                        heartbeat_interval_s=0.5, heartbeat_ttl_s=8, api_keys=[TEST_API_KEY])
    ctx = build_context(settings, fleet_config, migrate=True)
    for model_id, folder in MODELS.items():
        ctx.registry.add(tiny_text_dir / folder, model_id=model_id)
    local = LocalFleet(settings, fleet_config, fleet_file)
    client = openai.OpenAI(base_url=f"{local.api_url}/v1", api_key=TEST_API_KEY, max_retries=0, timeout=60)
    try:
        for model_id in MODELS:
            local.copy_model(model_id, MACHINE)
        local.start_api()
        local.start_worker(MACHINE)
        for model_id in MODELS:
            local.wait_online([MACHINE], model_id=model_id, timeout_s=120)
        yield TextFleet(local, ctx, client)
    finally:
        client.close()
        local.stop()
        ctx.close()


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-qwen2", "tiny-gpt2"])
def test_openai_completions_run_a_text_job_on_the_worker(tfleet: TextFleet, model: str) -> None:
    """The SDK's completion is the job's verified UTF-8 result, with the job's token counts."""
    done = tfleet.client.completions.create(model=model, prompt="hello", max_tokens=5, seed=7,
                                            extra_body={"target": MACHINE})
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
    again = tfleet.client.completions.create(model=model, prompt="hello", max_tokens=5, seed=7,
                                             extra_body={"target": MACHINE})
    assert again.choices[0].text == choice.text  # greedy: the same text


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-qwen2"])
def test_openai_chat_completions_template_the_messages(tfleet: TextFleet, model: str) -> None:
    done = tfleet.client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hi"}], max_completion_tokens=3,
        extra_body={"target": "auto"})
    (choice,) = done.choices
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert done.usage is not None and done.usage.prompt_tokens > len("hi")  # the template's tokens counted
    job = tfleet.ctx.journal.get(done.model_extra["job_id"])
    assert job.params["chat"] is True and "hi" in job.params["prompt"] and job.params["max_new_tokens"] == 3


def test_the_limits_are_422_naming_the_limit_and_the_figures(tfleet: TextFleet) -> None:
    """R22: refused before any device; the fleet file's own limits for small-gpt2 (8 / 12)."""
    with pytest.raises(openai.UnprocessableEntityError) as long_prompt:
        tfleet.client.completions.create(model="small-gpt2", prompt="x" * 9, max_tokens=1)
    assert "at most 8 tokens (max_input_tokens), got 9" in long_prompt.value.message
    with pytest.raises(openai.UnprocessableEntityError) as too_many:
        tfleet.client.completions.create(model="small-gpt2", prompt="x" * 8, max_tokens=5)
    assert "at most 12 (max_total_tokens), got 8 + 5 = 13" in too_many.value.message
    body = too_many.value.body
    assert isinstance(body, dict) and body.get("code") == "invalid_max_new_tokens"
    rejected = tfleet.ctx.journal.list(states=[JobState.rejected])
    assert {job.reason for job in rejected} >= {"invalid_prompt", "invalid_max_new_tokens"}  # R19
    with pytest.raises(openai.UnprocessableEntityError) as no_template:
        tfleet.client.chat.completions.create(model="tiny-gpt2", messages=[{"role": "user", "content": "hi"}])
    assert "no chat template" in no_template.value.message


@pytest.mark.parametrize("chat", [False, True])
def test_streaming_sends_the_text_as_it_is_generated_then_the_finish_and_usage(tfleet: TextFleet, chat: bool) -> None:
    """SSE through the SDK's ``stream=True``: several text chunks arrive while the job runs, in
    order; joined they are exactly the job's verified result; the last chunk carries the finish
    reason and the token counts; the stream ends (``[DONE]``)."""
    if chat:
        stream = tfleet.client.chat.completions.create(
            model="tiny-qwen2", messages=[{"role": "user", "content": "go"}], max_completion_tokens=40, stream=True,
            extra_body={"target": MACHINE})
    else:
        stream = tfleet.client.completions.create(model="tiny-llama", prompt="go", max_tokens=40, stream=True,
                                                  extra_body={"target": MACHINE})
    chunks = list(stream)
    texts = [(c.choices[0].delta.content if chat else c.choices[0].text) or "" for c in chunks]
    last = chunks[-1]
    assert last.choices[0].finish_reason in ("stop", "length")
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    assert last.usage is not None and last.usage.completion_tokens >= 1
    job = tfleet.ctx.journal.get(last.model_extra["job_id"])
    assert job.state == "succeeded"
    assert "".join(texts) == Path(job.result_path).read_bytes().decode("utf-8")
    # the tiny models (seed 0, greedy) never end their turn within 40 tokens: 40 reports, streamed in pieces
    assert last.usage.completion_tokens == 40 and last.choices[0].finish_reason == "length"
    assert sum(1 for text in texts[:-1] if text) >= 2


def test_a_streaming_request_over_the_limits_is_a_plain_422(tfleet: TextFleet) -> None:
    with pytest.raises(openai.UnprocessableEntityError, match="max_total_tokens"):
        tfleet.client.completions.create(model="small-gpt2", prompt="x", max_tokens=20, stream=True)
