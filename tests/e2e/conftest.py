"""Real local fleets for end-to-end tests, each shared by the whole session (started by the
first test that asks for it):

- ``fleet``: the API (``homefleet serve``) and real ``celery worker`` processes (``homefleet
  worker``) for machines server, m1 and m2, each with its own model folder and token. Machine
  m3 is in the fleet config but has no worker. A test that stops a worker starts it again.
  Two tiny LoRA adapters are registered (tests/e2e/test_adapters.py): ``ADAPTER``
  (family sd1, on server and m1, not m2) and ``OTHER_ADAPTER`` (family sd1-pix2pix), and the
  trained demo adapter ``shapes-blue-lora`` of ``shapes-filled`` (on m2, with the shapes models);
  ``KOHYA_ADAPTER`` is ``ADAPTER``'s tensors in one kohya-layout file, registered as downloaded.
- ``models_fleet``: the API and ONE worker, machine m1, holding a tiny pipeline of every
  family the registry accepts (tests/e2e/test_kinds.py and test_families.py, one xdist group).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from app.client import HomefleetClient
from app.context import ServerContext, build_context
from app.core.families import FAMILIES
from app.core.limits import KeyQuota, key_id
from app.core.lora_files import LORA_WEIGHTS
from app.devtools.kohya_lora import to_kohya_lora
from app.devtools.localfleet import LocalFleet
from app.devtools.tiny_models import TINY_MODELS, make_tiny_lora
from app.devtools.train_colour_lora import COLOUR_LORA
from app.devtools.train_recolour import RECOLOUR_MODEL
from app.devtools.train_shapes import DEMO_MODELS_DIR, MODEL_NAMES
from app.fleet.config import WebhookConfig
from tests.helpers import TEST_API_KEY, TEST_WEBHOOK_SECRET, fleet_files, make_fleet, run_cli

MODEL = "tiny-sd"
EDIT_MODEL = "tiny-pix2pix"
UPSCALE_MODEL = "tiny-upscaler"
WORKERS = ("server", "m1", "m2")
#: an API key of the session fleet under a quota: one job queued or running at once, 0.05
#: GPU-seconds an hour (any real job spends more)
QUOTA_KEY = "quota-e2e-key-0123456789"
QUOTA_NAME = "e2e-quota"
#: the trained demo models (filled and outlined shapes, the recolouring edit model),
#: registered from their committed folders and copied to SHAPES_MACHINE only
#: (tests/e2e/test_shapes_content.py)
SHAPE_MODELS = (*MODEL_NAMES.values(), RECOLOUR_MODEL)
SHAPES_MACHINE = "m2"
#: tiny random LoRA adapters: ADAPTER of tiny-sd's UNet, copied to ADAPTER_MACHINES
#: only; OTHER_ADAPTER of tiny-pix2pix's (another family), on the server only
ADAPTER = "tiny-sd-lora"
OTHER_ADAPTER = "tiny-pix2pix-lora"
ADAPTER_MACHINES = ("server", "m1")
#: ADAPTER's tensors under kohya's names in one .safetensors file (app/devtools/kohya_lora.py), on ADAPTER_MACHINES
KOHYA_ADAPTER = "tiny-sd-lora-kohya"


@dataclass
class RunningFleet:
    local: LocalFleet
    ctx: ServerContext
    client: HomefleetClient
    model: str


@pytest.fixture(scope="session")
def fleet(
    tmp_path_factory: pytest.TempPathFactory, redis_base_url: str, tiny_models_dir: Path
) -> Iterator[RunningFleet]:
    # webhooks to this host only, signed with TEST_WEBHOOK_SECRET (test_job_way.py)
    fleet_config = make_fleet("m1", "m2", "m3").model_copy(
        update={"webhooks": WebhookConfig(allow_hosts=["127.0.0.1"])}
    )
    files = fleet_files(
        tmp_path_factory.mktemp("fleet"),
        f"{redis_base_url}/0",
        config=fleet_config,
        api_keys=[TEST_API_KEY, QUOTA_KEY],
        webhook_secrets={key_id({}, TEST_API_KEY): TEST_WEBHOOK_SECRET},
        webhook_backoff_s=0.2,
        # a second key under a quota (tests/e2e/test_job_way.py); TEST_API_KEY has none
        api_key_quotas={QUOTA_NAME: KeyQuota(key_prefix=QUOTA_KEY, max_queued_jobs=1, max_gpu_seconds_per_hour=0.05)},
    )
    settings, fleet_file, data_dir = files.settings, files.fleet_file, files.settings.data_dir
    # The journal created and the models registered through the CLI, as an operator does.
    operator = files.operator
    run_cli("db", "upgrade", env=operator)
    for model in (MODEL, EDIT_MODEL):  # the edit model lives on `server` only
        run_cli("models", "add", str(tiny_models_dir / model), "--id", model, env=operator)
    for model in SHAPE_MODELS:  # with the demo's own defaults (app/devtools/demo.py MODEL_DEFAULTS)
        sized = () if model == RECOLOUR_MODEL else ("--default", "width=32", "--default", "height=32")  # trained at 32
        run_cli(
            "models",
            "add",
            str(DEMO_MODELS_DIR / model),
            "--id",
            model,
            "--default",
            "guidance_scale=4",
            *sized,
            env=operator,
        )
    adapters = data_dir / "adapters"
    lora = make_tiny_lora(tiny_models_dir / MODEL, adapters / ADAPTER)
    run_cli("models", "add", str(lora), "--id", ADAPTER, "--adapter-of", "sd1", env=operator)
    local = LocalFleet(settings, fleet_config, fleet_file, forkserver=True)
    ctx = build_context(settings, fleet_config, migrate=True)
    ctx.registry.add(
        make_tiny_lora(tiny_models_dir / EDIT_MODEL, adapters / OTHER_ADAPTER, seed=1),
        OTHER_ADAPTER,
        adapter_of="sd1-pix2pix",
    )
    ctx.registry.add(DEMO_MODELS_DIR / COLOUR_LORA, COLOUR_LORA, adapter_of="sd1")
    ctx.registry.add(tiny_models_dir / UPSCALE_MODEL, UPSCALE_MODEL)  # on no machine: the page's forms offer it
    ctx.registry.add(
        to_kohya_lora(lora / LORA_WEIGHTS, adapters / f"{KOHYA_ADAPTER}.safetensors"), KOHYA_ADAPTER, adapter_of="sd1"
    )
    client = HomefleetClient(local.api_url, api_key=TEST_API_KEY)
    try:
        for machine in WORKERS:
            local.copy_model(MODEL, machine)
        for model in (*SHAPE_MODELS, COLOUR_LORA):
            local.copy_model(model, SHAPES_MACHINE)
        for machine in ADAPTER_MACHINES:
            local.copy_model(ADAPTER, machine)
            local.copy_model(KOHYA_ADAPTER, machine)
        local.start_api()
        for machine in WORKERS:
            local.start_worker(machine)
        local.wait_online(list(WORKERS), model_id=MODEL, timeout_s=120)
        for model in (*SHAPE_MODELS, COLOUR_LORA):
            local.wait_online([SHAPES_MACHINE], model_id=model, timeout_s=120)
        local.wait_online(list(ADAPTER_MACHINES), model_id=ADAPTER, timeout_s=120)
        local.wait_online(list(ADAPTER_MACHINES), model_id=KOHYA_ADAPTER, timeout_s=120)
        yield RunningFleet(local, ctx, client, MODEL)
    finally:
        client.close()
        local.stop()
        ctx.close()


MODELS_MACHINE = "m1"


@dataclass
class ModelsFleet:
    local: LocalFleet
    ctx: ServerContext
    client: HomefleetClient


@pytest.fixture(scope="session")
def models_fleet(
    tmp_path_factory: pytest.TempPathFactory, redis_base_url: str, tiny_families_dir: Path
) -> Iterator[ModelsFleet]:
    """Machine m1 alone, with every tiny family's pipeline (``app.devtools.tiny_models.TINY_MODELS``:
    the model id is the folder name) copied, verified and advertised; Redis database 7."""
    fleet_config = make_fleet(MODELS_MACHINE, families=frozenset(FAMILIES))
    files = fleet_files(tmp_path_factory.mktemp("models-fleet"), f"{redis_base_url}/7", config=fleet_config)
    settings, fleet_file = files.settings, files.fleet_file
    ctx = build_context(settings, fleet_config, migrate=True)
    for model_id in TINY_MODELS:
        ctx.registry.add(tiny_families_dir / model_id, model_id=model_id)
    local = LocalFleet(settings, fleet_config, fleet_file, forkserver=True)
    client = HomefleetClient(local.api_url, api_key=TEST_API_KEY)
    try:
        for model_id in TINY_MODELS:
            local.copy_model(model_id, MODELS_MACHINE)
        local.start_api()
        local.start_worker(MODELS_MACHINE)
        for model_id in TINY_MODELS:
            local.wait_online([MODELS_MACHINE], model_id=model_id, timeout_s=120)
        yield ModelsFleet(local, ctx, client)
    finally:
        client.close()
        local.stop()
        ctx.close()
