"""Case C10 through the real SDKs against the session's running fleet (real API process, real
``celery worker`` processes): the official ``openai`` SDK with its default retries
(``max_retries=2``) and ``huggingface_hub``'s ``InferenceClient``, each with a client timeout
shorter than the job. Each call makes exactly one job, which runs once and succeeds; the
caller's error names the job, whose result is then fetched by its id (R20)."""

from __future__ import annotations

import io
import time

import pytest
from PIL import Image

from app.core.states import JobState
from app.db.tables import Job
from tests.e2e.conftest import EDIT_MODEL, RunningFleet
from tests.helpers import TEST_API_KEY, end_running, pause

pytestmark = pytest.mark.e2e

CLIENT_TIMEOUT_S = 1.5
BLOCKER_STEPS = 150  # the machine stays busy well past the client's timeout; ended once not needed


def jobs_with_prompt(fleet: RunningFleet, prompt: str) -> list[Job]:
    return [job for job in fleet.ctx.journal.list() if job.params.get("prompt") == prompt]


def occupy(fleet: RunningFleet, machine: str, prompt: str) -> str:
    """Submit a long job to ``machine`` and pause it once it runs (``pause``), so that the next
    job there waits behind it; return its id. The test ends it (``end_running``) once the calls
    it blocks are answered."""
    blocker = fleet.client.submit(fleet.model, "txt2img", {"prompt": prompt, "steps": BLOCKER_STEPS}, machine)
    pause(fleet.ctx, blocker["id"])
    return str(blocker["id"])


def ran_once(fleet: RunningFleet, job_id: str) -> bytes:
    """Wait for the job; check it succeeded after exactly one claim; return its result's bytes."""
    assert fleet.client.wait(job_id, timeout_s=300)["state"] == "succeeded"
    starts = [event for event in fleet.ctx.journal.events(job_id) if event.event == JobState.running]
    assert len(starts) == 1
    return fleet.client.download(job_id)


def png(width: int, height: int) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (40, 90, 200)).save(buffer, format="PNG")
    return buffer.getvalue()


def test_c10_openai_sdk_generate_and_edit_with_a_short_timeout_make_one_job_each(fleet: RunningFleet) -> None:
    import openai

    client = openai.OpenAI(base_url=f"{fleet.local.api_url}/v1", api_key=TEST_API_KEY, timeout=CLIENT_TIMEOUT_S)
    assert client.max_retries == 2  # the SDK's default: it would resend a timed-out request twice
    blocker = occupy(fleet, "m1", "c10 blocker m1")
    start = time.monotonic()
    with pytest.raises(openai.ConflictError) as generated:
        client.images.generate(
            model=fleet.model,
            prompt="c10 generate",
            size="64x64",  # type: ignore[arg-type]
            extra_body={"steps": 2, "target": "m1"},
        )
    assert time.monotonic() - start < CLIENT_TIMEOUT_S  # answered before the SDK gave up: nothing resent
    [job] = jobs_with_prompt(fleet, "c10 generate")
    assert generated.value.code == "job_pending" and job.id in generated.value.message
    assert generated.value.body["job_ids"] == [job.id]  # type: ignore[index]
    assert generated.value.response.headers["x-should-retry"] == "false"

    server_blocker = occupy(fleet, "server", "c10 blocker server")  # the edit model runs on `server` only
    with pytest.raises(openai.ConflictError) as edited:
        client.images.edit(model=EDIT_MODEL, image=("in.png", png(48, 40), "image/png"), prompt="c10 edit")
    [edit] = jobs_with_prompt(fleet, "c10 edit")
    assert edited.value.body["job_ids"] == [edit.id]  # type: ignore[index]
    end_running(fleet.ctx, blocker)
    end_running(fleet.ctx, server_blocker)

    for job_id in (job.id, edit.id):
        assert ran_once(fleet, job_id).startswith(b"\x89PNG")
    assert Image.open(io.BytesIO(fleet.client.download(edit.id))).size == (48, 40)
    assert len(jobs_with_prompt(fleet, "c10 generate")) == 1 and len(jobs_with_prompt(fleet, "c10 edit")) == 1


def test_c10_openai_sdk_retries_after_a_lost_answer_get_the_first_job(fleet: RunningFleet) -> None:
    """An answer the SDK never reads (its timeout shorter than the server's margin allows) makes
    it resend: the resent requests carry a retry count and get the first request's job."""
    import openai

    # The client gives up after 0.5 s but announces 3 s: every answer comes too late for it.
    client = openai.OpenAI(base_url=f"{fleet.local.api_url}/v1", api_key=TEST_API_KEY, timeout=0.5)
    blocker = occupy(fleet, "m2", "c10 blocker m2")
    with pytest.raises(openai.APITimeoutError):
        client.images.generate(
            model=fleet.model,
            prompt="c10 resent",
            size="64x64",  # type: ignore[arg-type]
            extra_body={"steps": 2, "target": "m2"},
            extra_headers={"x-stainless-read-timeout": "3"},
        )
    [job] = jobs_with_prompt(fleet, "c10 resent")  # three requests, one job
    assert fleet.client.get(job.id)["state"] in ("queued", "running")  # it was still waiting when the SDK gave up
    end_running(fleet.ctx, blocker)
    ran_once(fleet, job.id)


