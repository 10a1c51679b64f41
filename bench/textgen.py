"""Text generation throughput of each tiny architecture on this machine: new tokens
per second of the ``text`` kind's runner (``tasks/kinds/text.py``, what a worker runs), free
and constrained by a regex (llguidance's mask at every step).

    .venv/bin/python bench/textgen.py [--tokens 128] [--repeats 5] [--threads N]

It builds the tiny random-weight models offline (``app/devtools/tiny_text.py``: 2 layers,
hidden size 32, byte-level vocabulary of ~260) in a temporary folder, loads each as a worker
does (``tasks.pipelines.load_pipeline``), warms it up with one short job, then times
``--repeats`` jobs of ``--tokens`` new tokens each (greedy; the prompt is 16 bytes):

- ``free``: no constraint (``min_new_tokens`` is 0, so a model that emits EOS early would
  count fewer tokens: the figure divides the tokens really generated);
- ``regex``: ``grammar = [a-z ]{N}`` with N = ``--tokens`` - 1, so the run is exactly N letters
  then EOS (N + 1 tokens), each step masked; the matcher was compiled by the warm-up (cached).

One line per (architecture, mode): ``arch mode tokens=T median_s=S tok_s=R`` (R = T / S, the
median over repeats; per-token progress reports are no-ops here, so no HTTP in the figure), then
a last line ``tok_s llama=R qwen2=R gpt2=R`` (free decoding). These are tiny models: the figure
is per-token overhead (transformers' generate loop, the KV cache, the logits processor), not
model compute.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

PROMPT = "benchmark prompt"  # 16 bytes: 16 tokens with the tiny byte-level tokenizers (Llama adds BOS)


def timed(model: Any, family: str, params: dict[str, Any], repeats: int) -> tuple[int, float]:
    """(new tokens of the last run, median seconds of ``repeats`` runs)."""
    from tasks.kinds import runner

    seconds, tokens = [], 0
    for _ in range(repeats):
        start = time.perf_counter()
        out = runner("text")(model, params, lambda *_, **__: None, {}, {}, family=family)
        seconds.append(time.perf_counter() - start)
        tokens = int(out.record["usage"]["completion_tokens"])
    return tokens, statistics.median(seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args()

    import torch

    from app.devtools.tiny_text import TEXT_FAMILIES, make_tiny_text
    from tasks.pipelines import load_pipeline

    if args.threads:
        torch.set_num_threads(args.threads)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.tokens} new tokens, "
        f"median of {args.repeats}"
    )
    free: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as folder:
        made = make_tiny_text(Path(folder), families=TEXT_FAMILIES)
        for family in TEXT_FAMILIES:
            model = load_pipeline(made[family])
            base = {"prompt": PROMPT, "seed": 0, "temperature": 0.0}
            regex = {"type": "regex", "value": f"[a-z ]{{{args.tokens - 1}}}"}
            for mode, params in (
                ("free", {**base, "max_new_tokens": args.tokens}),
                ("regex", {**base, "max_new_tokens": args.tokens + 1, "grammar": regex}),
            ):
                timed(model, family, params, 1)  # warm-up (and the regex's compile: cached from here on)
                tokens, median_s = timed(model, family, params, args.repeats)
                rate = tokens / median_s
                if mode == "free":
                    free[family] = rate
                print(f"{family} {mode} tokens={tokens} median_s={median_s:.3f} tok_s={rate:.0f}", flush=True)
    print("tok_s " + " ".join(f"{family}={rate:.0f}" for family, rate in free.items()))


if __name__ == "__main__":
    main()
