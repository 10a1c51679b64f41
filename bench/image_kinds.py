"""What img2img, inpaint and ``n`` images cost on this machine, in-process on a tiny pipeline (no
fleet): the txt2img pipeline's load, building img2img/inpaint from it (``from_pipe``), one run
of each kind, and ``n`` images in one call against n calls.

    python -m bench.image_kinds [--family sd1] [--steps 4] [--side 64] [--n 4] [--repeat 3]

Builds the tiny model of the family (``homefleet models make-tiny``) in a temporary folder and
prints one line per figure (seconds, the median of ``--repeat`` runs after a warm-up run).
"""

from __future__ import annotations

import argparse
import io
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def _png(side: int, mode: str = "RGB", box: bool = False) -> bytes:
    from PIL import Image

    image = Image.new(mode, (side, side), 0 if box else (200, 80, 40))
    if box:
        image.paste(255, (side // 4, side // 4, 3 * side // 4, 3 * side // 4))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def _median_s(run: Callable[[], Any], repeat: int) -> float:
    run()  # warm-up
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", default="sd1")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--side", type=int, default=64)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()

    from app.devtools.tiny_models import make_tiny_families
    from tasks.kinds import kind_pipeline, runner
    from tasks.pipelines import load_pipeline, quiet

    quiet()
    with tempfile.TemporaryDirectory() as scratch:
        folder = make_tiny_families(Path(scratch), families=(args.family,))[args.family]
        started = time.perf_counter()
        pipeline = load_pipeline(folder)
        print(f"load {args.family} txt2img pipeline: {time.perf_counter() - started:.3f} s")
        for kind in ("img2img", "inpaint"):
            started = time.perf_counter()
            kind_pipeline(pipeline, args.family, kind)
            print(f"from_pipe {kind}: {time.perf_counter() - started:.4f} s (once per resident pipeline)")
        inputs = {"image": _png(args.side), "mask": _png(args.side, "L", box=True)}
        base = {"prompt": "a red circle", "steps": args.steps, "seed": 1}
        sized = {"width": args.side, "height": args.side}
        jobs: list[tuple[str, str, dict[str, Any]]] = [
            ("txt2img", "txt2img", {**base, **sized}),
            ("img2img strength 1.0", "img2img", {**base, "image": "x", "strength": 1.0}),
            ("img2img strength 0.5", "img2img", {**base, "image": "x", "strength": 0.5}),
            ("inpaint strength 1.0", "inpaint", {**base, "image": "x", "mask": "y", "strength": 1.0}),
            (f"txt2img n={args.n} (one call)", "txt2img", {**base, **sized, "n": args.n}),
        ]
        for label, kind, params in jobs:
            seconds = _median_s(
                lambda k=kind, p=params: runner(k)(pipeline, p, lambda *a, **k: None, {}, inputs, family=args.family),
                args.repeat,
            )
            print(f"run {label}, {args.steps} steps, {args.side}x{args.side}: {seconds:.3f} s")
        one = {**base, **sized}
        separate = _median_s(
            lambda: [
                runner("txt2img")(
                    pipeline, {**one, "seed": 1 + i}, lambda *a, **k: None, {}, inputs, family=args.family
                )
                for i in range(args.n)
            ],
            args.repeat,
        )
        print(f"run txt2img {args.n} separate calls: {separate:.3f} s")


if __name__ == "__main__":
    main()
