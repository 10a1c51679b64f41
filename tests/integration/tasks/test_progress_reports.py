"""A running job's progress reports (tasks/run_job.py ``ProgressReports``): at most one every
``PROGRESS_EVERY_S`` reaches the server, the first and the last step always do, and a cancel
stops the run at the very next step whether or not that step is reported. Real parts: the API
served by uvicorn, its Redis and journal, the worker's runtime and server client."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from app.context import ServerContext
from app.core.config import WorkerSettings
from tasks import runtime
from tasks.run_job import JobCancelled, ProgressReports
from tests.helpers import bring_online, served_api

TOKENS = 400  # a long text job's new tokens, each a step


def claimed_job(ctx: ServerContext, url: str, tiny_models_dir: Path, tmp_path: Path) -> str:
    """A txt2img job on m1, claimed (``running``) by a worker runtime installed for this test."""
    model = ctx.registry.add(tiny_models_dir / "tiny-sd").id
    bring_online(ctx, "m1", {model})
    job_id = ctx.dispatcher.submit(model, "txt2img", {"prompt": "progress"}, "m1").job.id
    worker = WorkerSettings(
        machine="m1",
        models_dir=tmp_path / "m1-models",
        server_url=url,
        worker_token=ctx.fleet.machines["m1"].token,
        redis_url=ctx.settings.redis_url,
    )
    rt = runtime.WorkerRuntime(worker, uuid.uuid4().hex)
    runtime.install(rt)
    rt.server.claim(job_id, claim_id="delivery-1")
    return job_id


@pytest.fixture
def installed() -> Iterator[None]:
    """The worker runtime a test installs is removed after it."""
    yield
    runtime.install(None)  # type: ignore[arg-type]


@pytest.mark.parametrize("every_s", [60.0, 0.0])
def test_reports_are_coalesced_but_the_first_and_last_step_reach_the_server(
    ctx: ServerContext, tiny_models_dir: Path, tmp_path: Path, installed: None, every_s: float
) -> None:
    with served_api(ctx) as url:
        job_id = claimed_job(ctx, url, tiny_models_dir, tmp_path)
        reports = ProgressReports(job_id, every_s=every_s)
        texts = []
        for step in range(1, TOKENS + 1):
            texts.append(f"t{step}")
            reports(step, TOKENS, text=" ".join(texts), tokens=list(range(step)), logprobs=[-0.5] * step)
            if step == 1:  # the first step is reported at once
                first = ctx.progress.read(job_id)
                assert first is not None and (first.step, first.total, first.text) == (1, TOKENS, "t1")
        last = ctx.progress.read(job_id)
        assert last is not None and (last.step, last.text) == (TOKENS, " ".join(texts))
        assert last.tokens == list(range(TOKENS)) and last.logprobs == [-0.5] * TOKENS
        # every step within the interval was coalesced: only the first and the last were sent;
        # with no interval every step is a request, as before coalescing
        assert reports.reported == (2 if every_s else TOKENS)


def test_a_cancel_stops_the_run_at_the_next_step_even_when_that_step_is_not_reported(
    ctx: ServerContext, tiny_models_dir: Path, tmp_path: Path, installed: None
) -> None:
    with served_api(ctx) as url:
        job_id = claimed_job(ctx, url, tiny_models_dir, tmp_path)
        reports = ProgressReports(job_id, every_s=60.0)
        reports(1, TOKENS)
        reports(2, TOKENS)
        assert ctx.dispatcher.request_cancel(job_id).state == "running"  # POST /v1/jobs/{id}/cancel
        with pytest.raises(JobCancelled) as cancelled:
            reports(3, TOKENS)
        assert (cancelled.value.step, reports.reported) == (3, 1)  # stopped at step 3, which was not sent
        assert ctx.progress.read(job_id).step == 1  # type: ignore[union-attr]
