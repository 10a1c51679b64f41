"""A model registered from a Hugging Face cache laid out as the real repository is (R1, R4, R6;
docs/operations.md, "What registration takes"), end to end on real ``celery worker`` processes:
the SD 1.5 replica (app/devtools/replicas.py) registered ``--precision fp16 --from-hf-cache``
holds only the fp16 files the pipeline loads; a sync copies exactly those to a worker, which
loads them with diffusers' ``variant="fp16"`` and runs a txt2img job.

Fleet of this module: ``server`` and ``m1``.
"""

from __future__ import annotations

import io
from collections.abc import Iterator

import pytest

from app.client import HomefleetClient
from app.context import ServerContext, build_context
from app.devtools.localfleet import LocalFleet
from app.devtools.replicas import Replica, as_hf_cache, make_replica
from tests.helpers import TEST_API_KEY, fleet_files, run_cli

pytestmark = pytest.mark.e2e

MODEL = "stable-diffusion-v1-5"


@pytest.fixture(scope="module")
def fleet(
    tmp_path_factory: pytest.TempPathFactory, redis_base_url: str
) -> Iterator[tuple[LocalFleet, ServerContext, HomefleetClient, dict[str, str], Replica]]:
    data_dir = tmp_path_factory.mktemp("layoutfleet")
    replica = make_replica("sd15", data_dir / "downloads")
    hub = data_dir / "hf" / "hub"
    as_hf_cache(replica, hub)
    files = fleet_files(data_dir, f"{redis_base_url}/13", "m1")
    config, fleet_file, settings = files.config, files.fleet_file, files.settings
    env: dict[str, str | None] = {
        **files.operator,
        "HF_HOME": str(data_dir / "hf"),
        "HF_HUB_CACHE": None,
        "HF_HUB_OFFLINE": "1",
    }
    local = LocalFleet(settings, config, fleet_file, forkserver=True)
    ctx = build_context(settings, config, migrate=True)
    client = HomefleetClient(local.api_url, api_key=TEST_API_KEY)
    try:
        done = run_cli("models", "add", "--from-hf-cache", replica.repo_id, "--precision", "fp16", env=env)
        assert f"registered {MODEL} family=sd1" in done.stdout, done.stdout
        local.start_api()
        for machine in ("server", "m1"):
            local.start_worker(machine)
        local.wait_online(["server", "m1"], timeout_s=120)
        yield local, ctx, client, env, replica
    finally:
        client.close()
        local.stop()
        ctx.close()


def test_r6_an_fp16_model_from_the_hf_cache_syncs_only_its_taken_files_and_generates(  # type: ignore[no-untyped-def]
    fleet,
) -> None:
    local, ctx, client, env, replica = fleet
    expected = replica.expected["fp16"]
    record = ctx.registry.get(MODEL)
    assert (record.source_format, record.precision) == ("hf-cache", "fp16")
    assert {f.path for f in ctx.registry.manifest(MODEL).files} == set(expected)

    done = run_cli("sync", "m1", MODEL, env={**env, "COLUMNS": "80"}, timeout_s=180)
    assert "succeeded" in done.stdout, done.stdout
    again = run_cli("sync", "m1", MODEL, env={**env, "COLUMNS": "80"}, timeout_s=180)
    # the bar counts what is downloaded; a re-sync finds every byte there and says so
    assert "bytes were already" not in done.stdout and "0/0 bytes" in again.stdout, again.stdout
    assert f"{record.total_bytes} bytes were already on m1: not downloaded" in again.stdout
    bars = [line for line in (done.stdout + again.stdout).splitlines() if "━" in line]
    assert len(bars) == 2 and all(len(line) <= 80 for line in bars), (
        bars
    )  # the terminal's width (piped text is not cut)
    copied = local.models_dir("m1") / MODEL
    assert {p.relative_to(copied).as_posix() for p in copied.rglob("*") if p.is_file()} == set(expected)
    assert (copied / "unet/diffusion_pytorch_model.fp16.safetensors").read_bytes() == (
        replica.folder / "unet/diffusion_pytorch_model.fp16.safetensors"
    ).read_bytes()
    assert sum(p.stat().st_size for p in copied.rglob("*") if p.is_file()) == record.total_bytes

    job = client.submit(
        MODEL, "txt2img", {"prompt": "a red square", "steps": 2, "width": 64, "height": 64}, target="m1"
    )
    finished = client.wait(job["id"], timeout_s=180)
    assert finished["state"] == "succeeded", finished
    assert finished["machine"] == "m1"
    from PIL import Image

    with Image.open(io.BytesIO(client.download(job["id"]))) as image:
        assert image.size == (64, 64)
        assert len(set(image.convert("RGB").getdata())) > 1  # pixels, not a blank picture


def test_r4_models_add_returns_once_the_server_machine_verified_the_model(  # type: ignore[no-untyped-def]
    fleet,
) -> None:
    """The ``server`` machine's worker reads the registry's folder: ``models add`` waits until it
    has verified the new model and says so, and what other machines need, so a job submitted
    next runs there (it was refused ``model_not_verified``, advising a sync that had nothing to
    copy)."""
    _, _, client, env, replica = fleet
    done = run_cli(
        "models", "add", "--from-hf-cache", replica.repo_id, "--precision", "fp16", "--id", "second-copy", env=env
    )
    assert "verified on machine server: jobs can run it there now; other machines get it with" in done.stdout
    assert "`homefleet sync MACHINE second-copy`" in done.stdout, done.stdout
    job = client.submit(
        "second-copy", "txt2img", {"prompt": "a red square", "steps": 1, "width": 64, "height": 64}, target="server"
    )
    assert client.wait(job["id"], timeout_s=180)["state"] == "succeeded"
