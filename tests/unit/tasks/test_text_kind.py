"""The ``text`` kind: tiny causal LMs of each architecture, built offline, registered
by their ``config.json``, loaded with transformers from local files, run one prompt each."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from app.core.errors import Rejected
from app.core.kinds import KINDS
from app.core.textgen import chat_prompt, prompt_ids
from app.devtools.tiny_text import TEXT_FAMILIES
from app.store.registry import describe_pipeline
from tasks.kinds import runner
from tasks.pipelines import TextModel, load_pipeline

CLASSES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "gpt2": "GPT2LMHeadModel"}


def folder_of(tiny_text_dir: Path, family: str) -> Path:
    return tiny_text_dir / f"tiny-{family}"


@pytest.mark.parametrize("family", TEXT_FAMILIES)
def test_a_tiny_text_model_is_described_by_its_config_architectures(family: str, tiny_text_dir: Path) -> None:
    assert describe_pipeline(folder_of(tiny_text_dir, family)) == (CLASSES[family], family, ("text",))


def test_a_folder_with_an_unknown_architecture_is_refused_naming_it(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"architectures": ["BertForMaskedLM"]}')
    with pytest.raises(Rejected, match="BertForMaskedLM") as refused:
        describe_pipeline(tmp_path)
    assert refused.value.reason == "unknown_pipeline"


@pytest.mark.parametrize("family", TEXT_FAMILIES)
def test_the_runner_generates_exactly_max_new_tokens_and_reports_each(family: str, tiny_text_dir: Path) -> None:
    """Greedy decoding on random weights: the same prompt and seed give the same text; the
    journaled usage counts the prompt's tokens as the server does (prompt_ids) and the new ones;
    progress is reported per new token; the output is UTF-8 text."""
    model = load_pipeline(folder_of(tiny_text_dir, family))
    assert isinstance(model, TextModel)
    steps: list[tuple[int, int]] = []
    texts: list[str] = []
    params: dict[str, Any] = {"prompt": "hello wörld", "seed": 3, "max_new_tokens": 6}
    out = runner("text")(
        model,
        params,
        lambda step, total, text, **_: steps.append((step, total)) or texts.append(text),
        {},
        {},
        family=family,
    )
    again = runner("text")(model, params, lambda *_, **__: None, {}, {}, family=family)
    usage = out.record["usage"]
    assert out.media_type == "text/plain" and out.data == again.data
    out.data.decode("utf-8")
    assert usage["prompt_tokens"] == len(prompt_ids(model.tokenizer, "hello wörld")) == len("hello wörld".encode())
    assert (
        usage["completion_tokens"] <= 6 and usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    )
    assert usage["finish_reason"] in ("stop", "length")
    assert steps[-1] == (usage["completion_tokens"], 6) and [s for s, _ in steps] == list(range(1, len(steps) + 1))
    assert texts[-1] == out.data.decode("utf-8")  # the text so far, with each token's report (streaming)
    assert all(out.data.decode("utf-8").startswith(t.rstrip("\ufffd")) for t in texts)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_a_chat_prompt_is_templated_and_counted_without_extra_special_tokens(family: str, tiny_text_dir: Path) -> None:
    model = load_pipeline(folder_of(tiny_text_dir, family))
    text = chat_prompt(model.tokenizer, [{"role": "user", "content": "hi"}])
    assert "hi" in text and text != "hi"
    ids = prompt_ids(model.tokenizer, text, chat=True)
    out = runner("text")(
        model,
        {"prompt": text, "chat": True, "seed": 1, "max_new_tokens": 2},
        lambda *_, **__: None,
        {},
        {},
        family=family,
    )
    assert out.record["usage"]["prompt_tokens"] == len(ids)


def test_gpt2_has_no_chat_template_so_a_chat_is_refused(tiny_text_dir: Path) -> None:
    model = load_pipeline(folder_of(tiny_text_dir, "gpt2"))
    with pytest.raises(ValueError, match="no chat template"):
        chat_prompt(model.tokenizer, [{"role": "user", "content": "hi"}])


def test_sampling_reads_every_param_of_the_text_spec(tiny_text_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The rule for every kind (app/core/families.py): a runner reads exactly the params its spec lists."""
    spec = KINDS["text"]
    seen: list[Any] = []
    real = type(spec).args
    monkeypatch.setattr(type(spec), "args", lambda self, params: seen.append(real(self, params)) or seen[-1])
    model = load_pipeline(folder_of(tiny_text_dir, "llama"))
    a = runner("text")(
        model,
        {"prompt": "x", "seed": 1, "temperature": 1.0, "max_new_tokens": 8},
        lambda *_, **__: None,
        {},
        {},
        family="llama",
    )
    b = runner("text")(
        model,
        {"prompt": "x", "seed": 1, "temperature": 1.0, "max_new_tokens": 8},
        lambda *_, **__: None,
        {},
        {},
        family="llama",
    )
    assert a.data == b.data  # seeded sampling
    assert seen[0].read == set(spec.params)


