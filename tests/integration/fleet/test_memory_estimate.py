"""Per-job memory estimate (R10, R11; docs/design.md, "Residency"): exact weights from the safetensors files plus
working memory from the fleet config's coefficients, journaled at submission, shown by
``GET /v1/jobs/{id}``, and the figure placement's memory filter refuses ``too_large`` with.
Real Redis and journal (SQLite and PostgreSQL); the fleet config is a TOML file."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from app.api.server import create_app
from app.context import ServerContext, build_context
from app.core.config import Settings
from app.core.secret_files import write_private
from app.fleet.config import load_fleet
from routing.estimate import readable_bytes
from tasks.pipelines import load_pipeline
from tests.helpers import bring_online, held_bytes, make_fleet, png

MODEL = "tiny-sd"
PIXELS = 64 * 64
BASE_BYTES = 1_000_000_000
PER_PIXEL = 300.0
SMALL_BYTES = 2_000_000_000  # machine m1: room for BASE_BYTES + the tiny weights, not for the override
FLEET_COEFFICIENTS = f"""
[working_memory.txt2img]
base_bytes = {BASE_BYTES}
bytes_per_pixel = {PER_PIXEL}
"""
FAMILY_OVERRIDE = """
[families.sd1.working_memory.txt2img]
bytes_per_pixel = 500000.0
"""

Api = Callable[[str], tuple[TestClient, ServerContext]]


def loaded_weight_bytes(folder: Path, precision: str = "fp32") -> int:
    """The bytes the model's pipeline holds, loaded by the worker's loader at ``precision``
    (tests/helpers.py ``held_bytes``: every parameter and buffer)."""
    return sum(held_bytes(load_pipeline(folder, precision)).values())


@pytest.fixture
def api(settings: Settings, tiny_models_dir: Path, tmp_path: Path) -> Iterator[Api]:
    """``api(extra_toml)``: the API over a fleet config file of server + m1 (2 GB usable) + ``extra_toml``."""
    opened: list[tuple[TestClient, ServerContext]] = []

    def start(extra: str) -> tuple[TestClient, ServerContext]:
        machines = make_fleet("m1")
        machines.machines["m1"] = machines.machines["m1"].model_copy(update={"memory_bytes": SMALL_BYTES})
        fleet_file = tmp_path / f"fleet-{len(opened)}.toml"
        write_private(fleet_file, machines.to_toml() + extra)
        fleet = load_fleet(fleet_file)
        ctx = build_context(settings, fleet, migrate=True)
        if MODEL not in {r.id for r in ctx.registry.list()}:
            ctx.registry.add(tiny_models_dir / MODEL, MODEL)
        for name in ("server", "m1"):
            bring_online(ctx, name, {MODEL})
        client = TestClient(create_app(settings, ctx), headers={"Authorization": f"Bearer {settings.api_keys[0]}"})
        client.__enter__()
        opened.append((client, ctx))
        return client, ctx

    try:
        yield start
    finally:
        for client, _ in opened:
            client.__exit__(None, None, None)


def submit(client: TestClient, target: str) -> dict:
    answer = client.post(
        "/v1/jobs",
        json={
            "model": MODEL,
            "kind": "txt2img",
            "target": target,
            "params": {"prompt": "x", "width": 64, "height": 64},
        },
    )
    return {"status": answer.status_code, **answer.json()}


def test_r10_job_record_shows_weights_from_the_headers_and_configured_working_bytes(
    api: Api, tiny_models_dir: Path
) -> None:
    client, ctx = api(FLEET_COEFFICIENTS)
    weights = loaded_weight_bytes(tiny_models_dir / MODEL)
    accepted = submit(client, "m1")
    assert accepted["status"] == 202, accepted
    shown = client.get(f"/v1/jobs/{accepted['id']}").json()["memory_estimate"]
    working = BASE_BYTES + int(PER_PIXEL * PIXELS)
    assert shown == {"weights_bytes": weights, "working_bytes": working, "total_bytes": weights + working}
    journaled = ctx.journal.get(accepted["id"])
    assert (journaled.weights_bytes, journaled.working_bytes, journaled.memory_estimate_bytes) == (
        weights,
        working,
        weights + working,
    )


def test_r10_r11_family_override_raises_the_estimate_and_refuses_too_large(api: Api, tiny_models_dir: Path) -> None:
    client, _ = api(FLEET_COEFFICIENTS + FAMILY_OVERRIDE)  # tiny-sd is family sd1
    weights = loaded_weight_bytes(tiny_models_dir / MODEL)
    need = weights + BASE_BYTES + 500_000 * PIXELS  # 3.05 GB > m1's 2 GB
    refused = submit(client, "m1")
    assert (refused["status"], refused["error"]["reason"]) == (422, "too_large")
    assert f"needs an estimated {readable_bytes(need)}" in refused["error"]["message"]
    assert "'m1' has 1.9 GiB usable" in refused["error"]["message"]
    assert f"+ working memory {readable_bytes(need - weights)})" in refused["error"]["message"]  # the figures
    assert refused["error"]["message"].endswith("the working memory tips it over")  # and which one decided
    decision = client.post(
        "/v1/jobs?dry_run=true",
        json={
            "model": MODEL,
            "kind": "txt2img",
            "target": "auto",
            "params": {"prompt": "x", "width": 64, "height": 64},
        },
    ).json()
    assert decision["machines"]["m1"]["reason"] == "too_large" and decision["machine"] == "server"
    assert "working memory tips it over" in decision["machines"]["m1"]["message"]  # the dry run shows it too
    accepted = submit(client, "server")  # 4 GB: still fits there, priced with the override
    assert accepted["status"] == 202, accepted
    assert client.get(f"/v1/jobs/{accepted['id']}").json()["memory_estimate"]["total_bytes"] == need


@pytest.mark.parametrize(
    ("model", "kind", "input_px", "output_px"),
    [
        ("tiny-pix2pix", "edit", (96, 64), (96, 64)),  # an edit keeps its input's size
        ("tiny-upscaler", "upscale", (24, 16), (96, 64)),  # the x4 upscaler: 4 x width, 4 x height
    ],
)
def test_r10_input_kinds_are_priced_by_their_output_pixels(
    api: Api, tiny_models_dir: Path, model: str, kind: str, input_px: tuple[int, int], output_px: tuple[int, int]
) -> None:
    coefficients = f"""
