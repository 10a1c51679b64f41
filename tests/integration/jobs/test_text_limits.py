"""R22: a text job's prompt is tokenized by the server exactly as the worker will feed
it (chat-templated for chat requests) and checked against the model's ``max_input_tokens`` and
``max_total_tokens`` before any device; defaults from the model's config.json, set per family in
the settings' limits and per model in the fleet file's ``[models.<id>]``."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from app.context import ServerContext, build_context
from app.core.config import Settings
from app.core.errors import Rejected
from app.core.limits import FamilyLimits, default_limits
from app.devtools.tiny_text import MAX_POSITIONS
from app.fleet.config import ModelGuess
from tests.helpers import make_fleet


@pytest.fixture
def text_ctx(settings: Settings, tiny_text_dir: Path) -> Iterator[ServerContext]:
    limits = {**default_limits(), "qwen2": FamilyLimits(max_input_tokens=20, max_total_tokens=40)}
    fleet = make_fleet("m1", families=frozenset({"llama", "qwen2", "gpt2"}))
    fleet = fleet.model_copy(update={"models": {"small-gpt2": ModelGuess(max_input_tokens=10, max_total_tokens=16)}})
    ctx = build_context(settings.model_copy(update={"limits": limits}), fleet, migrate=True)
    for family in ("llama", "qwen2", "gpt2"):
        ctx.registry.add(tiny_text_dir / f"tiny-{family}", f"tiny-{family}")
    ctx.registry.add(tiny_text_dir / "tiny-gpt2", "small-gpt2")
    try:
        yield ctx
    finally:
        ctx.close()


def refusal(ctx: ServerContext, model_id: str, params: dict[str, object]) -> Rejected:
    with pytest.raises(Rejected) as refused:
        ctx.dispatcher.validator.request(model_id, "text", {"seed": 1, **params}, "auto")
    return refused.value


def test_defaults_come_from_max_position_embeddings(text_ctx: ServerContext) -> None:
    limits = text_ctx.dispatcher.validator.token_limits("tiny-llama")
    assert (limits.max_input_tokens, limits.max_total_tokens) == (MAX_POSITIONS - 1, MAX_POSITIONS)
    text_ctx.dispatcher.validator.request(
        "tiny-llama", "text", {"prompt": "x" * 100, "max_new_tokens": 412, "seed": 1}, "auto"
    )  # exactly 512: taken
    error = refusal(text_ctx, "tiny-llama", {"prompt": "x" * 100, "max_new_tokens": 413})
    assert error.reason == "context_length_exceeded" and error.param == "params.max_new_tokens"
    assert "at most 512 (max_total_tokens), got 100 + 413 = 513" in error.message


def test_a_long_prompt_is_refused_naming_max_input_tokens_and_its_count(text_ctx: ServerContext) -> None:
    error = refusal(text_ctx, "tiny-gpt2", {"prompt": "ab" * 300, "max_new_tokens": 1})
    assert (error.reason, error.param) == ("context_length_exceeded", "params.prompt")
    assert error.message.startswith("the prompt must be at most 511 tokens (max_input_tokens), got 600 tokens")


def test_family_limits_from_settings_apply(text_ctx: ServerContext) -> None:
    assert (
        "at most 20 tokens (max_input_tokens), got 21" in refusal(text_ctx, "tiny-qwen2", {"prompt": "y" * 21}).message
    )
    assert (
        "at most 40 (max_total_tokens), got 20 + 21 = 41"
        in refusal(text_ctx, "tiny-qwen2", {"prompt": "y" * 20, "max_new_tokens": 21}).message
    )


def test_a_models_own_limits_from_the_fleet_file_win(text_ctx: ServerContext) -> None:
    assert (
        "at most 10 tokens (max_input_tokens), got 11" in refusal(text_ctx, "small-gpt2", {"prompt": "z" * 11}).message
    )
    text_ctx.dispatcher.validator.request(
        "tiny-gpt2", "text", {"prompt": "z" * 11, "seed": 1}, "auto"
    )  # same files, other id


def test_a_chat_is_counted_with_its_template(text_ctx: ServerContext) -> None:
    validator = text_ctx.dispatcher.validator
    prompt = validator.chat_prompt("tiny-qwen2", [{"role": "user", "content": "hi"}])
    assert prompt == "<|im_start|>user\nhi<|im_im_end|>\n<|im_start|>assistant\n".replace("im_im", "im")
    # 3 special tokens + "user\nhi" (7 bytes) + "\n" + "assistant\n" (10): 21 tokens > 20
    error = refusal(text_ctx, "tiny-qwen2", {"prompt": prompt, "chat": True})
    assert "at most 20 tokens (max_input_tokens), got 21" in error.message
    with pytest.raises(Rejected, match="no chat template") as no_template:
        validator.chat_prompt("tiny-gpt2", [{"role": "user", "content": "hi"}])
    assert no_template.value.reason == "invalid_messages"
    with pytest.raises(Rejected, match="messages"):
        validator.chat_prompt("tiny-llama", [{"role": "user"}])
    with pytest.raises(Rejected, match="each role one of system, developer, user, assistant") as bogus:
        validator.chat_prompt("tiny-qwen2", [{"role": "bogus", "content": "hi"}])
    assert bogus.value.param == "messages"
    # OpenAI's developer role is the template's system turn
    assert validator.chat_prompt("tiny-qwen2", [{"role": "developer", "content": "be brief"}]) == validator.chat_prompt(
        "tiny-qwen2", [{"role": "system", "content": "be brief"}]
    )


def test_text_params_are_checked_like_every_kinds(text_ctx: ServerContext) -> None:
    assert refusal(text_ctx, "tiny-llama", {"prompt": "x", "steps": 4}).reason == "unknown_param"
    assert refusal(text_ctx, "tiny-llama", {"prompt": "x", "temperature": 3.0}).reason == "invalid_params"
    assert refusal(text_ctx, "tiny-llama", {"prompt": "x", "chat": "yes"}).reason == "invalid_params"
    assert refusal(text_ctx, "tiny-llama", {"prompt": " "}).reason == "invalid_prompt"


def test_the_journaled_estimate_prices_the_kv_cache_at_the_models_max_total_tokens(text_ctx: ServerContext) -> None:
    """R10/R15: weights from the safetensors headers plus 2 x layers x KV heads x head
    dim x bytes x max_total_tokens (the fleet file's 16 for small-gpt2, the config's 512 else)."""
    estimator = text_ctx.dispatcher.costs.estimator()
    # tiny llama: 2 layers x 2 KV heads x head dim 8; tiny gpt2: 2 layers x 4 heads x 8; fp32
    assert estimator.models["tiny-llama"].kv_cache_bytes == 2 * 2 * 2 * 8 * 4 * 512
    assert estimator.models["small-gpt2"].kv_cache_bytes == 2 * 2 * 4 * 8 * 4 * 16
    assert estimator.models["tiny-gpt2"].kv_cache_bytes == 2 * 2 * 4 * 8 * 4 * 512
    memory = estimator.memory("tiny-llama", "text", 1)
    assert memory.weights_bytes == text_ctx.registry.weights_bytes("tiny-llama") > 0
    assert memory.working_bytes == 100_000_000 + 2 * 2 * 2 * 8 * 4 * 512


def new_tokens(ctx: ServerContext, model_id: str, params: dict[str, object]) -> object:
    """The ``max_new_tokens`` a text job of ``params`` is journaled with."""
    taken: dict[str, object] = {"seed": 1, **params}
    ctx.dispatcher.validator.request(model_id, "text", taken, "auto")
    return taken["max_new_tokens"]


def test_a_default_max_new_tokens_never_makes_a_refusal(text_ctx: ServerContext, tiny_text_dir: Path) -> None:
    """R22: a ``max_new_tokens`` the client did not send fills the context's rest instead of
    refusing a prompt the model takes: the kind's 16 for a plain prompt, the rest of the
    context for a chat (OpenAI's and TGI's chat default), a model's own default, each at most
    the rest. A prompt that leaves no room is refused as the prompt's fault."""
    assert new_tokens(text_ctx, "tiny-llama", {"prompt": "x" * 100}) == 16
    assert new_tokens(text_ctx, "tiny-llama", {"prompt": "x" * 500}) == 12  # 512 - 500 (it was a 422)
    assert new_tokens(text_ctx, "tiny-llama", {"prompt": "x" * 100, "chat": True}) == 412  # the rest of 512
    text_ctx.registry.add(tiny_text_dir / "tiny-llama", "brief-llama", defaults={"max_new_tokens": 64})
    assert new_tokens(text_ctx, "brief-llama", {"prompt": "x" * 100, "chat": True}) == 64  # the operator's default
    assert new_tokens(text_ctx, "brief-llama", {"prompt": "x" * 480, "chat": True}) == 32  # at most the rest
    assert new_tokens(text_ctx, "tiny-llama", {"prompt": "x" * 100, "max_new_tokens": 3}) == 3  # asked: as asked
    full = refusal(text_ctx, "tiny-llama", {"prompt": "x" * 511 + "y"})  # 512: over max_input_tokens (511)
    assert (full.reason, full.param) == ("context_length_exceeded", "params.prompt")
    asked = refusal(text_ctx, "tiny-llama", {"prompt": "x" * 500, "max_new_tokens": 16})  # asked: refused as before
    assert (asked.reason, asked.param) == ("context_length_exceeded", "params.max_new_tokens")