def test_a_temperature_below_the_greedy_bound_decodes_greedily_on_the_worker(tiny_text_dir: Path) -> None:
    """R22: temperature 5e-324 divides the logits to inf (``probability tensor contains inf``);
    below GREEDY_TEMPERATURE the runner decodes greedily, whatever the job's seed, as at 0."""
    model = load_pipeline(folder_of(tiny_text_dir, "llama"))

    def text(temperature: float, seed: int) -> bytes:
        params = {"prompt": "x", "seed": seed, "temperature": temperature, "max_new_tokens": 8}
        return runner("text")(model, params, lambda *_, **__: None, {}, {}, family="llama").data

    assert text(5e-324, 1) == text(5e-324, 2) == text(0.0, 3)


SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name", "age", "ok", "tag"],
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "ok": {"type": "boolean"},
        "tag": {"enum": ["red", "green", "blue"]},
    },
}
REGEX = r"[a-z]{3,8}-[0-9]{2}"


@pytest.mark.parametrize("family", TEXT_FAMILIES)
def test_a_grammar_makes_even_random_weights_write_valid_output(family: str, tiny_text_dir: Path) -> None:
    """The constraint is enforced while decoding (llguidance's mask): sampled output of a
    random-weight model parses and validates against the schema, greedy output fullmatches the
    regex; each ends with EOS (finish ``stop``) well within max_new_tokens. The compiled matcher is
    cached per (tokenizer, constraint): a second job with the same schema compiles nothing."""
    import json
    import re

    import jsonschema

    from app.core import constraints

    model = load_pipeline(folder_of(tiny_text_dir, family))
    ids_seen: list[list[int]] = []
    params = {
        "prompt": "go",
        "seed": 5,
        "max_new_tokens": 200,
        "temperature": 1.0,
        "grammar": {"type": "json", "value": SCHEMA},
    }
    out = runner("text")(model, params, lambda *_, tokens, **__: ids_seen.append(tokens), {}, {}, family=family)
    jsonschema.validate(json.loads(out.data.decode("utf-8")), SCHEMA)
    assert out.record["usage"]["finish_reason"] == "stop" and out.record["tokens"][-1] == model.tokenizer.eos_token_id
    assert ids_seen[-1] == out.record["tokens"] and len(out.record["logprobs"]) == len(out.record["tokens"])
    regex = runner("text")(
        model,
        {**params, "temperature": 0.0, "grammar": {"type": "regex", "value": REGEX}},
        lambda *_, **__: None,
        {},
        {},
        family=family,
    )
    assert re.fullmatch(REGEX, regex.data.decode("utf-8")), regex.data
    before = constraints.compile_cache_info()
    runner("text")(
        model,
        {"prompt": "x", "seed": 1, "max_new_tokens": 200, "grammar": {"type": "json", "value": SCHEMA}},
        lambda *_, **__: None,
        {},
        {},
        family=family,
    )
    after = constraints.compile_cache_info()
    assert after.hits == before.hits + 1 and after.misses == before.misses


