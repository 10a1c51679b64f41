"""text: a causal language model continues a prompt (``AutoModelForCausalLM.generate``).

Params (``app/core/kinds.py``): ``prompt`` (required: the text fed to the model; for a chat
request the server has already applied the model's chat template, ``chat`` true), ``max_new_tokens``,
``temperature`` (0, or any below ``GREEDY_TEMPERATURE``: greedy decoding; above: sampling seeded with
``seed``), ``top_p``, ``seed``,
``stop`` (sequences: generation ends once the decoded text holds one, and the text is cut
before the first, ``finish_reason`` ``stop`` with ``usage.stop_sequence``),
``grammar`` (a JSON schema or a regex the output must match, ``app/core/constraints.py``: each
step's logits outside llguidance's allowed-token mask are set to -inf, so the model can only
write text the constraint accepts, then end on any of its end ids; the compiled matcher is cached
per tokenizer, end ids and constraint).
The server checked the prompt's tokens against the model's ``max_input_tokens`` and
``max_total_tokens`` with the same tokenization (``app/core/textgen.py``).

Output: the generated text (UTF-8, ``text/plain``; special tokens dropped). The journaled
record gets ``usage``: ``prompt_tokens``, ``completion_tokens``, ``total_tokens`` and
``finish_reason`` (``stop``: the model ended its turn, on any of :func:`app.core.textgen.end_token_ids`:
the tokenizer's EOS or an id of the folder's ``generation_config.json`` ``eos_token_id``;
``length``: ``max_new_tokens`` reached),
``tokens`` (the generated ids) and ``logprobs`` (each one's natural-log probability).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from app.core import constraints
from app.core.kinds import family_kind_spec as kind_spec
from app.core.kinds import greedy
from app.core.textgen import cut_at_stop, end_token_ids, prompt_ids, stop_sequences, visible_ids
from tasks.kinds import Output, ProgressFn

KIND = "text"
MEDIA_TYPE = "text/plain"


def run(
    pipeline: Any,
    params: Mapping[str, Any],
    progress: ProgressFn,
    provenance: dict[str, Any],
    inputs: Mapping[str, bytes],
    family: str = "",
) -> Output:
    import torch
    from transformers import LogitsProcessorList, StoppingCriteria, StoppingCriteriaList

    args = kind_spec(family, KIND).args(params)
    model, tokenizer = pipeline.model, pipeline.tokenizer
    ids = prompt_ids(tokenizer, str(args["prompt"]), bool(args["chat"]))
    limit = int(args["max_new_tokens"])
    stops = stop_sequences(args["stop"])
    device = next(model.parameters()).device
    input_ids = torch.tensor([ids], dtype=torch.long, device=device)
    ends = end_token_ids(tokenizer, model.generation_config)  # the tokenizer's EOS and generation_config's

    matcher = None
    vocab = constraints.vocab_size(tokenizer, getattr(model.config, "vocab_size", None))
    if args["grammar"] is not None:
        matcher = constraints.matcher(args["grammar"], tokenizer, vocab, tuple(ends))
    steps = Steps(len(ids), vocab, matcher)
    logprobs: list[float] = []

    class Progress(StoppingCriteria):
        """Reports (tokens generated, max_new_tokens), the text, the ids and each one's log
        probability (:class:`Steps`) after every new token; stops once the text holds a
        ``stop`` sequence."""

        def __call__(self, sequence: Any, scores: Any, **kwargs: Any) -> Any:
            new = sequence[0, len(ids) :].tolist()
            if len(logprobs) < len(new):
                logprobs.append(steps.logprob(new[-1]))
            text = tokenizer.decode(visible_ids(new, ends), skip_special_tokens=True)
            progress(len(new), limit, text=text, tokens=new, logprobs=list(logprobs))
            stopped = bool(stops) and cut_at_stop(text, stops)[1] is not None
            return torch.full((sequence.shape[0],), stopped, dtype=torch.bool, device=sequence.device)

    temperature = float(args["temperature"])
    sampling: dict[str, Any] = {"do_sample": not greedy(temperature)}  # 5e-324 would divide logits to inf
    if not greedy(temperature):
        sampling.update(temperature=temperature, top_p=float(args["top_p"]))
    else:  # greedy: unset the model's own sampling defaults (generation_config.json) explicitly
        sampling.update(temperature=None, top_p=None, top_k=None)
    with torch.random.fork_rng(devices=[]), torch.inference_mode():
        torch.manual_seed(int(args["seed"]))
        out = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=limit,
            min_new_tokens=0,
            eos_token_id=ends or None,
            pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else next(iter(ends), None),
            stopping_criteria=StoppingCriteriaList([Progress()]),
            logits_processor=LogitsProcessorList([steps]),
            **sampling,
        )
    new = [int(t) for t in out[0, len(ids) :]]
    ended = bool(new) and new[-1] in ends
    text, stop = cut_at_stop(tokenizer.decode(visible_ids(new, ends), skip_special_tokens=True), stops)
    usage = {
        "prompt_tokens": len(ids),
        "completion_tokens": len(new),
        "total_tokens": len(ids) + len(new),
        "finish_reason": "stop" if ended or stop is not None or len(new) < limit else "length",
    }
    if stop is not None:
        usage["stop_sequence"] = stop
    return Output(
        data=text.encode("utf-8"),
        media_type=MEDIA_TYPE,
        record={"usage": usage, "tokens": new, "logprobs": logprobs[: len(new)]},
    )


class Steps:
    """A transformers logits processor on batch row 0, called once per new token: with a
    compiled llguidance ``matcher`` (a ``grammar``), it feeds the matcher each token generated
    since its last call, then sets every logit the matcher's mask forbids to -inf (once the
    constraint is complete the mask allows only the end ids); it keeps the step's log-softmax, so
    :meth:`logprob` gives the chosen token's log probability (after the mask, before any
    temperature).

    Raises (when called):
        RuntimeError: the matcher refused a token (cannot happen for a token it allowed).
    """

    def __init__(self, prompt_tokens: int, vocab: int, matcher: Any = None) -> None:
        self.matcher = matcher
        self.start = prompt_tokens
        self.consumed = 0
        self.last: Any = None
        if matcher is not None:
            from llguidance.torch import allocate_token_bitmask

            self.bitmask = allocate_token_bitmask(1, vocab)

    def logprob(self, token: int) -> float:
        """The natural-log probability the last step gave ``token`` (0.0 before any step)."""
        return 0.0 if self.last is None else round(float(self.last[token]), 6)

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        import torch

        if self.matcher is not None:
            scores = self._masked(input_ids, scores)
        self.last = torch.log_softmax(scores[0].float(), dim=-1).cpu()
        return scores

    def _masked(self, input_ids: Any, scores: Any) -> Any:
        import torch
        from llguidance.torch import fill_next_token_bitmask

        new = input_ids[0, self.start :].tolist()
        for token in new[self.consumed :]:
            self.matcher.consume_token(int(token))
        self.consumed = len(new)
        if self.matcher.is_error():
            raise RuntimeError(f"the output constraint failed: {self.matcher.get_error()}")
        fill_next_token_bitmask(self.matcher, self.bitmask)
        # llguidance.torch's apply_token_bitmask_inplace, without its torch.compile (a C++
        # toolchain and seconds of compiling on a CPU worker for a mask of one row)
        bits = (self.bitmask[0].unsqueeze(1) >> torch.arange(32, dtype=torch.int32)) & 1
        allowed = bits.flatten()[: scores.shape[-1]].to(device=scores.device, dtype=torch.bool)
        if allowed.shape[0] < scores.shape[-1]:  # logits wider than the mask: the extra columns are forbidden
            allowed = torch.nn.functional.pad(allowed, (0, scores.shape[-1] - allowed.shape[0]), value=False)
        return scores.masked_fill(~allowed, float("-inf"))
