"""R21 for text: an ``oom`` a worker reports for a text job is remembered at the job's size as
placement priced it, its prompt's tokens (counted with the model's own tokenizer), never 0: a
remembered OOM at size 0 refused every text request of that model on that machine."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from app.api.server import create_app
from app.context import ServerContext, build_context
from app.core.config import Settings
from tests.helpers import FAMILIES, TEST_API_KEY, bring_online, make_fleet

MODEL = "tiny-llama"
AUTH = {"Authorization": f"Bearer {TEST_API_KEY}"}
M1 = {"Authorization": f"Bearer {make_fleet('m1').machines['m1'].token}", "X-Homefleet-Machine": "m1"}


@pytest.fixture
def served(redis_url: str, tiny_text_dir: Path, tmp_path: Path) -> Iterator[tuple[TestClient, ServerContext]]:
    settings = Settings(data_dir=tmp_path / "server", redis_url=redis_url, api_keys=[TEST_API_KEY])
    ctx = build_context(settings, make_fleet("m1", families=FAMILIES | {"llama"}), migrate=True)
    ctx.registry.add(tiny_text_dir / MODEL, MODEL)
    bring_online(ctx, "m1", verified={MODEL})
    try:
        with TestClient(create_app(settings, ctx)) as client:
            yield client, ctx
    finally:
        ctx.close()


def submit(client: TestClient, prompt: str, chat: bool = False) -> Any:
    body = {"model": MODEL, "kind": "text", "target": "m1", "params": {"prompt": prompt, "max_new_tokens": 4}}
    if chat:
        body["params"]["chat"] = True
    return client.post("/v1/jobs", headers=AUTH, json=body)


@pytest.mark.parametrize("chat", [False, True], ids=["plain", "chat"])
def test_r21_a_text_oom_is_remembered_at_its_prompt_tokens_not_0(
    served: tuple[TestClient, ServerContext], chat: bool
) -> None:
    client, ctx = served
    prompt = "the quick brown fox jumps over the lazy dog " * 3
    answer = submit(client, prompt, chat)
    assert answer.status_code == 202, answer.text
    job_id = answer.json()["id"]
    journaled = ctx.journal.get(job_id)
    tokens = ctx.dispatcher.validator.request(MODEL, "text", dict(journaled.params), "m1").size  # as placed
    assert tokens > 1
    assert client.post(f"/internal/v1/jobs/{job_id}/claim", headers=M1).status_code == 200
    failed = client.post(
        f"/internal/v1/jobs/{job_id}/failure", headers=M1, json={"reason": "oom", "message": "killed (SIGKILL)"}
    )
    assert failed.status_code == 200, failed.text
    [record] = ctx.residency.ooms("m1")
    assert (record.model_id, record.kind, record.size, record.job_id) == (MODEL, "text", tokens, job_id)
    shorter = submit(client, "hello", chat)  # fewer prompt tokens than the OOM: still taken (R21)
    assert shorter.status_code == 202, shorter.text
    refused = submit(client, prompt + "and more", chat)  # as many or more: refused at submission
    assert refused.status_code == 422, refused.text
    assert refused.json()["error"]["reason"] == "remembered_oom"
    assert f"at size {tokens} " in refused.json()["error"]["message"]
