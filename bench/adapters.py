"""What a LoRA adapter costs on this machine, in-process on tiny-sd (no fleet): the
base pipeline's cold load, loading an adapter onto the warm pipeline (``load_lora_weights`` +
``set_adapters``, as ``tasks/adapters.py`` does) and unloading it, and one txt2img run without
and with the adapter (interleaved).

    python -m bench.adapters [--steps 4] [--side 64] [--rank 4] [--repeat 5] [--shapes]

Builds tiny-sd (``homefleet models make-tiny``) and its tiny LoRA (``homefleet models
make-tiny-lora``) in a temporary folder (``--shapes``: the committed demo model shapes-filled
and its trained adapter shapes-blue-lora instead, at 32x32 and 8 steps) and prints one line per figure (seconds, the
median of
``--repeat`` runs after a warm-up run), then all in one line of ``name=seconds``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def _median_s(run: Callable[[], Any], repeat: int, after: Callable[[], Any] | None = None) -> float:
    """Median seconds of ``run`` over ``repeat`` timed calls after a warm-up; ``after`` (untimed)
    follows each call."""
    times = []
    for i in range(repeat + 1):
        started = time.perf_counter()
        run()
        if i:
            times.append(time.perf_counter() - started)
        if after is not None:
            after()
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--side", type=int, default=64)
    parser.add_argument("--rank", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--shapes", action="store_true", help="shapes-filled and shapes-blue-lora")
    args = parser.parse_args(argv)

    import torch

    from app.core.lora_files import LORA_WEIGHTS
    from app.devtools.tiny_models import make_tiny_families, make_tiny_lora
    from tasks.pipelines import load_pipeline, quiet

    quiet()
    with tempfile.TemporaryDirectory() as scratch:
        if args.shapes:
            from app.devtools.train_colour_lora import COLOUR_LORA
            from app.devtools.train_shapes import DEMO_MODELS_DIR, SAMPLING

            base, lora = DEMO_MODELS_DIR / "shapes-filled", DEMO_MODELS_DIR / COLOUR_LORA
            args.side, args.steps, args.rank = SAMPLING["width"], SAMPLING["steps"], 8
        else:
            base = make_tiny_families(Path(scratch), families=("sd1",))["sd1"]
            lora = make_tiny_lora(base, Path(scratch) / "tiny-sd-lora", rank=args.rank)
        lora_bytes = (lora / LORA_WEIGHTS).stat().st_size
        cold_s = _median_s(lambda: load_pipeline(base), args.repeat)
        pipeline = load_pipeline(base)

        def load() -> None:
            pipeline.load_lora_weights(
                str(lora), weight_name=LORA_WEIGHTS, adapter_name="adapter0", local_files_only=True
            )
            pipeline.set_adapters(["adapter0"], adapter_weights=[1.0])

        def run() -> None:
            pipeline(
                prompt="a red circle",
                width=args.side,
                height=args.side,
                num_inference_steps=args.steps,
                generator=torch.Generator("cpu").manual_seed(1),
            )

        load_s = _median_s(load, args.repeat, after=pipeline.unload_lora_weights)
        unload_s = _median_s(pipeline.unload_lora_weights, args.repeat, after=load)  # each call unloads a loaded one
        pipeline.unload_lora_weights()
        run()  # warm-up
        plain, adapted = [], []
        for _ in range(args.repeat):  # interleaved: a shared CPU's load falls on both alike
            started = time.perf_counter()
            run()
            plain.append(time.perf_counter() - started)
            load()
            started = time.perf_counter()
            run()
            adapted.append(time.perf_counter() - started)
            pipeline.unload_lora_weights()
        plain_s, adapted_s = statistics.median(plain), statistics.median(adapted)
    print(f"{base.name} cold load (from_pretrained): {cold_s:.3f} s")
    print(f"adapter ({lora_bytes} bytes, rank {args.rank}) load + set_adapters on the warm pipeline: {load_s:.3f} s")
    print(f"adapter unload (unload_lora_weights): {unload_s:.3f} s")
    print(f"txt2img {args.side}x{args.side}, {args.steps} steps, without adapter: {plain_s:.3f} s")
    print(
        f"txt2img {args.side}x{args.side}, {args.steps} steps, with adapter (scale 1): {adapted_s:.3f} s "
        f"({adapted_s / plain_s:.2f}x)"
    )
    print(
        f"cold_load_s={cold_s:.4f} adapter_load_s={load_s:.4f} unload_s={unload_s:.4f} run_s={plain_s:.4f} "
        f"adapter_run_s={adapted_s:.4f}"
    )


if __name__ == "__main__":
    main()
