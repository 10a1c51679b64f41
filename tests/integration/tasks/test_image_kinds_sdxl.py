"""img2img and inpainting on SDXL: the real StableDiffusionXLImg2ImgPipeline and
StableDiffusionXLInpaintPipeline built with ``from_pipe`` from a tiny SDXL txt2img pipeline (no
fleet: the shared e2e fleet runs sd1's through a worker, tests/e2e/test_image_kinds.py), with
``n`` images in one call."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
from PIL import Image

from tasks.kinds import kind_pipeline, runner
from tasks.pipelines import load_pipeline


def png(size: tuple[int, int], mode: str = "RGB", box: tuple[int, int, int, int] | None = None) -> bytes:
    image = Image.new(mode, size, 0 if box else (200, 80, 40))
    if box is not None:
        image.paste(255, box)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def test_sdxl_img2img_and_inpaint_run_on_the_txt2img_components(tmp_path: Path) -> None:
    from app.devtools.tiny_models import make_tiny_families

    pipeline = load_pipeline(make_tiny_families(tmp_path, families=("sdxl",))["sdxl"])
    img2img = kind_pipeline(pipeline, "sdxl", "img2img")
    assert type(img2img).__name__ == "StableDiffusionXLImg2ImgPipeline" and img2img.unet is pipeline.unet
    assert kind_pipeline(pipeline, "sdxl", "img2img") is img2img  # built once per resident pipeline
    source = png((48, 32))
    inputs = {"image": source, "mask": png((48, 32), "L", (8, 8, 24, 24))}
    steps: list[tuple[int, int]] = []
    out = runner("img2img")(
        pipeline,
        {"prompt": "a fox", "steps": 4, "seed": 3, "strength": 0.5, "n": 2},
        lambda step, total, text=None: steps.append((step, total)),
        {},
        inputs,
        family="sdxl",
    )
    assert [Image.open(io.BytesIO(data)).size for data in (out.data, *out.more)] == [(48, 32), (48, 32)]
    assert out.data != out.more[0] and out.record == {"seeds": [3, 4]}
    assert steps[-1] == (2, 2)  # int(4 x 0.5) steps ran, and progress counted those
    painted = runner("inpaint")(
        pipeline, {"prompt": "a fox", "steps": 2, "seed": 3}, lambda *a, **k: None, {}, inputs, family="sdxl"
    )
    after = np.asarray(Image.open(io.BytesIO(painted.data)).convert("RGB"), dtype=np.float64)
    before = np.asarray(Image.open(io.BytesIO(source)).convert("RGB"), dtype=np.float64)
    inside = np.zeros(after.shape[:2], dtype=bool)
    inside[8:24, 8:24] = True
    assert np.array_equal(after[~inside], before[~inside]) and np.abs(after[inside] - before[inside]).mean() > 10
