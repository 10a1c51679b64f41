"""Stable Diffusion 1.5 as its repository ships it names a safety checker
(``["stable_diffusion", "StableDiffusionSafetyChecker"]``, a transformers model in a diffusers
pipeline module): it is taken, priced as the loaded module holds it (R15), loaded, and run as
diffusers runs it; an image it flags comes back black with ``nsfw_content_detected`` in the
job's record (docs/api.md, "Kinds and their params"). Real tiny pipeline (app/devtools/replicas.py)."""

from __future__ import annotations

import io
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from app.core.pricing import component_bytes
from app.core.variants import Variant
from app.devtools.replicas import make_replica
from app.store.selection import select_files
from tasks.kinds.txt2img import run
from tasks.pipelines import load_pipeline


def module_bytes(module: torch.nn.Module) -> int:
    tensors = {id(t): t for t in [*module.parameters(), *module.buffers()]}
    return sum(t.numel() * t.element_size() for t in tensors.values())


@pytest.fixture(scope="module")
def stored(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("sd15")
    replica = make_replica("sd15", out / "downloads")
    stored = out / "stored"
    for path in select_files(replica.folder, "fp16").taken:
        (stored / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(replica.folder / path, stored / path)
    return stored


def test_r15_the_safety_checker_is_taken_priced_and_loaded_at_its_bytes(stored: Path) -> None:
    assert (stored / "safety_checker/model.fp16.safetensors").is_file()
    assert (stored / "feature_extractor/preprocessor_config.json").is_file()
    priced = component_bytes(stored, Variant("fp16"))
    pipeline = load_pipeline(stored, "fp16")
    assert type(pipeline.safety_checker).__name__ == "StableDiffusionSafetyChecker"
    assert pipeline.safety_checker.dtype == torch.float16
    assert priced["safety_checker"] == module_bytes(pipeline.safety_checker) > 0
    assert set(priced) == {"safety_checker", "text_encoder", "unet", "vae"}


def test_an_image_the_safety_checker_flags_is_black_and_the_record_says_so(stored: Path) -> None:
    pipeline = load_pipeline(stored, "fp32")
    params = {"prompt": "a red circle", "width": 32, "height": 32, "steps": 2, "seed": 1}
    clean = run(pipeline, params, lambda *_: None, {}, {}, family="sd1")
    assert "nsfw_content_detected" not in clean.record
    assert np.asarray(Image.open(io.BytesIO(clean.data))).any()

    with torch.no_grad():  # every concept's threshold below any similarity: everything is flagged
        pipeline.safety_checker.concept_embeds_weights.fill_(-10.0)
    flagged = run(pipeline, params, lambda *_: None, {}, {}, family="sd1")
    assert flagged.record["nsfw_content_detected"] == [True]
    assert not np.asarray(Image.open(io.BytesIO(flagged.data))).any()  # diffusers blacks it out
