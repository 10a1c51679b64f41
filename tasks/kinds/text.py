"""text: a causal language model continues a prompt (issue 20; ``AutoModelForCausalLM.generate``).

Params (``app/core/kinds.py``): ``prompt`` (required: the text fed to the model; for a chat
request the server has already applied the model's chat template, ``chat`` true), ``max_new_tokens``,
``temperature`` (0: greedy decoding; above 0: sampling seeded with ``seed``), ``top_p``, ``seed``.
The server checked the prompt's tokens against the model's ``max_input_tokens`` and
``max_total_tokens`` with the same tokenization (``app/core/textgen.py``).

Output: the generated text (UTF-8, ``text/plain``; special tokens dropped). The journaled
record gets ``usage``: ``prompt_tokens``, ``completion_tokens``, ``total_tokens`` and
``finish_reason`` (``stop``: the model ended its turn; ``length``: ``max_new_tokens`` reached).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from app.core.kinds import family_kind_spec as kind_spec
from app.core.textgen import prompt_ids
from tasks.kinds import Output, ProgressFn

KIND = "text"
MEDIA_TYPE = "text/plain"


def run(pipeline: Any, params: Mapping[str, Any], progress: ProgressFn, provenance: dict[str, Any],
        inputs: Mapping[str, bytes], family: str = "") -> Output:
    import torch
    from transformers import StoppingCriteria, StoppingCriteriaList

    args = kind_spec(family, KIND).args(params)
    model, tokenizer = pipeline.model, pipeline.tokenizer
    ids = prompt_ids(tokenizer, str(args["prompt"]), bool(args["chat"]))
    limit = int(args["max_new_tokens"])
    device = next(model.parameters()).device
    input_ids = torch.tensor([ids], dtype=torch.long, device=device)

    class Progress(StoppingCriteria):
        """Reports (tokens generated, max_new_tokens) after every new token; never stops."""

        def __call__(self, sequence: Any, scores: Any, **kwargs: Any) -> Any:
            new = sequence[0, len(ids):].tolist()
            progress(len(new), limit, text=tokenizer.decode(new, skip_special_tokens=True))
            return torch.zeros(sequence.shape[0], dtype=torch.bool, device=sequence.device)

    temperature = float(args["temperature"])
    sampling: dict[str, Any] = {"do_sample": temperature > 0}
    if temperature > 0:
        sampling.update(temperature=temperature, top_p=float(args["top_p"]))
    else:  # greedy: unset the model's own sampling defaults (generation_config.json) explicitly
        sampling.update(temperature=None, top_p=None, top_k=None)
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else model.generation_config.eos_token_id
    with torch.random.fork_rng(devices=[]), torch.inference_mode():
        torch.manual_seed(int(args["seed"]))
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=limit,
                             min_new_tokens=0, eos_token_id=eos, pad_token_id=tokenizer.pad_token_id or eos,
                             stopping_criteria=StoppingCriteriaList([Progress()]), **sampling)
    new = [int(t) for t in out[0, len(ids):]]
    ended = bool(new) and eos is not None and new[-1] == eos
    text = tokenizer.decode(new, skip_special_tokens=True)
    usage = {"prompt_tokens": len(ids), "completion_tokens": len(new), "total_tokens": len(ids) + len(new),
             "finish_reason": "stop" if ended or len(new) < limit else "length"}
    return Output(data=text.encode("utf-8"), media_type=MEDIA_TYPE, record={"usage": usage})
