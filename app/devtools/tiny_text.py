"""Tiny random-weight causal language models, built offline: a transformers model
folder (``config.json`` with ``architectures``, ``model.safetensors``, ``generation_config.json``)
and its tokenizer (``tokenizer.json`` + ``tokenizer_config.json``), for the Llama, Qwen2 and
GPT-2 architectures.

The tokenizer is byte-level BPE without merges, made with the ``tokenizers`` library: every
UTF-8 byte is one token (256), plus the family's special tokens; so any text round-trips and
token counts equal byte counts plus the template's specials. Llama and Qwen2 folders carry a
chat template (Llama 3's header format, Qwen2's ChatML); GPT-2 has none (plain completions).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from app.core.quiet import quiet_libraries

__all__ = ["TEXT_FAMILIES", "TINY_TEXT_MODELS", "make_tiny_text"]

#: folder name -> family (the registry's family: the ``architectures`` class's, app/core/families.py)
TINY_TEXT_MODELS: dict[str, str] = {"tiny-llama": "llama", "tiny-qwen2": "qwen2", "tiny-gpt2": "gpt2"}
TEXT_FAMILIES: tuple[str, ...] = tuple(TINY_TEXT_MODELS.values())
_FOLDER_BY_FAMILY = {family: name for name, family in TINY_TEXT_MODELS.items()}

MAX_POSITIONS = 512  # max_position_embeddings of every tiny model: the default max_total_tokens

_LLAMA_TEMPLATE = (
    "{{ '<|begin_of_text|>' }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] + '<|eot_id|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
_CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# family -> (special tokens, bos, eos, chat template)
_TOKENS: dict[str, tuple[tuple[str, ...], str | None, str, str | None]] = {
    "llama": (
        ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
        "<|begin_of_text|>",
        "<|eot_id|>",
        _LLAMA_TEMPLATE,
    ),
    "qwen2": (("<|endoftext|>", "<|im_start|>", "<|im_end|>"), None, "<|im_end|>", _CHATML_TEMPLATE),
    "gpt2": (("<|endoftext|>",), "<|endoftext|>", "<|endoftext|>", None),
}


def _tokenizer(family: str) -> Any:
    """A ``PreTrainedTokenizerFast``: byte-level BPE, no merges, the family's specials and chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {char: index for index, char in enumerate(sorted(alphabet))}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    core.decoder = decoders.ByteLevel()
    specials, bos, eos, template = _TOKENS[family]
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, model_max_length=MAX_POSITIONS)
    tokenizer.add_special_tokens({"additional_special_tokens": list(specials)})
    tokenizer.eos_token = eos
    tokenizer.pad_token = eos
    if bos is not None:
        tokenizer.bos_token = bos
    if template is not None:
        tokenizer.chat_template = template
    return tokenizer


def _model(family: str, tokenizer: Any) -> Any:
    """The family's causal LM class with tiny random weights (2 layers, 4 heads, 2 KV heads where the architecture has
    GQA)."""
    import transformers

    ids = {
        "vocab_size": len(tokenizer),
        "eos_token_id": tokenizer.eos_token_id,
        "bos_token_id": tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    if family == "gpt2":
        config = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=MAX_POSITIONS, **ids)
        return transformers.GPT2LMHeadModel(config)
    common = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": MAX_POSITIONS,
        "tie_word_embeddings": True,
        **ids,
    }
    if family == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))


def _is_complete(folder: Path) -> bool:
    return (folder / "config.json").is_file() and (folder / "tokenizer_config.json").is_file()


def _build_into(family: str, folder: Path, seed: int, force: bool) -> Path:
    import torch

    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", suffix=".tmp", dir=folder.parent))
    try:
        target = staging / "model"
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            tokenizer = _tokenizer(family)
            model = _model(family, tokenizer)
        with quiet_libraries():  # no "Writing model shards" bar for a model of one small shard
            model.save_pretrained(str(target), safe_serialization=True)
            tokenizer.save_pretrained(str(target))
        os.chmod(staging, 0o755)
        if folder.exists():
            if _is_complete(folder) and not force:
                return folder
            os.replace(folder, staging / "old")
        os.replace(target, folder)
        return folder
    finally:
        shutil.rmtree(staging)


def make_tiny_text(
    out_dir: Path, families: Iterable[str] = ("llama",), seed: int = 0, *, force: bool = False
) -> dict[str, Path]:
    """Build tiny causal LMs into ``out_dir/<name>/`` (``tiny-llama``, ``tiny-qwen2``,
    ``tiny-gpt2``); ``{family: folder}``. A complete folder is kept unless ``force``. Each is
    ~0.1 MB of float32 safetensors and builds in well under a second; load it back with
    ``AutoModelForCausalLM.from_pretrained(folder, local_files_only=True)``.

    Raises:
        ValueError: an unknown family (naming the known ones).
    """
    wanted = list(dict.fromkeys(families))
    unknown = [family for family in wanted if family not in _TOKENS]
    if unknown:
        raise ValueError(f"unknown tiny text family(ies) {unknown}; known: {', '.join(TEXT_FAMILIES)}")
    result = {}
    for family in wanted:
        folder = Path(out_dir) / _FOLDER_BY_FAMILY[family]
        result[family] = folder if _is_complete(folder) and not force else _build_into(family, folder, seed, force)
    return result


def chat_template_of(folder: Path) -> str | None:
    """The chat template saved in ``folder`` (tokenizer_config.json or chat_template.jinja), or None."""
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    config = folder / "tokenizer_config.json"
    return json.loads(config.read_text()).get("chat_template") if config.is_file() else None
