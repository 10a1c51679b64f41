"""The trained demo models: load time, sampling time per image and how often a
picture shows what was asked, on this machine, in-process (as a worker loads them).

    python -m bench.shapes [--images N] [--threads T] [--steps S] [--guidance G]

For each model (``app/devtools/demo_models/shapes-*``) it prints its size on disk, the
training figures from ``training.json``, the load seconds (``DiffusionPipeline.from_pretrained``,
float32), then draws ``N`` seeded pictures over every (colour, shape, background) in turn at
the demo's sampling (``app.devtools.train_shapes.SAMPLING``: 32 x 32 pixels, 8 steps, guidance
4; ``--steps`` and ``--guidance`` change the last two) and prints the seconds per image and the share of pictures
whose dominant colour,
background, shape and style (read by ``app.devtools.shapes.inspect``) are the prompt's. The
last line reads::

    load_s=X image_s=X colour_ok=R background_ok=R shape_ok=R style_ok=R

(the means over both models). Figures only: nothing here fails on them.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time

from app.core.quiet import quiet_libraries
from app.devtools.shapes import BACKGROUNDS, COLOURS, SHAPES, caption, inspect
from app.devtools.train_shapes import DEMO_MODELS_DIR, MODEL_NAMES, SAMPLING


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=54, help="pictures per model (54: every combination once)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--steps", type=int, default=SAMPLING["steps"])
    parser.add_argument("--guidance", type=float, default=SAMPLING["guidance_scale"])
    args = parser.parse_args(argv)

    import torch
    from diffusers import DiffusionPipeline

    torch.set_num_threads(args.threads)
    combos = list(itertools.product(COLOURS, SHAPES, BACKGROUNDS))
    training = json.loads((DEMO_MODELS_DIR / "training.json").read_text())
    print(
        f"training: seed {training['seed']}, {training['threads']} thread(s) per process, VAE {training['vae_steps']} "
        f"steps in {training['vae_s']:.0f} s; UNet {training['unet_steps']} steps per model; "
        f"total {training['total_s']:.0f} s"
    )
    totals: dict[str, list[float]] = {
        name: [] for name in ("load_s", "image_s", "colour", "background", "shape", "style")
    }
    for style, name in MODEL_NAMES.items():
        folder = DEMO_MODELS_DIR / name
        size = sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())
        started = time.perf_counter()
        with quiet_libraries():
            pipeline = DiffusionPipeline.from_pretrained(str(folder), local_files_only=True, dtype=torch.float32)
        load_s = time.perf_counter() - started
        pipeline.set_progress_bar_config(disable=True)
        hits = {"colour": 0, "background": 0, "shape": 0, "style": 0}
        started = time.perf_counter()
        for seed in range(args.images):
            colour, shape, background = combos[seed % len(combos)]
            image = pipeline(
                caption(colour, shape, background),
                width=SAMPLING["width"],
                height=SAMPLING["height"],
                num_inference_steps=args.steps,
                guidance_scale=args.guidance,
                generator=torch.Generator("cpu").manual_seed(seed),
            ).images[0]
            seen = inspect(image)
            hits["colour"] += seen.colour == colour
            hits["background"] += seen.background == background
            hits["shape"] += seen.shape == shape
            hits["style"] += seen.style == style
        image_s = (time.perf_counter() - started) / args.images
        trained = training["styles"].get(style, {})
        print(
            f"{name}: {size / 1e6:.2f} MB on disk, trained in {trained.get('train_s', 0):.0f} s (loss "
            f"{trained.get('loss', 0):.4f}); load {load_s:.2f} s; {image_s:.3f} s per {SAMPLING['width']}x"
            f"{SAMPLING['height']} image ({args.steps} steps, guidance {args.guidance}); right: "
            + ", ".join(f"{what} {count}/{args.images}" for what, count in hits.items())
        )
        totals["load_s"].append(load_s)
        totals["image_s"].append(image_s)
        for what, count in hits.items():
            totals[what].append(count / args.images)
    mean = {name: sum(values) / len(values) for name, values in totals.items()}
    print(
        f"load_s={mean['load_s']:.3f} image_s={mean['image_s']:.3f} colour_ok={mean['colour']:.3f} "
        f"background_ok={mean['background']:.3f} shape_ok={mean['shape']:.3f} style_ok={mean['style']:.3f}"
    )


if __name__ == "__main__":
    main()
