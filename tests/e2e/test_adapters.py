"""LoRA adapters per request through the API and a real worker on tiny-sd: an adapter
changes the image at scale 1 and leaves it as it is at scale 0; it is loaded onto the warm
pipeline (no second cold load of the base model) and unloaded after the job; provenance names
its digests and scale; placement prices its load; refusals name the field (R22) and an adapter
not verified on the target is refused like an unverified model (R4). A LoRA file in the kohya
layout (as downloaded) gives the very pixels of the same tensors in the diffusers layout.

Uses the session's shared fleet (tests/e2e/conftest.py: ``ADAPTER`` on server and m1 only).
"""

from __future__ import annotations

import hashlib
import io
import json
from typing import Any

import httpx
import pytest
from PIL import Image

from app.core.tls import tls_context
from tests.e2e.conftest import ADAPTER, EDIT_MODEL, KOHYA_ADAPTER, OTHER_ADAPTER, RunningFleet
from tests.helpers import flip_keeping_stat, png, wait_for

pytestmark = pytest.mark.e2e

MACHINE = "m1"
BASE = {"prompt": "a red circle", "steps": 3, "seed": 7, "width": 32, "height": 32}


def pixel_digest(data: bytes) -> str:
    """The digest of the decoded RGB pixels (the PNG's provenance chunk names the adapters)."""
    with Image.open(io.BytesIO(data)) as image:
        return hashlib.sha256(image.convert("RGB").tobytes()).hexdigest()


def run(fleet: RunningFleet, params: dict[str, Any]) -> tuple[dict[str, Any], bytes]:
    accepted = fleet.client.submit(fleet.model, "txt2img", params, target=MACHINE)
    job = fleet.client.wait(accepted["id"], timeout_s=180)
    assert job["state"] == "succeeded", job
    return job, fleet.client.download(accepted["id"])


def post(
    fleet: RunningFleet, params: dict[str, Any], target: str = MACHINE, model: str | None = None, dry_run: bool = False
) -> httpx.Response:
    return httpx.post(
        f"{fleet.local.api_url}/v1/jobs{'?dry_run=true' if dry_run else ''}",
        headers=fleet.local.auth_headers,
        timeout=30,
        json={"model": model or fleet.model, "kind": "txt2img", "params": params, "target": target},
        verify=tls_context(),
    )


def test_an_adapter_changes_the_image_on_the_warm_pipeline_and_is_unloaded_after(fleet: RunningFleet) -> None:
    plain_job, plain = run(fleet, BASE)
    with_job, adapted = run(fleet, {**BASE, "adapters": [{"id": ADAPTER, "scale": 1.0}]})
    zero_job, zero = run(fleet, {**BASE, "adapters": [{"id": ADAPTER, "scale": 0.0}]})
    after_job, after = run(fleet, BASE)

    assert pixel_digest(adapted) != pixel_digest(plain)  # scale 1: the adapter changes the image
    assert pixel_digest(zero) == pixel_digest(plain)  # scale 0: LoRA's delta times 0 adds exactly nothing
    assert after == plain  # unloaded: the same bytes as before the adapter (provenance included)
    # The base model was warm for every adapter job and after: loaded once, never reloaded for them.
    assert [j["cold_load"] for j in (with_job, zero_job, after_job)] == [False, False, False]
    warm = json.loads(fleet.ctx.redis.get(fleet.ctx.keys.warm(MACHINE)))
    assert fleet.model in warm and ADAPTER not in warm
    # Provenance: each adapter's digests (the registry's manifest) and scale, embedded and journaled.
    files = {f.path: f.digest for f in fleet.ctx.registry.manifest(ADAPTER).files}
    assert list(files) == ["pytorch_lora_weights.safetensors"]
    assert with_job["provenance"]["adapters"] == [{"id": ADAPTER, "scale": 1.0, "files": files}]
    assert zero_job["provenance"]["adapters"] == [{"id": ADAPTER, "scale": 0.0, "files": files}]
    assert with_job["provenance"]["adapter_load_s"] > 0
    assert "adapters" not in plain_job["provenance"] and "adapter_load_s" not in plain_job["provenance"]
    with Image.open(io.BytesIO(adapted)) as image:
        assert json.loads(image.text["homefleet"])["adapters"] == [{"id": ADAPTER, "scale": 1.0, "files": files}]
    assert with_job["params"]["adapters"] == [{"id": ADAPTER, "scale": 1.0}]


