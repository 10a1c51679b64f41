"""A stored folder holding a precision's variant files loads with diffusers' ``variant=``
(tasks/pipelines.py, app.core.variants.stored_variant), also when only some components have
them: those load their fp16 files, the others their full-precision files (docs/operations.md,
"What registration takes")."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file

from app.devtools.replicas import make_replica
from app.store.selection import select_files
from tasks.pipelines import load_pipeline


def test_r1_a_mix_of_fp16_and_full_precision_components_loads_each_from_its_taken_files(tmp_path: Path) -> None:
    replica = make_replica("sd15", tmp_path / "downloads")
    for twin in replica.folder.glob("text_encoder/*fp16*"):
        twin.unlink()  # text_encoder has no fp16 files: it loads model.safetensors
    selection = select_files(replica.folder, "fp16")
    assert "text_encoder/model.safetensors" in selection.taken
    assert "unet/diffusion_pytorch_model.fp16.safetensors" in selection.taken
    stored = tmp_path / "stored"
    for path in selection.taken:
        (stored / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(replica.folder / path, stored / path)

    pipeline = load_pipeline(stored, "fp16")
    assert pipeline.unet.dtype == pipeline.text_encoder.dtype == torch.float16
    unet = load_file(stored / "unet/diffusion_pytorch_model.fp16.safetensors")
    name, tensor = next(iter(sorted(unet.items())))
    assert torch.equal(pipeline.unet.state_dict()[name], tensor)
    text = load_file(stored / "text_encoder/model.safetensors")
    loaded = pipeline.text_encoder.state_dict()
    common = sorted(set(text) & set(loaded))
    assert len(common) > len(text) // 2
    assert all(torch.equal(loaded[name], text[name].to(torch.float16)) for name in common)
    image = pipeline(
        "a cat",
        num_inference_steps=2,
        height=64,
        width=64,
        output_type="np",
        generator=torch.Generator().manual_seed(0),
    ).images[0]
    assert image.shape == (64, 64, 3) and float(image.std()) > 0
