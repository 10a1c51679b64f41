"""A single-file checkpoint registered with ``homefleet models add FILE --family sd1`` (docs/
operations.md "Single-file checkpoints") is a model like any other end to end: synced to a real
worker with ``homefleet sync`` (R4-R6), it runs txt2img, and its image is pixel-identical to the
one the same weights give when registered as a diffusers folder (same seed, same machine); the
result's provenance names the checkpoint's digest (R1).

Fleet of this module: the API and one worker, m1; Redis database 12.
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from app.client import HomefleetClient
from app.context import ServerContext, build_context
from app.core.digest import bytes_digest, file_digest
from app.devtools.localfleet import LocalFleet
from app.devtools.tiny_single_file import make_tiny_single_file
from tests.helpers import TEST_API_KEY, fleet_files, run_cli

pytestmark = pytest.mark.e2e

MACHINE = "m1"
FOLDER_MODEL = "tiny-sd-folder"
FILE_MODEL = "tiny-sd-single-file"


@dataclass
class SingleFileFleet:
    local: LocalFleet
    ctx: ServerContext
    client: HomefleetClient
    env: dict[str, str]
    checkpoint: Path


@pytest.fixture(scope="module")
def sfleet(
    tmp_path_factory: pytest.TempPathFactory, redis_base_url: str, tiny_models_dir: Path
) -> Iterator[SingleFileFleet]:
    data_dir = tmp_path_factory.mktemp("single-file-fleet")
    checkpoint = make_tiny_single_file(
        tiny_models_dir / "tiny-sd", data_dir / "in" / "my-sd15-merge.safetensors", "sd1"
    )
    files = fleet_files(data_dir, f"{redis_base_url}/12", MACHINE)
    config, fleet_file, settings, env = files.config, files.fleet_file, files.settings, files.operator
    ctx = build_context(settings, config, migrate=True)
    ctx.registry.add(tiny_models_dir / "tiny-sd", model_id=FOLDER_MODEL)
    done = run_cli(
        "models",
        "add",
        str(checkpoint),
        "--family",
        "sd1",
        "--config",
        str(tiny_models_dir / "tiny-sd"),
        "--id",
        FILE_MODEL,
        env=env,
        timeout_s=300,
    )
    assert f"registered {FILE_MODEL} family=sd1" in done.stdout, done.stdout
    local = LocalFleet(settings, config, fleet_file, forkserver=True)
    client = HomefleetClient(local.api_url, api_key=TEST_API_KEY)
    try:
        local.start_api()
        local.start_worker(MACHINE)
        local.wait_online([MACHINE], timeout_s=120)
        yield SingleFileFleet(local, ctx, client, env, checkpoint)
    finally:
        client.close()
        local.stop()
        ctx.close()


def txt2img(fleet: SingleFileFleet, model_id: str) -> tuple[dict, np.ndarray]:  # type: ignore[type-arg]
    accepted = fleet.client.submit(
        model_id, "txt2img", {"prompt": "a red circle", "steps": 3, "seed": 7}, target=MACHINE
    )
    job = fleet.client.wait(accepted["id"], timeout_s=240)
    assert job["state"] == "succeeded", job
    data = fleet.client.download(accepted["id"])
    assert job["result"]["digest"] == bytes_digest(data)
    image = Image.open(io.BytesIO(data))
    return json.loads(image.info["homefleet"]), np.asarray(image.convert("RGB"))


def test_r1_r6_a_single_file_sd1_model_synced_to_a_worker_draws_the_folders_pixels(sfleet: SingleFileFleet) -> None:
    for model_id in (FOLDER_MODEL, FILE_MODEL):
        done = run_cli("sync", MACHINE, model_id, env=sfleet.env, timeout_s=180)
        assert "succeeded" in done.stdout and model_id in done.stdout, done.stdout
    assert (sfleet.local.models_dir(MACHINE) / FILE_MODEL / "unet" / "diffusion_pytorch_model.safetensors").is_file()
    folder_provenance, folder_pixels = txt2img(sfleet, FOLDER_MODEL)
    file_provenance, file_pixels = txt2img(sfleet, FILE_MODEL)
    assert folder_pixels.shape == (64, 64, 3) and folder_pixels.std() > 0  # an image, not a blank
    assert np.array_equal(file_pixels, folder_pixels)
    assert file_provenance["source_digest"] == file_digest(sfleet.checkpoint)
    assert "source_digest" not in folder_provenance  # a folder has no single-file source
    record = sfleet.ctx.registry.get(FILE_MODEL)
    assert file_provenance["model_files"] == {f.path: f.digest for f in sfleet.ctx.registry.manifest(FILE_MODEL).files}
    assert (record.source_format, record.source_digest) == ("single-file", file_provenance["source_digest"])
