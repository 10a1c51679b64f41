"""Text generation's shared rules, one home for the server's validation and the
worker's runner: how a transformers model folder is recognised, how a prompt becomes token ids
(the server counts exactly what the worker feeds the model, as TGI's router does), the model's
token limits from its ``config.json``, and the KV cache's bytes.

A text model folder is a transformers causal-LM folder: ``config.json`` naming its class in
``architectures`` (``LlamaForCausalLM``, ``Qwen2ForCausalLM``, ``GPT2LMHeadModel``), safetensors
weights and a fast tokenizer (``tokenizer.json``) beside them.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, get_args

from app.core.variants import PRECISION_BYTES

CONFIG_FILE = "config.json"


def is_text_folder(folder: Path) -> bool:
    """True for a transformers model folder: ``config.json`` with ``architectures`` and no ``model_index.json``."""
    return not (folder / "model_index.json").is_file() and bool(architectures(folder))


def architectures(folder: Path) -> list[str]:
    """``config.json``'s ``architectures`` (empty when there is no readable config)."""
    try:
        found = json.loads((folder / CONFIG_FILE).read_text()).get("architectures") or []
    except (OSError, ValueError, AttributeError):
        return []
    return [str(name) for name in found] if isinstance(found, list) else []


def model_config(folder: Path) -> dict[str, Any]:
    """``config.json`` of a text model, re-read when its size or modification time changes.

    Raises:
        OSError: no readable config.json.
    """
    path = folder / CONFIG_FILE
    stat = path.stat()
    return dict(_config(path, stat.st_mtime_ns, stat.st_size))


@functools.lru_cache(maxsize=256)
def _config(path: Path, _mtime_ns: int, _size: int) -> Mapping[str, Any]:
    loaded = json.loads(path.read_text())
    return loaded if isinstance(loaded, dict) else {}


def max_positions(config: Mapping[str, Any]) -> int:
    """The most tokens (prompt + generated) the model's position embeddings take:
    ``max_position_embeddings`` (GPT-2: ``n_positions``); 2048 when the config names neither."""
    for name in ("max_position_embeddings", "n_positions", "n_ctx"):
        value = config.get(name)
        if isinstance(value, int) and value > 0:
            return value
    return 2048


def kv_bytes_per_token(config: Mapping[str, Any], precision: str = "fp32") -> int:
    """KV cache bytes one token takes: 2 (K and V) x layers x KV heads x head dim x bytes per
    value (the variant's precision, ``app/core/variants.py``). Llama/Qwen2 name
    ``num_hidden_layers``, ``num_key_value_heads`` (grouped-query attention; absent: all heads)
    and ``head_dim`` (absent: hidden size / heads); GPT-2 ``n_layer``, ``n_head``, ``n_embd``.
    0 when the config names no layers or heads."""
    layers = config.get("num_hidden_layers", config.get("n_layer", 0))
    heads = config.get("num_attention_heads", config.get("n_head", 0))
    hidden = config.get("hidden_size", config.get("n_embd", 0))
    if not (isinstance(layers, int) and isinstance(heads, int) and heads > 0 and isinstance(hidden, int)):
        return 0
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or hidden // heads
    return int(2 * layers * kv_heads * head_dim * PRECISION_BYTES.get(precision, 4.0))


def kv_cache_bytes(config: Mapping[str, Any], tokens: int, precision: str = "fp32") -> int:
    """KV cache bytes of ``tokens`` tokens (prompt + generated): :func:`kv_bytes_per_token` x tokens."""
    return kv_bytes_per_token(config, precision) * max(0, tokens)


def load_tokenizer(folder: Path) -> Any:
    """The model's own tokenizer (``AutoTokenizer``, local files only). Raises ``OSError``."""
    from transformers import AutoTokenizer  # lazy: transformers costs seconds to import

    return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)


ChatRole = Literal["system", "developer", "user", "assistant"]
CHAT_ROLES: tuple[str, ...] = get_args(ChatRole)
"""The roles a chat message may have: OpenAI's, less ``tool`` and ``function`` (no tool calls
here). ``developer`` is OpenAI's newer name of ``system``, and reaches the template as ``system``."""