def test_c10_huggingface_inference_client_with_a_short_timeout_makes_one_job(fleet: RunningFleet) -> None:
    from huggingface_hub import InferenceClient
    from huggingface_hub.errors import HfHubHTTPError, InferenceTimeoutError

    base = f"{fleet.local.api_url}/hf/models"
    blocker = occupy(fleet, "server", "c10 blocker hf")
    # A client that announces its timeout (Prefer: wait=N) gets an answer naming the job.
    announcing = InferenceClient(
        base_url=f"{base}/{fleet.model}",
        api_key=TEST_API_KEY,
        timeout=CLIENT_TIMEOUT_S,
        headers={"Prefer": f"wait={CLIENT_TIMEOUT_S}"},
    )
    with pytest.raises(HfHubHTTPError) as text:
        announcing.text_to_image("c10 hf text", num_inference_steps=2, width=64, height=64)
    [job] = jobs_with_prompt(fleet, "c10 hf text")
    assert text.value.response.status_code == 409 and job.id in str(text.value)
    edit_client = InferenceClient(
        base_url=f"{base}/{EDIT_MODEL}",
        api_key=TEST_API_KEY,
        timeout=CLIENT_TIMEOUT_S,
        headers={"Prefer": f"wait={CLIENT_TIMEOUT_S}"},
    )
    with pytest.raises(HfHubHTTPError) as image:
        edit_client.image_to_image(png(32, 24), prompt="c10 hf edit", num_inference_steps=2)
    [edit] = jobs_with_prompt(fleet, "c10 hf edit")
    assert edit.kind == "edit" and edit.id in str(image.value)
    # One that does not announce it times out without an answer, and still makes one job (the
    # client does not resend).
    silent = InferenceClient(base_url=f"{base}/{fleet.model}", api_key=TEST_API_KEY, timeout=CLIENT_TIMEOUT_S)
    with pytest.raises(InferenceTimeoutError):
        silent.text_to_image("c10 hf silent", num_inference_steps=2, width=64, height=64)
    [silent_job] = jobs_with_prompt(fleet, "c10 hf silent")
    end_running(fleet.ctx, blocker)
    for job_id in (job.id, edit.id, silent_job.id):
        ran_once(fleet, job_id)
    assert Image.open(io.BytesIO(fleet.client.download(edit.id))).size == (32, 24)


def test_c10_openai_sdk_resend_of_a_cold_first_call_learns_the_jobs_and_is_not_resent(fleet: RunningFleet) -> None:
    """A cold first call: its submission outlasts the client's timeout (here the fleet lock is
    held meanwhile, as a slow first placement would), so the SDK resends it; the resend finds
    the first request still submitting (or, later, its job still queued behind a long one).
    Either way its 409 ``job_pending`` carries ``job_ids`` (the jobs known so far) and
    ``x-should-retry: false``, so the SDK stops there; the call makes one job, run once (R20)."""
    import threading

    import openai

    client = openai.OpenAI(base_url=f"{fleet.local.api_url}/v1", api_key=TEST_API_KEY, timeout=1.0)
    assert client.max_retries == 2
    blocker = occupy(fleet, "m1", "c10 cold blocker")  # the job then waits: the resend gets a 409 too
    held, release = threading.Event(), threading.Event()

    def hold_the_fleet_lock() -> None:
        with fleet.ctx.dispatcher.lock.held("test: a slow first placement"):
            held.set()
            release.wait(4.0)  # under fleet_lock_wait_s (5 s): the first submission waits, then goes through

    holder = threading.Thread(target=hold_the_fleet_lock)
    holder.start()
    try:
        assert held.wait(10)
        with pytest.raises(openai.ConflictError) as pending:
            client.images.generate(
                model=fleet.model,
                prompt="c10 cold",
                size="64x64",  # type: ignore[arg-type]
                extra_body={"steps": 2, "target": "m1"},
            )
    finally:
        release.set()
        holder.join()
    answer = pending.value
    assert answer.code == "job_pending" and answer.response.headers["x-should-retry"] == "false"
    assert isinstance(answer.body, dict) and isinstance(answer.body["job_ids"], list)
    assert int(answer.response.request.headers["x-stainless-retry-count"]) >= 1  # a resend answered it
    deadline = time.monotonic() + 30
    while not jobs_with_prompt(fleet, "c10 cold"):
        assert time.monotonic() < deadline, "the first request never submitted its job"
        time.sleep(0.1)
    [job] = jobs_with_prompt(fleet, "c10 cold")
    assert set(answer.body["job_ids"]) <= {job.id}
    end_running(fleet.ctx, blocker)
    ran_once(fleet, job.id)
    assert len(jobs_with_prompt(fleet, "c10 cold")) == 1
