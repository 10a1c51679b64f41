"""R22: a LoRA made for a UNet of another cross-attention width than the model's is refused at
submission with a 422 naming ``params.adapters[i].id`` and both widths, before anything is
enqueued. SD 1.x (768) and SD 2.x (1024) share family ``sd1`` and their LoRAs' tensor names, so
registration (``--adapter-of sd1``) takes either; loaded on the other base, diffusers would fail
the job on the device with a shape mismatch. Real Redis, real journal, the real ASGI app, real
files (a LoRA in kohya's layout as downloaded, made for an SD 1.x UNet, and one made with peft
for the tiny model's own UNet); no worker runs."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient
from safetensors.numpy import save_file
from sqlmodel import Session, col, select

from app.context import ServerContext
from app.core.config import Settings
from app.core.states import JobState
from app.db.tables import Job
from app.devtools.tiny_models import make_tiny_lora
from tests.helpers import api_with_copies, bring_online

MODEL, OWN, SD15, SELF = "tiny-sd", "tiny-sd-lora", "sd15-style-lora", "sd15-self-attention-lora"
KOHYA_BLOCK = "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn2_to_"


def sd15_kohya_lora(path: Path, rank: int = 4) -> Path:
    """A kohya-layout LoRA of an SD 1.x UNet's first cross-attention key and value projections
    (input width 768, CLIP ViT-L's hidden size; output 320, the first block's channels)."""
    tensors: dict[str, np.ndarray] = {}
    for projection in ("k", "v"):
        tensors[f"{KOHYA_BLOCK}{projection}.lora_down.weight"] = np.full((rank, 768), 0.01, dtype=np.float16)
        tensors[f"{KOHYA_BLOCK}{projection}.lora_up.weight"] = np.full((320, rank), 0.01, dtype=np.float16)
        tensors[f"{KOHYA_BLOCK}{projection}.alpha"] = np.array(rank, dtype=np.float16)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path))
    return path


SELF_BLOCK = "lora_unet_down_blocks_1_attentions_0_transformer_blocks_0_attn1_to_q"


def self_attention_lora(path: Path, rank: int = 4) -> Path:
    """A kohya-layout LoRA of one self-attention query projection of an SD 1.x UNet's second
    block (640 wide): it says nothing of the text encoder's width, only of its own module's."""
    tensors = {
        f"{SELF_BLOCK}.lora_down.weight": np.full((rank, 640), 0.01, dtype=np.float16),
        f"{SELF_BLOCK}.lora_up.weight": np.full((640, rank), 0.01, dtype=np.float16),
        f"{SELF_BLOCK}.alpha": np.array(rank, dtype=np.float16),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path))
    return path


@pytest.fixture
def api(settings: Settings, tiny_models_dir: Path, tmp_path: Path) -> Iterator[tuple[TestClient, ServerContext]]:
    with api_with_copies(settings, tiny_models_dir / MODEL, MODEL) as (client, ctx):
        ctx.registry.add(make_tiny_lora(tiny_models_dir / MODEL, tmp_path / OWN), OWN, adapter_of="sd1")
        ctx.registry.add(sd15_kohya_lora(tmp_path / "downloads" / "sd15-style.safetensors"), SD15, adapter_of="sd1")
        ctx.registry.add(self_attention_lora(tmp_path / "downloads" / "sd15-self.safetensors"), SELF, adapter_of="sd1")
        for machine in ("server", "m1"):
            bring_online(ctx, machine, {MODEL, OWN, SD15, SELF})
        yield client, ctx


def submit(client: TestClient, adapters: list[dict[str, Any]]) -> Any:
    params = {"prompt": "a cat", "steps": 2, "width": 32, "height": 32, "adapters": adapters}
    return client.post("/v1/jobs", json={"model": MODEL, "kind": "txt2img", "target": "auto", "params": params})


def journaled(ctx: ServerContext) -> list[tuple[JobState, str | None]]:
    """Every job in the journal: (state, reason), in submission order."""
    with Session(ctx.engine) as session:
        return [(j.state, j.reason) for j in session.exec(select(Job).order_by(col(Job.created_at))).all()]


def queued(ctx: ServerContext) -> int:
    """Jobs waiting in the machines' lines (R8)."""
    return sum(int(ctx.redis.llen(ctx.keys.queue_list(machine))) for machine in ("server", "m1"))


def test_r22_a_lora_of_another_cross_attention_width_is_refused_naming_both_widths(
    api: tuple[TestClient, ServerContext],
) -> None:
    client, ctx = api
    refused = submit(client, [{"id": OWN}, {"id": SD15, "scale": 0.8}])
    assert refused.status_code == 422, refused.text
    error = refused.json()["error"]
    assert (error["reason"], error["param"]) == ("adapter_base_mismatch", "params.adapters[1].id")
    assert error["message"] == (
        f"params.adapters[1].id: adapter {SD15!r} was made for a UNet of cross-attention width 768 (SD 1.x); "
        f"model {MODEL!r} attends at width 32 (cross_attention_dim in its unet/config.json); use an adapter "
        "made for the model's base"
    )
    assert journaled(ctx) == [(JobState.rejected, "adapter_base_mismatch")]  # the refusal keeps its reason
    assert queued(ctx) == 0  # nothing enqueued

    dry = client.post(
        "/v1/jobs?dry_run=true",
        json={"model": MODEL, "kind": "txt2img", "target": "m1", "params": {"prompt": "x", "adapters": [{"id": SD15}]}},
    )
    assert dry.status_code == 422 and dry.json()["error"]["reason"] == "adapter_base_mismatch", dry.text

    accepted = submit(client, [{"id": OWN, "scale": 0.5}])  # made for this UNet: its width is the model's
    assert accepted.status_code == 202, accepted.text
    assert [state for state, _ in journaled(ctx)][1:] == [JobState.queued] and queued(ctx) == 1


