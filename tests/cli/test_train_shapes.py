"""``homefleet models train-shapes`` (issue 19) end to end at a few steps: it writes two
diffusers ``StableDiffusionPipeline`` folders that load offline, with the committed models'
components and sizes, and its figures in ``training.json``. (How well the committed, fully
trained models draw: tests/unit/devtools/test_shapes.py.)"""

from __future__ import annotations

import json
from pathlib import Path

from app.devtools.train_shapes import DEMO_MODELS_DIR, MODEL_NAMES
from tests.helpers import run_cli


def _files(folder: Path) -> dict[str, int]:
    return {path.relative_to(folder).as_posix(): path.stat().st_size for path in folder.rglob("*") if path.is_file()}


def test_train_shapes_writes_two_pipelines_like_the_committed_ones(tmp_path: Path) -> None:
    import torch
    from diffusers import DiffusionPipeline

    done = run_cli("models", "train-shapes", str(tmp_path), "--vae-steps", "2", "--unet-steps", "2", "--dataset", "64",
                   timeout_s=240)
    assert "trained in" in done.stdout, done.stdout
    report = json.loads((tmp_path / "training.json").read_text())
    assert (report["seed"], report["threads"], report["vae_steps"], report["unet_steps"]) == (19, 1, 2, 2)
    for style, name in MODEL_NAMES.items():
        folder = tmp_path / name
        assert _files(folder) == _files(DEMO_MODELS_DIR / name)  # the same files, byte for byte the same sizes
        assert report["styles"][style]["size_bytes"] == sum(_files(folder).values())
        pipeline = DiffusionPipeline.from_pretrained(str(folder), local_files_only=True, dtype=torch.float32)
        assert type(pipeline).__name__ == "StableDiffusionPipeline"
        assert (pipeline.scheduler.config.prediction_type, pipeline.scheduler.config.timestep_spacing) == (
            "v_prediction", "trailing")
        assert pipeline.unet.dtype == torch.float32  # stored as float16, loaded at the asked precision
        ids = pipeline.tokenizer("a red circle on a black background").input_ids
        assert len(ids) == 9  # one token a word, plus start and end
