"""Every job kind end to end on real tiny pipelines through a real worker:
txt2img, edit (InstructPix2Pix), upscale (x4) and video (AnimateDiff -> MP4).

The session's one-machine fleet (tests/e2e/conftest.py ``models_fleet``): the API and ONE
worker, machine ``m1``, with its own model folder.
Inputs are uploaded to the server first; m1 fetches them over HTTP and checks their digest.
Each kind runs twice with the same seed (identical bytes) and once with another seed.
"""

from __future__ import annotations

import io
import json
import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest
from PIL import Image

from app.core.digest import bytes_digest
from app.core.states import JobState
from app.core.tls import tls_context
from tests.e2e.conftest import ModelsFleet
from tests.helpers import png

pytestmark = pytest.mark.e2e

MACHINE = "m1"
MODELS = {"txt2img": "tiny-sd", "edit": "tiny-pix2pix", "upscale": "tiny-upscaler", "video": "tiny-animatediff"}
# Journaled only: the server adds these to the worker's (embedded) provenance.
SERVER_FIELDS = {"job_id", "load_s", "run_s", "cold_load", "actual_s", "predicted_s"}


KindsFleet = ModelsFleet


@pytest.fixture
def kfleet(models_fleet: ModelsFleet) -> ModelsFleet:
    """The session's one-machine fleet with every tiny family (tests/e2e/conftest.py)."""
    return models_fleet


def upload(fleet: KindsFleet, data: bytes, name: str = "input.png") -> httpx.Response:
    return httpx.post(
        f"{fleet.local.api_url}/v1/files",
        files={"file": (name, data, "image/png")},
        headers=fleet.local.auth_headers,
        timeout=30,
        verify=tls_context(),
    )


def run(fleet: KindsFleet, kind: str, params: dict[str, Any]) -> tuple[dict[str, Any], bytes]:
    """Submit to m1, wait, return (job as GET /v1/jobs/{id} shows it, result bytes)."""
    accepted = fleet.client.submit(MODELS[kind], kind, params, target=MACHINE)
    job = fleet.client.wait(accepted["id"], timeout_s=180)
    assert job["state"] == "succeeded", job
    return job, fleet.client.download(accepted["id"])


def check_provenance(fleet: KindsFleet, kind: str, job: dict[str, Any], embedded: dict[str, Any]) -> None:
    """The journaled provenance is the embedded one plus the server's fields; the model file
    digests equal the manifest's; seed, params, machine and device are recorded."""
    journaled = job["provenance"]
    manifest = fleet.ctx.registry.manifest(MODELS[kind])
    assert journaled["model_files"] == {f.path: f.digest for f in manifest.files}
    assert {k: v for k, v in journaled.items() if k not in SERVER_FIELDS} == embedded
    assert (journaled["kind"], journaled["model_id"], journaled["machine"], journaled["device"]) == (
        kind,
        MODELS[kind],
        MACHINE,
        "cpu",
    )
    assert journaled["seed"] == job["seed"] == job["params"]["seed"]
    assert journaled["job_id"] == job["id"] and journaled["actual_s"] == pytest.approx(job["load_s"] + job["run_s"])
    assert journaled["precision"] == "fp32" and "predicted_s" in journaled
    # per-step progress reached the server: the last report is the last step
    progress = fleet.ctx.redis.hgetall(fleet.ctx.keys.progress(job["id"]))
    steps = job["params"]["steps"]
    assert (progress["step"], progress["total"]) == (str(steps), str(steps))


def png_provenance(data: bytes) -> dict[str, Any]:
    return json.loads(Image.open(io.BytesIO(data)).info["homefleet"])  # type: ignore[no-any-return]


def test_txt2img_same_seed_gives_identical_bytes_and_provenance_matches_manifest(kfleet: KindsFleet) -> None:
    params = {"prompt": "a lighthouse", "steps": 2, "seed": 1234}
    first, data = run(kfleet, "txt2img", params)
    second, again = run(kfleet, "txt2img", params)
    _, other = run(kfleet, "txt2img", {**params, "seed": 99})
    assert data == again and first["result"]["digest"] == second["result"]["digest"]
    assert other != data
    check_provenance(kfleet, "txt2img", first, png_provenance(data))


def test_edit_keeps_the_input_size_and_records_the_input_digest(kfleet: KindsFleet) -> None:
    uploaded = upload(kfleet, png(48, 40))
    assert uploaded.status_code == 201, uploaded.text
    file_id = uploaded.json()["id"]
    assert file_id == bytes_digest(png(48, 40))
    params = {"prompt": "make it snowy", "image": file_id, "steps": 2, "seed": 7}
    job, data = run(kfleet, "edit", params)
    _, again = run(kfleet, "edit", params)
    _, other = run(kfleet, "edit", {**params, "seed": 8})
    image = Image.open(io.BytesIO(data))
    assert (image.format, image.size) == ("PNG", (48, 40))
    assert data == again and other != data
    embedded = png_provenance(data)
    assert embedded["inputs"] == {"image": file_id}
    check_provenance(kfleet, "edit", job, embedded)