[working_memory.{kind}]
base_bytes = {BASE_BYTES}
bytes_per_pixel = {PER_PIXEL}
"""
    client, ctx = api(coefficients)
    ctx.registry.add(tiny_models_dir / model, model)
    bring_online(ctx, "server", {MODEL, model})
    uploaded = client.post("/v1/files", files={"file": ("in.png", png(*input_px), "image/png")})
    assert uploaded.status_code == 201, uploaded.text
    answer = client.post(
        "/v1/jobs",
        json={
            "model": model,
            "kind": kind,
            "target": "server",
            "params": {"prompt": "make it snowy", "image": uploaded.json()["id"]},
        },
    )
    assert answer.status_code == 202, answer.text
    job = client.get(f"/v1/jobs/{answer.json()['id']}").json()
    width, height = output_px
    assert (job["params"]["output_width"], job["params"]["output_height"]) == (width, height)
    assert job["memory_estimate"]["working_bytes"] == BASE_BYTES + int(PER_PIXEL * width * height)


def test_r22_an_upscale_whose_output_exceeds_max_pixels_is_refused_naming_the_image(
    api: Api, tiny_models_dir: Path
) -> None:
    client, ctx = api("")
    ctx.registry.add(tiny_models_dir / "tiny-upscaler", "tiny-upscaler")
    bring_online(ctx, "server", {MODEL, "tiny-upscaler"})
    uploaded = client.post("/v1/files", files={"file": ("in.png", png(264, 256), "image/png")}).json()
    answer = client.post(
        "/v1/jobs",
        json={"model": "tiny-upscaler", "kind": "upscale", "target": "server", "params": {"image": uploaded["id"]}},
    )
    assert answer.status_code == 422, answer.text
    error = answer.json()["error"]
    assert error["reason"] == "invalid_size"
    assert error["message"] == (
        "params.image: the output would be 1056 x 1024 = 1081344 pixels; the limit (max_pixels) "
        "is 1048576; send a smaller image"
    )


@pytest.mark.parametrize(("precision", "quantization", "share"), [("bf16", None, 0.5), ("fp16", None, 0.5)])
def test_r10_a_variant_is_priced_by_what_it_occupies_loaded_not_by_its_files(
    api: Api, tiny_models_dir: Path, precision: str, quantization: str | None, share: float
) -> None:
    """The same fp32 files registered as a bf16/fp16 variant are priced at half the
    bytes (the weights are loaded in that dtype), so placement no longer refuses a variant as
    too large at its full-precision size."""
    client, ctx = api(FLEET_COEFFICIENTS)
    variant = f"tiny-sd-{precision}"
    ctx.registry.add(tiny_models_dir / MODEL, variant, precision=precision, quantization=quantization)
    bring_online(ctx, "m1", {MODEL, variant})
    full = loaded_weight_bytes(tiny_models_dir / MODEL)  # fp32
    answer = client.post(
        "/v1/jobs",
        json={
            "model": variant,
            "kind": "txt2img",
            "target": "m1",
            "params": {"prompt": "x", "width": 64, "height": 64},
        },
    )
    assert answer.status_code == 202, answer.text
    shown = client.get(f"/v1/jobs/{answer.json()['id']}").json()["memory_estimate"]
    assert (
        shown["weights_bytes"]
        == loaded_weight_bytes(tiny_models_dir / MODEL, precision)
        == ctx.registry.weights_bytes(variant)
    )
    assert shown["weights_bytes"] == pytest.approx(full * share, rel=0.001)  # int64 position ids aside: half
    assert ctx.dispatcher.costs.model_profiles()[MODEL].weights_bytes == full  # the fp32 registration