def test_a_constraint_that_does_not_compile_is_refused_with_llguidances_message(tiny_text_dir: Path) -> None:
    from app.core import constraints

    tokenizer = load_pipeline(folder_of(tiny_text_dir, "gpt2")).tokenizer
    with pytest.raises(ValueError, match="does not compile"):
        constraints.check({"type": "regex", "value": "(unclosed"}, tokenizer, len(tokenizer))
    with pytest.raises(ValueError, match="does not compile"):
        constraints.check({"type": "json", "value": {"type": "nonsense"}}, tokenizer, len(tokenizer))
    with pytest.raises(ValueError, match="type must be one of json, regex"):
        constraints.grammar_of({"type": "lark", "value": "start: x"})
    assert constraints.from_response_format({"type": "json_object"}) == {"type": "json", "value": {"type": "object"}}
    assert constraints.from_response_format({"type": "text"}) is None


FORMAT_SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}}


@pytest.mark.parametrize(
    "response_format",
    [
        {"type": "json_schema", "json_schema": {"name": "n", "schema": FORMAT_SCHEMA, "strict": True}},  # OpenAI
        {"type": "json_object", "value": FORMAT_SCHEMA},  # huggingface_hub's rewrite of OpenAI's json_schema
        {"type": "json", "value": FORMAT_SCHEMA},  # TGI
        {"type": "json", "value": '{"type": "object", "properties": {"n": {"type": "integer"}}}'},  # its JSON text
        {"type": "json_schema", "value": {"name": "n", "schema": FORMAT_SCHEMA}},  # TGI's json_schema grammar
        {"type": "json_schema", "schema": FORMAT_SCHEMA},  # flattened
    ],
)
def test_every_response_format_the_clients_send_keeps_its_schema(response_format: dict[str, object]) -> None:
    from app.core import constraints

    assert constraints.from_response_format(response_format) == {"type": "json", "value": FORMAT_SCHEMA}


@pytest.mark.parametrize(
    ("response_format", "field"),
    [
        ({"type": "xml"}, ".type"),
        ({"type": "json_object", "schema": FORMAT_SCHEMA}, ".schema"),  # not json_object's: never dropped
        ({"type": "json"}, ".value"),
        ({"type": "json", "value": 3}, ".value"),
        ({"type": "json_schema", "json_schema": {"name": "n"}}, ".json_schema"),
        (
            {"type": "json_schema", "json_schema": {"name": "n", "schema": FORMAT_SCHEMA, "format": "x"}},
            ".json_schema.format",
        ),
        # each key of OpenAI's json_schema object has the type the API description states (the fuzz
        # sent a description that was an object: accepted, ST201)
        (
            {"type": "json_schema", "json_schema": {"name": "n", "schema": FORMAT_SCHEMA, "description": {}}},
            ".json_schema.description",
        ),
        ({"type": "json_schema", "json_schema": {"name": 3, "schema": FORMAT_SCHEMA}}, ".json_schema.name"),
        (
            {"type": "json_schema", "json_schema": {"name": "n", "schema": FORMAT_SCHEMA, "strict": "yes"}},
            ".json_schema.strict",
        ),
        ({"type": "regex", "value": ""}, ".value"),
        ({"type": "text", "value": FORMAT_SCHEMA}, ".value"),
        ({"type": {"json_schema": {}}}, ".type"),  # an unhashable type (the fuzz found it answered 500)
        ({"type": ["text"]}, ".type"),
    ],
)
def test_a_response_format_that_cannot_be_honoured_is_refused_naming_its_field(
    response_format: dict[str, object], field: str
) -> None:
    from app.core import constraints

    with pytest.raises(constraints.FormatRefused) as refused:
        constraints.from_response_format(response_format)
    assert refused.value.field == field
    regex = {"type": "regex", "value": "[a-z]+"}
    assert constraints.from_response_format(regex) == regex
    assert constraints.from_tgi_grammar({"type": "json_schema", "value": {"name": "n", "schema": FORMAT_SCHEMA}}) == {
        "type": "json",
        "value": FORMAT_SCHEMA,
    }


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_an_int8_text_variant_loads_quantized_runs_and_is_priced_by_its_linear_weights(
    family: str, tiny_text_dir: Path
) -> None:
    """torchao int8 weight-only through transformers' TorchAoConfig, at load time: its
    linear layers' weights are quantized (not the embeddings or norms), the price is what the
    loaded model holds (app/core/pricing.py; every family and variant:
    tests/integration/fleet/test_family_memory.py), and the quantized model still generates."""
    from app.core.pricing import loaded_bytes
    from app.core.variants import Variant
    from tests.helpers import held_bytes

    folder = folder_of(tiny_text_dir, family)
    model = load_pipeline(folder, "fp32", "torchao-int8wo")
    assert isinstance(model, TextModel)
    quantized = [name for name, p in model.model.named_parameters() if "Int8" in type(p).__name__]
    assert quantized and not any("embed" in name or "norm" in name for name in quantized)
    assert loaded_bytes(folder, Variant("fp32", "torchao-int8wo")) == held_bytes(model)[""]
    params = {"prompt": "hello", "seed": 3, "max_new_tokens": 4}
    steps: list[int] = []
    out = runner("text")(model, params, lambda step, *_, **__: steps.append(step), {}, {}, family=family)
    again = runner("text")(model, params, lambda *_, **__: None, {}, {}, family=family)
    assert out.data == again.data  # same seed, same text
    out.data.decode("utf-8")  # UTF-8 text
    assert steps and steps == list(range(1, out.record["usage"]["completion_tokens"] + 1))  # a report per new token
    assert out.record["usage"]["prompt_tokens"] == len(b"hello")