def test_a_kohya_file_gives_the_same_pixels_as_the_same_weights_in_the_diffusers_layout(fleet: RunningFleet) -> None:
    """``KOHYA_ADAPTER`` holds ``ADAPTER``'s tensors under kohya's names with alpha = rank (scale
    1): diffusers converts it as it loads (``lora_state_dict``), so at the same seed and scale the
    image is pixel for pixel the diffusers one, not the base model's; unloaded after the job."""
    _plain_job, plain = run(fleet, BASE)
    _, diffusers = run(fleet, {**BASE, "adapters": [{"id": ADAPTER, "scale": 0.5}]})
    kohya_job, kohya = run(fleet, {**BASE, "adapters": [{"id": KOHYA_ADAPTER, "scale": 0.5}]})
    _, after = run(fleet, BASE)

    assert pixel_digest(kohya) == pixel_digest(diffusers)
    assert pixel_digest(kohya) != pixel_digest(plain)  # it applied
    assert after == plain and kohya_job["cold_load"] is False  # unloaded; the base model stayed warm
    record = fleet.ctx.registry.adapter(KOHYA_ADAPTER)
    files = {f.path: f.digest for f in fleet.ctx.registry.manifest(KOHYA_ADAPTER).files}
    assert (record.source_format, record.source_digest) == ("lora-kohya", files["pytorch_lora_weights.safetensors"])
    assert files != {f.path: f.digest for f in fleet.ctx.registry.manifest(ADAPTER).files}  # other bytes, same tensors
    assert kohya_job["provenance"]["adapters"] == [{"id": KOHYA_ADAPTER, "scale": 0.5, "files": files}]


def test_the_other_image_kinds_take_adapters_on_their_derived_pipelines(fleet: RunningFleet) -> None:
    """img2img runs on a pipeline built with ``from_pipe`` from the resident one (its UNet is the
    same module, so the adapter loaded on the resident pipeline applies); edit on the pix2pix
    model (on the server) takes an adapter of its own family."""
    image = fleet.client.upload(png(32, 32))["id"]
    img2img = {"prompt": "a fox", "steps": 3, "seed": 3, "image": image, "strength": 1.0}
    digests = []
    for adapters in ([], [{"id": ADAPTER}], []):
        accepted = fleet.client.submit(fleet.model, "img2img", {**img2img, "adapters": adapters}, target=MACHINE)
        assert fleet.client.wait(accepted["id"], timeout_s=180)["state"] == "succeeded"
        digests.append(pixel_digest(fleet.client.download(accepted["id"])))
    assert digests[0] != digests[1] and digests[0] == digests[2]
    edit = {"prompt": "make it blue", "steps": 2, "seed": 3, "image": image}
    edited = []
    for adapters in ([], [{"id": OTHER_ADAPTER, "scale": 2.0}]):
        accepted = fleet.client.submit(EDIT_MODEL, "edit", {**edit, "adapters": adapters}, target="server")
        job = fleet.client.wait(accepted["id"], timeout_s=180)
        assert job["state"] == "succeeded", job
        edited.append(pixel_digest(fleet.client.download(accepted["id"])))
    assert edited[0] != edited[1]
    assert job["provenance"]["adapters"][0]["id"] == OTHER_ADAPTER


def test_r13_placement_prices_the_adapter_load_it_measured(fleet: RunningFleet) -> None:
    """Before any measurement the guess is the adapter's bytes at the machine's load rate (48 KB:
    0 s at 3 decimals); a finished job teaches the measured load (R13), which the next decision
    adds to the finish on a warm base. A scale defaults to 1."""
    job, _ = run(fleet, {**BASE, "adapters": [{"id": ADAPTER}]})
    assert job["params"]["adapters"] == [{"id": ADAPTER, "scale": 1.0}]
    learned = wait_for(
        lambda: fleet.ctx.dispatcher.costs.estimator().learned.get(MACHINE, ADAPTER, "adapter"),
        timeout_s=30,
        what="the adapter's load time learned",
        poll_s=0.5,
    )
    assert learned.load_samples >= 1 and learned.load_s > 0.001, learned
    decision = post(fleet, {**BASE, "adapters": [{"id": ADAPTER}]}, dry_run=True)
    assert decision.status_code == 200, decision.text
    part = decision.json()["machines"][MACHINE]
    assert part["eligible"] and part["cold_load_s"] == 0 and part["adapter_load_s"] > 0.001, part
    plain = post(fleet, BASE, dry_run=True).json()["machines"][MACHINE]
    assert plain["adapter_load_s"] == 0
    assert part["finish_s"] > plain["finish_s"]