class ChatTemplateBroken(ValueError):
    """The model's chat template does not compile (a Jinja syntax error): no chat can be
    templated until the model's files are fixed."""


def chat_prompt(tokenizer: Any, messages: Sequence[Mapping[str, str]]) -> str:
    """The prompt text of a chat: ``messages`` (``[{"role", "content"}]``, each role one of
    :data:`CHAT_ROLES`) through the model's chat template, with the assistant's turn opened
    (``add_generation_prompt``).

    Raises:
        ValueError: the tokenizer has no chat template (the model takes plain completions only),
            or the template refused these messages (its own ``raise_exception``, e.g. a template
            that takes no system message, or another error while rendering), quoting it.
        ChatTemplateBroken: the template does not compile (its line and Jinja's message).
    """
    import jinja2  # transformers renders chat templates with it (imported with the tokenizer already)

    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the model's tokenizer has no chat template; use /v1/completions with a plain prompt")
    turns = [{**m, "role": "system" if m["role"] == "developer" else m["role"]} for m in messages]
    try:
        text = tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
    except jinja2.TemplateSyntaxError as error:
        raise ChatTemplateBroken(
            f"the model's chat template does not compile (line {error.lineno}: {error.message})"
        ) from error
    except (jinja2.TemplateError, TypeError, KeyError, IndexError) as error:
        raise ValueError(f"the model's chat template refused these messages: {error}") from error
    return str(text)


def prompt_ids(tokenizer: Any, prompt: str, chat: bool = False) -> list[int]:
    """The token ids fed to the model for ``prompt``: a chat-templated prompt (``chat``) holds
    its own special tokens already, a plain one gets the tokenizer's (e.g. Llama's BOS)."""
    return list(tokenizer(prompt, add_special_tokens=not chat)["input_ids"])


def end_token_ids(tokenizer: Any, generation_config: Any = None) -> list[int]:
    """The ids that end a model's turn: the tokenizer's EOS, then each id of the model folder's
    ``generation_config.json`` ``eos_token_id`` (an int or a list; absent: none), without repeats.
    An instruct model may end its turn on an id only that list names (Llama 3's ``<|eot_id|>``,
    its tokenizer's EOS being ``<|end_of_text|>``): generation stops at any of them, and a
    constrained decoding's mask allows all of them once the constraint is complete
    (docs/api.md, "OpenAI and Hugging Face routes")."""
    listed = getattr(generation_config, "eos_token_id", None)
    ids = [tokenizer.eos_token_id, *(listed if isinstance(listed, (list, tuple)) else [listed])]
    return list(dict.fromkeys(int(token) for token in ids if token is not None))


def folder_end_token_ids(folder: Path, tokenizer: Any) -> list[int]:
    """:func:`end_token_ids` of a transformers model folder: its tokenizer's EOS and its
    ``generation_config.json``'s ``eos_token_id`` (a folder without the file: the EOS alone).

    Raises:
        OSError, ValueError: ``generation_config.json`` cannot be read.
    """
    if not (folder / "generation_config.json").is_file():
        return end_token_ids(tokenizer)
    from transformers import GenerationConfig  # lazy: transformers costs seconds to import

    return end_token_ids(tokenizer, GenerationConfig.from_pretrained(str(folder), local_files_only=True))


def visible_ids(ids: Sequence[int], ends: Collection[int]) -> list[int]:
    """``ids`` less the end ids (:func:`end_token_ids`): an end id that the tokenizer does not
    count as special (a ``generation_config.json`` id of an ordinary token) ends the turn and
    adds no text, as a special one decodes to nothing."""
    return [int(token) for token in ids if int(token) not in ends]