def test_gpt2_cannot_be_registered_quantized_its_conv1d_layers_stay_as_they_are(
    tiny_text_dir: Path, tmp_path: Path
) -> None:
    from app.context import build_context
    from app.core.config import Settings
    from tests.helpers import make_fleet

    ctx = build_context(Settings(data_dir=tmp_path, redis_url="redis://127.0.0.1:1/0"), make_fleet("m1"), migrate=True)
    try:
        with pytest.raises(Rejected) as refused:
            ctx.registry.add(folder_of(tiny_text_dir, "gpt2"), model_id="tiny-gpt2-int8", quantization="torchao-int8wo")
        assert refused.value.reason == "invalid_variant" and "Conv1D" in refused.value.message
        assert ctx.registry.add(folder_of(tiny_text_dir, "gpt2"), model_id="tiny-gpt2").quantization is None
    finally:
        ctx.close()


def llama3_style_copy(tiny_text_dir: Path, to: Path) -> tuple[Path, int, int]:
    """A user's copy of tiny-llama set up as Llama-3-8B-Instruct's folder is: the tokenizer's EOS
    is ``<|end_of_text|>``, and ``generation_config.json``'s ``eos_token_id`` lists it and
    ``<|eot_id|>``, the id an instruct model ends its turn on. Its weights are edited (safetensors)
    so that greedy decoding writes ``<|eot_id|>`` first: the layers' output projections are zeroed
    (each position's hidden state is its own token's embedding), every embedding row gets 1.0 in
    dimension 0, and ``<|eot_id|>``'s row (the tied ``lm_head``) is 10.0 there and 0 elsewhere, so
    its logit is about ten times any other. Returns (folder, ``<|end_of_text|>``'s id, ``<|eot_id|>``'s id)."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    folder = to / "llama3-instruct"
    shutil.copytree(folder_of(tiny_text_dir, "llama"), folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["eos_token"] = "<|end_of_text|>"
    config.pop("pad_token", None)  # Llama 3 has none
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer = load_pipeline(folder_of(tiny_text_dir, "llama")).tokenizer
    end_of_text, eot = tokenizer.convert_tokens_to_ids(["<|end_of_text|>", "<|eot_id|>"])
    generation = json.loads((folder / "generation_config.json").read_text())
    generation.update(eos_token_id=[end_of_text, eot], pad_token_id=None)
    (folder / "generation_config.json").write_text(json.dumps(generation))
    weights = load_file(str(folder / "model.safetensors"))
    for name, tensor in weights.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            tensor.zero_()
    embeddings = weights["model.embed_tokens.weight"]
    embeddings[:, 0] = 1.0
    embeddings[eot] = 0.0
    embeddings[eot, 0] = 10.0
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder, end_of_text, eot


def test_generation_ends_on_any_eos_id_of_generation_config_not_only_the_tokenizers(
    tiny_text_dir: Path, tmp_path: Path
) -> None:
    """An instruct model ends its turn on an id that only its ``generation_config.json`` lists
    (Llama 3's ``<|eot_id|>``, the tokenizer's EOS being ``<|end_of_text|>``): generation stops
    after it, finish ``stop``, with no end token in the text (docs/api.md, "OpenAI and Hugging Face routes");
    streamed progress stops there too. With a grammar, the mask allows every end id once the
    constraint is complete: the model ends on its own ``<|eot_id|>``."""
    folder, end_of_text, eot = llama3_style_copy(tiny_text_dir, tmp_path)
    model = load_pipeline(folder)
    assert model.tokenizer.eos_token_id == end_of_text != eot
    reports: list[list[int]] = []
    params: dict[str, Any] = {"prompt": "hello", "seed": 1, "max_new_tokens": 8}
    out = runner("text")(model, params, lambda *_, tokens, **__: reports.append(tokens), {}, {}, family="llama")
    usage = out.record["usage"]
    assert out.record["tokens"] == [eot] and reports[-1] == [eot], out.record["tokens"]
    assert (usage["finish_reason"], usage["completion_tokens"], out.data) == ("stop", 1, b"")
    constrained = runner("text")(
        model,
        {**params, "grammar": {"type": "regex", "value": "ab"}},
        lambda *_, **__: None,
        {},
        {},
        family="llama",
    )
    assert constrained.data == b"ab" and constrained.record["tokens"][-1] == eot, constrained.record["tokens"]
    assert constrained.record["usage"]["finish_reason"] == "stop"


def test_an_end_id_the_tokenizer_does_not_count_special_ends_the_turn_without_its_text(
    tiny_text_dir: Path, tmp_path: Path
) -> None:
    """A ``generation_config.json`` end id whose token the tokenizer does not mark special (a
    converted tokenizer that lost the flag) ends the turn and adds no text, as a special one
    decodes to nothing: the answer is empty, not ``<|eot_id|>``, and the server's decoder (the
    token texts of logprobs and TGI's details) gives the token no text and counts it special."""
    import json

    from app.jobs.validation import PromptTokenizers

    folder, _, eot = llama3_style_copy(tiny_text_dir, tmp_path)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["extra_special_tokens"].remove("<|eot_id|>")
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer_json = json.loads((folder / "tokenizer.json").read_text())
    for added in tokenizer_json["added_tokens"]:
        if added["content"] == "<|eot_id|>":
            added["special"] = False
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer_json))
    model = load_pipeline(folder)
    assert eot not in model.tokenizer.all_special_ids
    assert model.tokenizer.decode([eot], skip_special_tokens=True) == "<|eot_id|>"  # what the answer was

    texts: list[str] = []
    params: dict[str, Any] = {"prompt": "hello", "seed": 1, "max_new_tokens": 8}
    out = runner("text")(model, params, lambda *_, text, **__: texts.append(text), {}, {}, family="llama")
    assert out.record["tokens"] == [eot] and out.record["usage"]["finish_reason"] == "stop"
    assert (out.data, texts) == (b"", [""])

    decoder = PromptTokenizers(lambda _: folder).decoder("llama3", hold=False)
    assert decoder is not None
    assert (decoder.add(eot, last=True), decoder.special(eot)) == ("", True)