@pytest.mark.parametrize(
    ("adapters", "status", "reason", "param", "message"),
    [
        (
            [{"id": OTHER_ADAPTER, "scale": 1.0}],
            422,
            "adapter_family_mismatch",
            "params.adapters[0].id",
            f"params.adapters[0].id: adapter {OTHER_ADAPTER!r} is of family sd1-pix2pix, the model is of family sd1",
        ),
        (
            [{"id": "no-such-lora"}],
            422,
            "unknown_adapter",
            "params.adapters[0].id",
            "params.adapters[0].id 'no-such-lora' is not a registered adapter",
        ),
        (
            [{"id": "tiny-sd"}],
            422,
            "unknown_adapter",
            "params.adapters[0].id",
            "params.adapters[0].id 'tiny-sd' is not a registered adapter",
        ),  # a model is no adapter
        (
            [{"id": ADAPTER, "scale": 9}],
            422,
            "invalid_adapters",
            "params.adapters[0].scale",
            "params.adapters[0].scale must be a number from -4 to 4, got 9",
        ),
        (
            [{"id": ADAPTER}] * 5,
            422,
            "invalid_adapters",
            "params.adapters",
            "params.adapters holds 5 adapters; family sd1 takes at most 4 (max_adapters)",
        ),
    ],
)
def test_r22_a_bad_adapter_is_refused_naming_the_field(
    fleet: RunningFleet,
    adapters: list[dict[str, Any]],
    status: int,
    reason: str,
    param: str,
    message: str,
) -> None:
    response = post(fleet, {**BASE, "adapters": adapters})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert (error["reason"], error["param"]) == (reason, param), error
    assert error["message"].startswith(message), error["message"]


def test_r4_an_adapter_not_synced_to_the_target_is_refused_like_an_unverified_model(fleet: RunningFleet) -> None:
    response = post(fleet, {**BASE, "adapters": [{"id": ADAPTER}]}, target="m2")
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["reason"] == "model_not_verified"
    assert f"adapter {ADAPTER!r} is not verified on machine 'm2'; run `homefleet sync m2 {ADAPTER}`" in error["message"]
    # Auto skips m2 (and m3) for the same reason, and places it where the adapter is verified.
    machines = post(fleet, {**BASE, "adapters": [{"id": ADAPTER}]}, target="auto", dry_run=True).json()["machines"]
    assert machines["m2"]["reason"] == "model_not_verified" and machines["m1"]["eligible"]


def test_an_adapter_is_no_model_of_its_own(fleet: RunningFleet) -> None:
    response = post(fleet, {"prompt": "x"}, model=ADAPTER)
    assert response.status_code == 422, response.text
    assert response.json()["error"]["reason"] == "kind_not_supported"
    listed = {m["id"]: m for m in fleet.client.models()}
    assert listed[ADAPTER]["kinds"] == ["adapter"] and listed[ADAPTER]["family"] == "sd1"
    assert listed[ADAPTER]["params"] == {}


def test_r5_an_adapter_whose_copy_changed_fails_the_job_integrity_and_is_withdrawn(fleet: RunningFleet) -> None:
    """The worker hashes an adapter before every load: a copy rewritten in place (same size)
    fails the job ``integrity``, loads nothing and withdraws the adapter from m1 until it is
    synced again; the base model stays warm. Restored by a sync at the end (R6)."""
    ctx = fleet.ctx
    verified = ctx.keys.verified(MACHINE)
    # the adapter verified on m1 first (an earlier test's sync may still be reaching its heartbeat
    # on a starved host: a submission then is refused model_not_verified)
    wait_for(lambda: ADAPTER in ctx.redis.smembers(verified), timeout_s=120, what="m1 to verify the adapter")
    run(fleet, BASE)  # the base model warm on m1
    weights = fleet.local.models_dir(MACHINE) / ADAPTER / "pytorch_lora_weights.safetensors"
    original = weights.read_bytes()
    # mtime put back (same size, same inode) while m1's worker is stopped: the heartbeat's stat
    # check cannot see the change, so only the hash before the job's load can find it (C07),
    # whatever the host's load
    flip_keeping_stat(weights, -1, fleet.local.processes[f"worker-{MACHINE}"].pid)
    try:
        accepted = fleet.client.submit(fleet.model, "txt2img", {**BASE, "adapters": [{"id": ADAPTER}]}, target=MACHINE)
        job = fleet.client.wait(accepted["id"], timeout_s=120)
        assert (job["state"], job["reason"]) == ("failed", "integrity"), job
        assert f"model {ADAPTER} on {MACHINE} does not match the manifest" in job["message"]
        assert ADAPTER not in ctx.redis.smembers(verified) and fleet.model in ctx.redis.smembers(verified)
        refused = post(fleet, {**BASE, "adapters": [{"id": ADAPTER}]})
        assert refused.status_code == 422 and refused.json()["error"]["reason"] == "model_not_verified"
        again, _ = run(fleet, BASE)
        assert again["cold_load"] is False  # the failed adapter load left the base model warm
    finally:
        weights.unlink()  # a sync never overwrites a worker's file: the operator moves it away first
        synced = fleet.client.http.post(f"/v1/machines/{MACHINE}/sync", json={"models": [ADAPTER]})
        assert synced.status_code == 202, synced.text
        wait_for(lambda: ADAPTER in ctx.redis.smembers(verified), timeout_s=120, what="m1 to verify the synced adapter")
    assert weights.read_bytes() == original