class TokenDecoder:
    """Each generated token's share of the decoded text, as the tokens arrive (TGI's stream
    names every token's text): joined, the shares are ``tokenizer.decode(ids,
    skip_special_tokens=True)`` (special tokens decode to nothing). A token that ends inside a
    UTF-8 character (byte-level BPE) gets the empty string; the token completing it gets the
    character. ``sent``: the text given out so far. With ``stops`` (a job's ``stop``
    sequences) no text past one is given out: shares end before the first. ``hold`` (a stream,
    whose later tokens are not known yet): an ending that could still grow into one waits for
    the next token (:func:`safe_to_send`); without it (an ended job's tokens, TGI's ``details``)
    each token gets its own share (docs/api.md, "OpenAI and Hugging Face routes"). ``ends``: the
    model's end ids (:func:`end_token_ids`), which add no text and count as special."""

    def __init__(
        self, tokenizer: Any, stops: Sequence[str] = (), hold: bool = True, ends: Collection[int] = ()
    ) -> None:
        self.tokenizer = tokenizer
        self.stops = list(stops)
        self.hold = hold
        self.ids: list[int] = []
        self.sent = ""
        self.ends = {int(t) for t in ends}
        self._special = {int(t) for t in getattr(tokenizer, "all_special_ids", ()) or ()} | self.ends

    def add(self, token: int, last: bool = False) -> str:
        """The text ``token`` adds (decodes the whole sequence: O(tokens) a call); the ``last``
        token gets any unfinished character too (as U+FFFD, as the whole text decodes)."""
        self.ids.append(int(token))
        whole = str(self.tokenizer.decode(visible_ids(self.ids, self.ends), skip_special_tokens=True))
        whole = whole if last else whole.rstrip("\ufffd")
        if self.stops:
            whole = safe_to_send(whole, self.stops) if self.hold and not last else cut_at_stop(whole, self.stops)[0]
        if not whole.startswith(self.sent):  # a decoding whose prefix is not a prefix (cleaned-up spaces)
            return ""
        piece, self.sent = whole[len(self.sent) :], whole
        return piece

    def special(self, token: int) -> bool:
        """Whether ``token`` is one of the tokenizer's special tokens (EOS, chat markers…)."""
        return int(token) in self._special


CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
"""The reason of a text job refused for its tokens: a prompt over ``max_input_tokens``, or a
prompt + ``max_new_tokens`` over ``max_total_tokens`` (app/jobs/validation.py
``check_text_tokens``); OpenAI's error code for the same refusal, on which client libraries
(context-window fallbacks) act."""
MAX_STOP_SEQUENCES = 4
"""A text job's ``stop`` sequences at most (OpenAI's limit)."""
MAX_STOP_CHARS = 256
"""Characters of one stop sequence at most."""


def stop_sequences(value: Any) -> list[str]:
    """A text job's ``stop`` param as a list: a string or a list of 1 to
    :data:`MAX_STOP_SEQUENCES` non-empty strings of at most :data:`MAX_STOP_CHARS` characters;
    None or an empty list: none.

    Raises:
        ValueError: anything else, naming the limit.
    """
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or len(stops) > MAX_STOP_SEQUENCES:
        raise ValueError(f"must be a string or a list of at most {MAX_STOP_SEQUENCES} strings, got {str(value)[:80]!r}")
    for stop in stops:
        if not isinstance(stop, str) or not 1 <= len(stop) <= MAX_STOP_CHARS:
            raise ValueError(
                f"each sequence must be a string of 1 to {MAX_STOP_CHARS} characters, got {str(stop)[:80]!r}"
            )
    return list(stops)


def cut_at_stop(text: str, stops: Sequence[str]) -> tuple[str, str | None]:
    """``text`` cut before the earliest stop sequence in it, and that sequence (None: no stop
    sequence in ``text``, which is returned whole). The worker ends generation there; the
    streaming routes send no text past it."""
    found = [(text.find(stop), stop) for stop in stops if stop in text]
    if not found:
        return text, None
    at, stop = min(found)
    return text[:at], stop


def safe_to_send(text: str, stops: Sequence[str]) -> str:
    """The part of a growing ``text`` a stream may send now: cut before a stop sequence it
    holds, else without its longest ending that could still grow into one (``"ab\\n"`` with stop
    ``"\\n\\n"`` sends ``"ab"``)."""
    text, stop = cut_at_stop(text, stops)
    if stop is not None:
        return text
    held = max((n for s in stops for n in range(1, min(len(s), len(text) + 1)) if text.endswith(s[:n])), default=0)
    return text[: len(text) - held]
