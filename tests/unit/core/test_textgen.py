"""A text model's KV cache priced from its config.json (2 x layers x KV heads x head
dim x bytes per value x tokens), checked against the cache transformers really allocates, and
the token limits' defaults and precedence."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.core.limits import FamilyLimits, token_limits
from app.core.textgen import (
    kv_bytes_per_token,
    kv_cache_bytes,
    max_positions,
    model_config,
)
from app.devtools.tiny_text import MAX_POSITIONS, TEXT_FAMILIES
from routing.estimate import DEFAULT_WORKING, Estimator, ModelProfile


@pytest.mark.parametrize("family", TEXT_FAMILIES)
def test_the_kv_cache_formula_equals_the_cache_transformers_allocates(family: str, tiny_text_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    folder = tiny_text_dir / f"tiny-{family}"
    model = AutoModelForCausalLM.from_pretrained(str(folder), local_files_only=True)
    tokens = 9
    with torch.inference_mode():
        out = model(torch.arange(tokens).unsqueeze(0), use_cache=True)
    cache = out.past_key_values
    allocated = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
    assert kv_cache_bytes(model_config(folder), tokens) == allocated
    assert kv_cache_bytes(model_config(folder), tokens, "bf16") == allocated // 2


def test_grouped_query_attention_counts_kv_heads_not_attention_heads() -> None:
    # Qwen2-7B's config: 28 layers, 28 heads, 4 KV heads, hidden 3584 (head dim 128)
    config = {
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "hidden_size": 3584,
        "max_position_embeddings": 32768,
    }
    assert kv_bytes_per_token(config, "bf16") == 2 * 28 * 4 * 128 * 2 == 57344
    assert max_positions(config) == 32768 and max_positions({"n_positions": 1024}) == 1024


def test_token_limits_precedence_model_then_family_then_config() -> None:
    assert token_limits(FamilyLimits(), 512) == token_limits(FamilyLimits(), 512, None, None)
    assert (token_limits(FamilyLimits(), 512).max_input_tokens, token_limits(FamilyLimits(), 512).max_total_tokens) == (
        511,
        512,
    )
    family = FamilyLimits(max_input_tokens=100, max_total_tokens=200)
    assert token_limits(family, 512).max_total_tokens == 200 and token_limits(family, 512).max_input_tokens == 100
    own = token_limits(family, 512, max_input_tokens=10, max_total_tokens=16)
    assert (own.max_input_tokens, own.max_total_tokens) == (10, 16)
    assert token_limits(family, 512, max_total_tokens=50).max_input_tokens == 49  # never above total - 1


def test_a_text_jobs_working_memory_adds_the_models_kv_cache_at_max_total_tokens() -> None:
    estimator = Estimator(
        models={"lm": ModelProfile("lm", "llama", 1000, kind="text", kv_cache_bytes=256 * MAX_POSITIONS)}
    )
    memory = estimator.memory("lm", "text", 1)
    assert memory.weights_bytes == 1000
    assert memory.working_bytes == DEFAULT_WORKING["text"].bytes(1) + 256 * MAX_POSITIONS
    assert estimator.memory("lm", "txt2img", 1).working_bytes == DEFAULT_WORKING["txt2img"].bytes(1)  # text only


def test_token_decoder_shares_join_into_the_decoded_text_and_split_characters_wait(tiny_text_dir: Path) -> None:
    """TGI's per-token texts: "é" is two byte tokens with the tiny byte-level tokenizer; the
    first gets "" (no U+FFFD half character), the second "é"; a special token decodes to "" and
    is marked special; an unfinished character at the very end is kept (as decode keeps it)."""
    from app.core.textgen import TokenDecoder, load_tokenizer

    tokenizer = load_tokenizer(tiny_text_dir / "tiny-gpt2")
    ids = tokenizer("aé b", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    decoder = TokenDecoder(tokenizer)
    pieces = [decoder.add(token) for token in ids]
    assert pieces == ["a", "", "é", " ", "b", ""] and "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True)
    assert decoder.special(tokenizer.eos_token_id) and not decoder.special(ids[0])
    half = tokenizer("é", add_special_tokens=False)["input_ids"][:1]
    assert TokenDecoder(tokenizer).add(half[0], last=True) == tokenizer.decode(half) == "\ufffd"