def test_upscale_gives_four_times_the_input_size(kfleet: KindsFleet) -> None:
    file_id = upload(kfleet, png(16, 24)).json()["id"]
    params = {"prompt": "", "image": file_id, "steps": 2, "seed": 5}
    job, data = run(kfleet, "upscale", params)
    _, again = run(kfleet, "upscale", params)
    image = Image.open(io.BytesIO(data))
    assert (image.format, image.size) == ("PNG", (64, 96))
    assert data == again
    check_provenance(kfleet, "upscale", job, png_provenance(data))


def mp4_comment(path: Path) -> str:
    """The MP4's ``comment`` tag, read back by ffmpeg (``-f ffmetadata``; '\\' escapes undone)."""
    import imageio_ffmpeg

    out = subprocess.run(
        [imageio_ffmpeg.get_ffmpeg_exe(), "-v", "error", "-i", str(path), "-f", "ffmetadata", "-"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    line = next(line for line in out.splitlines() if line.startswith("comment="))
    value = line.removeprefix("comment=")
    result, escaped = [], False
    for char in value:
        if escaped or char != "\\":
            result.append(char)
            escaped = False
        else:
            escaped = True
    return "".join(result)


def test_video_is_an_mp4_with_the_requested_frames_that_plays(kfleet: KindsFleet, tmp_path: Path) -> None:
    import imageio_ffmpeg

    params = {"prompt": "a paper boat", "frames": 4, "fps": 8, "steps": 2, "seed": 11}
    job, data = run(kfleet, "video", params)
    _, again = run(kfleet, "video", params)
    assert job["result"]["media_type"] == "video/mp4"
    assert data == again
    path = tmp_path / "clip.mp4"
    path.write_bytes(data)
    frames, seconds = imageio_ffmpeg.count_frames_and_secs(str(path))
    assert (frames, seconds) == (4, pytest.approx(0.5, abs=0.01))
    reader = imageio_ffmpeg.read_frames(str(path))
    meta = next(reader)
    decoded = list(reader)  # decoding every frame = it plays
    assert meta["size"] == (64, 64) and len(decoded) == 4 and all(len(f) == 64 * 64 * 3 for f in decoded)
    check_provenance(kfleet, "video", job, json.loads(mp4_comment(path)))


def test_video_as_animated_webp_has_the_requested_frames(kfleet: KindsFleet) -> None:
    _, data = run(kfleet, "video", {"prompt": "waves", "frames": 3, "steps": 1, "seed": 3, "format": "webp"})
    image = Image.open(io.BytesIO(data))
    assert (image.format, image.n_frames, image.size) == ("WEBP", 3, (64, 64))
    assert json.loads(image.info["xmp"])["kind"] == "video"


def test_a_seed_is_drawn_and_recorded_when_none_is_given(kfleet: KindsFleet) -> None:
    job, data = run(kfleet, "txt2img", {"prompt": "no seed", "steps": 1})
    assert isinstance(job["seed"], int)
    assert png_provenance(data)["seed"] == job["seed"] == kfleet.ctx.journal.get(job["id"]).params["seed"]


def test_r22_uploads_over_the_limit_or_not_an_image_are_refused_naming_the_limit(kfleet: KindsFleet) -> None:
    limit = kfleet.local.settings.max_input_bytes
    too_big = upload(kfleet, b"\x89PNG\r\n\x1a\n" + bytes(limit))
    assert too_big.status_code == 422
    assert too_big.json()["error"]["reason"] == "input_too_large" and str(limit) in too_big.json()["error"]["message"]
    text = upload(kfleet, b"hello, not an image", name="x.png")
    assert text.status_code == 422 and text.json()["error"]["reason"] == "input_type"
    assert too_big.json()["error"]["param"] == text.json()["error"]["param"] == "file"  # the form's field
    assert not list(kfleet.local.settings.inputs_dir.rglob("*.txt"))


def test_r22_an_edit_naming_no_uploaded_file_is_rejected_at_submission(kfleet: KindsFleet) -> None:
    missing = bytes_digest(b"never uploaded")
    response = httpx.post(
        f"{kfleet.local.api_url}/v1/jobs",
        headers=kfleet.local.auth_headers,
        json={"model": MODELS["edit"], "kind": "edit", "params": {"prompt": "x", "image": missing}, "target": MACHINE},
        verify=tls_context(),
    )
    assert response.status_code == 422
    error = response.json()["error"]
    assert error["reason"] == "unknown_file" and "params.image" in error["message"]
    rejected = [j for j in kfleet.ctx.journal.list([JobState.rejected]) if j.params.get("image") == missing]
    assert len(rejected) == 1


def test_r5_an_input_whose_bytes_changed_on_the_server_is_refused_by_the_worker(kfleet: KindsFleet) -> None:
    file_id = upload(kfleet, png(24, 24)).json()["id"]
    stored = kfleet.ctx.inputs.get(file_id).path
    stored.write_bytes(png(32, 32))  # the bytes no longer match their id (digest)
    accepted = kfleet.client.submit(MODELS["upscale"], "upscale", {"image": file_id, "steps": 1}, target=MACHINE)
    job = kfleet.client.wait(accepted["id"], timeout_s=120)
    assert (job["state"], job["reason"]) == ("failed", "integrity")
    assert file_id in job["message"]