def test_on_the_openai_route_the_message_names_the_field_as_its_param_does(
    api: tuple[TestClient, ServerContext],
) -> None:
    """An OpenAI request's job params are its top-level fields: ``param`` is ``adapters[0].id``,
    and so is the field the message starts with (not ``params.adapters[0].id``)."""
    client, _ = api
    answer = client.post(
        "/v1/images/generations",
        json={"prompt": "a cat", "model": MODEL, "size": "32x32", "adapters": [{"id": SD15}]},
    )
    assert answer.status_code == 400, answer.text  # OpenAI's status on its route
    error = answer.json()["error"]
    assert (error["code"], error["param"]) == ("adapter_base_mismatch", "adapters[0].id")
    assert error["message"].startswith(f"adapters[0].id: adapter {SD15!r} was made for a UNet"), error["message"]
    assert "params." not in error["message"]


def test_r22_a_lora_whose_module_widths_are_not_the_model_s_is_refused_naming_tensor_and_module(
    api: tuple[TestClient, ServerContext],
) -> None:
    """A LoRA of self-attention only carries no cross-attention width; each tensor is checked
    against the module of the model's own weights it adapts (their headers only)."""
    client, ctx = api
    refused = submit(client, [{"id": SELF}])
    assert refused.status_code == 422, refused.text
    error = refused.json()["error"]
    assert (error["reason"], error["param"]) == ("adapter_base_mismatch", "params.adapters[0].id")
    assert error["message"] == (
        f"params.adapters[0].id: adapter {SELF!r} does not fit model {MODEL!r}: its {SELF_BLOCK}.lora_down.weight "
        "is [4, 640], for inputs of width 640, where the model's unet "
        "down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q has 64 (weight [64, 64]); use an adapter made "
        "for the model's base"
    )
    assert queued(ctx) == 0


def test_r22_a_lora_that_adapts_modules_the_model_lacks_is_refused_not_applied_in_part(
    api: tuple[TestClient, ServerContext], tmp_path: Path
) -> None:
    """The tiny LoRA of this very model with tensors added for a block its UNet does not have
    (a deeper base's): diffusers would load the rest and skip those without a word."""
    from safetensors.torch import load_file
    from safetensors.torch import save_file as save_torch

    client, ctx = api
    own = load_file(str(ctx.registry.folder(OWN) / "pytorch_lora_weights.safetensors"))
    deeper = {**own}
    for key, tensor in own.items():
        if key.startswith("unet.down_blocks.1."):
            deeper[key.replace("unet.down_blocks.1.", "unet.down_blocks.7.")] = tensor.clone()
    path = tmp_path / "deeper.safetensors"
    save_torch(deeper, str(path))
    ctx.registry.add(path, "deeper-lora", adapter_of="sd1")
    bring_online(ctx, "server", {MODEL, OWN, SD15, SELF, "deeper-lora"})
    bring_online(ctx, "m1", {MODEL, OWN, SD15, SELF, "deeper-lora"})
    refused = submit(client, [{"id": "deeper-lora"}])
    assert refused.status_code == 422, refused.text
    error = refused.json()["error"]
    assert (error["reason"], error["param"]) == ("adapter_base_mismatch", "params.adapters[0].id")
    first = min(k for k in deeper if k.startswith("unet.down_blocks.7."))
    module = first.removeprefix("unet.").split(".lora", 1)[0]
    assert error["message"] == (
        f"params.adapters[0].id: adapter 'deeper-lora' does not fit model {MODEL!r}: its {first} adapts {module}, "
        "a module the model's unet does not have; diffusers would apply the rest of it and leave that out without "
        "a word; use an adapter made for the model's base"
    )


def test_r22_get_models_names_the_adapters_that_fit_each_model_as_the_submission_check_judges(
    api: tuple[TestClient, ServerContext],
) -> None:
    """``GET /v1/models`` gives a model the registered adapters of its family that the submission
    check lets it load (the fleet page's Submit form offers only these), an adapter none; the
    openai SDK's shape is kept (``client.models.list()`` reads it). Of the three ``sd1`` adapters
    only the one made for this UNet fits: a submission naming any other is the 422 above."""
    client, _ = api
    listed = client.get("/v1/models")
    assert listed.status_code == 200, listed.text
    models = {m["id"]: m for m in listed.json()["data"]}
    assert models[MODEL]["adapters"] == [OWN]
    assert all(models[adapter]["adapters"] is None for adapter in (OWN, SD15, SELF))
    one = client.get(f"/v1/models/{MODEL}")
    assert one.status_code == 200 and one.json()["adapters"] == [OWN], one.text
    for adapter in {SD15, SELF}:
        refused = submit(client, [{"id": adapter}])
        assert refused.json()["error"]["reason"] == "adapter_base_mismatch", refused.text
