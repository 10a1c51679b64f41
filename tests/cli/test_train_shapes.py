"""``homefleet models train-shapes`` and ``train-recolour`` end to end at a few steps: two
diffusers ``StableDiffusionPipeline`` folders and one ``StableDiffusionInstructPix2PixPipeline``
that load offline, with the committed models' files and weight sizes, and their figures in
``training.json`` and ``training-recolour.json``. (How well the committed, fully
trained models draw: tests/unit/devtools/test_shapes.py.)"""

from __future__ import annotations

import json
from pathlib import Path

from app.devtools.train_recolour import RECOLOUR_MODEL
from app.devtools.train_shapes import DEMO_MODELS_DIR, MODEL_NAMES
from tests.helpers import run_cli


def _files(folder: Path) -> dict[str, int]:
    return {path.relative_to(folder).as_posix(): path.stat().st_size for path in folder.rglob("*") if path.is_file()}


def _weights(folder: Path) -> dict[str, int | None]:
    """Every file of ``folder``, with its size for the weights (configs hold trained numbers)."""
    return {name: size if name.endswith(".safetensors") else None for name, size in _files(folder).items()}


def test_train_shapes_writes_two_pipelines_like_the_committed_ones(tmp_path: Path) -> None:
    import torch
    from diffusers import DiffusionPipeline

    done = run_cli(
        "models",
        "train-shapes",
        str(tmp_path),
        "--vae-steps",
        "2",
        "--unet-steps",
        "2",
        "--dataset",
        "64",
        timeout_s=240,
    )
    assert "trained in" in done.stdout, done.stdout
    report = json.loads((tmp_path / "training.json").read_text())
    assert (report["seed"], report["threads"], report["vae_steps"], report["unet_steps"]) == (19, 1, 2, 2)
    for style, name in MODEL_NAMES.items():
        folder = tmp_path / name
        assert _weights(folder) == _weights(DEMO_MODELS_DIR / name)  # the same files, the same weight shapes
        assert report["styles"][style]["size_bytes"] == sum(_files(folder).values())
        pipeline = DiffusionPipeline.from_pretrained(str(folder), local_files_only=True, dtype=torch.float32)
        assert type(pipeline).__name__ == "StableDiffusionPipeline"
        assert (pipeline.scheduler.config.prediction_type, pipeline.scheduler.config.timestep_spacing) == (
            "v_prediction",
            "trailing",
        )
        assert pipeline.unet.dtype == torch.float32  # stored as float16, loaded at the asked precision
        ids = pipeline.tokenizer("a red circle on a black background").input_ids
        assert len(ids) == 9  # one token a word, plus start and end
    # the edit model reuses shapes-filled's VAE from the same folder
    done = run_cli("models", "train-recolour", str(tmp_path), "--steps", "2", "--dataset", "64", timeout_s=240)
    assert "trained in" in done.stdout, done.stdout
    folder = tmp_path / RECOLOUR_MODEL
    assert _weights(folder) == _weights(DEMO_MODELS_DIR / RECOLOUR_MODEL)
    assert json.loads((tmp_path / "training-recolour.json").read_text())["steps"] == 2
    edit = DiffusionPipeline.from_pretrained(str(folder), local_files_only=True, dtype=torch.float32)
    assert type(edit).__name__ == "StableDiffusionInstructPix2PixPipeline" and edit.unet.config.in_channels == 8


def test_train_colour_lora_writes_an_adapter_like_the_committed_one(tmp_path: Path) -> None:
    """The LoRA of shapes-filled, at a few steps: diffusers' LoRA file with the
    committed adapter's tensors and its figures (the colours read at scales 1 and 0)."""
    import shutil

    from safetensors import safe_open

    from app.devtools.train_colour_lora import COLOUR_LORA

    shutil.copytree(DEMO_MODELS_DIR / "shapes-filled", tmp_path / "shapes-filled")
    done = run_cli("models", "train-colour-lora", str(tmp_path), "--steps", "2", "--dataset", "64", timeout_s=240)
    assert "trained in" in done.stdout, done.stdout
    report = json.loads((tmp_path / "training-colour-lora.json").read_text())
    assert (report["seed"], report["steps"], report["rank"]) == (29, 2, 8)
    assert 0 <= report["blue_at_1"] <= 1 and report["own_colour_at_0"] >= 0.5  # scale 0: the base model draws
    assert _weights(tmp_path / COLOUR_LORA) == _weights(DEMO_MODELS_DIR / COLOUR_LORA)

    def shapes(folder: Path) -> dict[str, list[int]]:
        with safe_open(str(folder / "pytorch_lora_weights.safetensors"), "pt") as weights:
            return {name: list(weights.get_slice(name).get_shape()) for name in weights.keys()}  # noqa: SIM118

    assert shapes(tmp_path / COLOUR_LORA) == shapes(DEMO_MODELS_DIR / COLOUR_LORA)
    assert all(name.startswith("unet.") for name in shapes(tmp_path / COLOUR_LORA))
