"""A residency commitment that can never be resident is refused (R16): the committed
models' weights (each priced as its variant loads) plus the working memory of the largest job
they must still run must fit the machine's usable memory, else ``PUT
/v1/machines/{m}/residency`` answers 422 ``commitment_too_large`` naming the figures. Real Redis
and journal, the API in-process."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from app.api.server import create_app
from app.context import ServerContext, build_context
from app.core.config import Settings
from app.core.secret_files import write_private
from app.fleet.config import load_fleet
from routing.estimate import readable_bytes
from tests.helpers import bring_online, make_fleet

MODEL, EDIT_MODEL = "tiny-sd", "tiny-pix2pix"
SMALL_BYTES = 2_000_000_000  # m1
WORKING = """
[working_memory.txt2img]
base_bytes = 1_500_000_000
bytes_per_pixel = 0.0

[working_memory.edit]
base_bytes = 1_994_000_000
bytes_per_pixel = 0.0
"""


@pytest.fixture
def api(settings: Settings, tiny_models_dir: Path, tmp_path: Path) -> Iterator[tuple[TestClient, ServerContext]]:
    machines = make_fleet("m1")
    machines.machines["m1"] = machines.machines["m1"].model_copy(update={"memory_bytes": SMALL_BYTES})
    fleet_file = tmp_path / "fleet.toml"
    write_private(fleet_file, machines.to_toml() + WORKING)
    ctx = build_context(settings, load_fleet(fleet_file), migrate=True)
    for model_id in (MODEL, EDIT_MODEL):
        ctx.registry.add(tiny_models_dir / model_id, model_id)
    for name in ("server", "m1"):
        bring_online(ctx, name, {MODEL, EDIT_MODEL})
    with TestClient(create_app(settings, ctx), headers={"Authorization": f"Bearer {settings.api_keys[0]}"}) as client:
        yield client, ctx


def test_r16_a_commitment_that_fits_beside_its_largest_job_is_kept(api: tuple[TestClient, ServerContext]) -> None:
    client, _ = api
    answer = client.put("/v1/machines/m1/residency", json={"models": [MODEL]})  # 1.5 GB working + MBs < 2 GB
    assert answer.status_code == 200, answer.text
    assert client.get("/v1/machines/m1/residency").json()["models"] == [MODEL]


def test_r16_a_commitment_that_cannot_fit_beside_its_largest_job_is_refused_naming_the_figures(
    api: tuple[TestClient, ServerContext],
) -> None:
    client, ctx = api
    answer = client.put("/v1/machines/m1/residency", json={"models": [MODEL, EDIT_MODEL]})
    assert answer.status_code == 422, answer.text
    error = answer.json()["error"]
    assert error["reason"] == "commitment_too_large"
    weights = {m: ctx.registry.weights_bytes(m) for m in (EDIT_MODEL, MODEL)}
    need = sum(weights.values()) + 1_994_000_000  # the edit job is the largest
    assert need > SMALL_BYTES > 1_994_000_000 + weights[EDIT_MODEL]
    assert (
        f"the largest job they must still run ({EDIT_MODEL} edit at its default size: "
        f"{readable_bytes(1_994_000_000)}) need {readable_bytes(need)}, and 'm1' has "
        f"{readable_bytes(SMALL_BYTES)} usable"
    ) in error["message"]
    assert f"{MODEL} {readable_bytes(weights[MODEL])}" in error["message"]
    assert client.get("/v1/machines/m1/residency").json()["models"] == []  # nothing written
    # the edit model alone fits beside its own job: the other model's weights decided
    assert client.put("/v1/machines/m1/residency", json={"models": [EDIT_MODEL]}).status_code == 200
    assert client.put("/v1/machines/server/residency", json={"models": [MODEL, EDIT_MODEL]}).status_code == 200  # 4 GB
