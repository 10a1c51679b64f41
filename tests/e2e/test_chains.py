"""Results as inputs (generate -> img2img -> edit, no download and upload in between), what a
result PNG tells other tools (A1111's ``parameters`` chunk), and the client's reach into a
job's results and refusals, end to end: a real API and a real worker for
m1 (the revoke fleet of tests/e2e/test_revoke_and_flower.py), real tiny pipelines."""

from __future__ import annotations

import io
import json
import re

import pytest
from PIL import Image

from app.client import ApiError
from app.core.digest import bytes_digest
from tasks.provenance import A1111_SAMPLERS
from tests.e2e.test_revoke_and_flower import EDIT_MODEL, MODEL, RevokeFleet, rfleet  # noqa: F401 (the fixture)
from tests.helpers import run_cli, settings_env

pytestmark = pytest.mark.e2e


def succeeded(fleet: RevokeFleet, job_id: str) -> dict:
    job = fleet.client.wait(job_id, timeout_s=180)
    assert job["state"] == "succeeded", job
    return job


def test_a_result_s_digest_is_an_input_generate_img2img_edit_and_another_key_s_or_an_unknown_one_is_422(
    rfleet: RevokeFleet,  # noqa: F811 (the imported fixture)
) -> None:
    """A succeeded job's result digest as ``params.image``: img2img on a txt2img result, then an
    edit on the img2img result, each succeeds and its provenance names the result it took. A
    result of a job another key submitted, and a digest nothing has, are 422 ``unknown_file``
    with param ``params.image`` (kept by ``ApiError``)."""
    client = rfleet.client
    made = succeeded(rfleet, client.submit(MODEL, "txt2img", {"prompt": "a red square", "steps": 2}, target="m1")["id"])
    first = made["result"]["digest"]
    redone = succeeded(
        rfleet,
        client.submit(MODEL, "img2img", {"prompt": "bluer", "image": first, "steps": 2, "strength": 0.6}, target="m1")[
            "id"
        ],
    )
    assert redone["provenance"]["inputs"] == {"image": first}, redone["provenance"]
    second = redone["result"]["digest"]
    assert second != first
    edited = succeeded(
        rfleet,
        client.submit(EDIT_MODEL, "edit", {"prompt": "make it green", "image": second, "steps": 1}, target="m1")["id"],
    )
    assert edited["provenance"]["inputs"] == {"image": second}, edited["provenance"]
    assert bytes_digest(client.download(edited["id"])) == edited["result"]["digest"]

    theirs = rfleet.ctx.dispatcher.submit(
        MODEL, "txt2img", {"prompt": "theirs", "steps": 2, "seed": 7}, "m1", api_key_id="another-tenant"
    ).job
    their_digest = succeeded(rfleet, theirs.id)["result"]["digest"]
    for image, what in ((their_digest, "another key's result"), ("blake3:" + "0" * 64, "a digest nothing has")):
        with pytest.raises(ApiError) as refused:
            client.submit(MODEL, "img2img", {"prompt": "x", "image": image, "steps": 2}, target="m1")
        error = refused.value
        assert (error.status_code, error.reason, error.param) == (422, "unknown_file", "params.image"), what
        assert error.message.startswith("params.image: no uploaded file and no result of yours"), error.message
        assert error.job_id is not None  # the refusal is journaled: GET /v1/jobs/{id} shows it
        assert client.get(error.job_id)["state"] == "rejected"


def test_download_fetches_every_image_of_a_job_by_index(rfleet: RevokeFleet) -> None:  # noqa: F811 (the imported fixture)
    """``HomefleetClient.download(job_id, index)``: image i of a job with n images, each matching
    its listed digest; past the last, ApiError 404."""
    client = rfleet.client
    job = succeeded(rfleet, client.submit(MODEL, "txt2img", {"prompt": "two", "steps": 2, "n": 2}, target="m1")["id"])
    digests = [row["digest"] for row in job["results"]]
    assert len(set(digests)) == 2
    assert [bytes_digest(client.download(job["id"], index)) for index in (0, 1)] == digests
    with pytest.raises(ApiError) as past:
        client.download(job["id"], 2)
    assert (past.value.status_code, past.value.reason) == (404, "result_not_found")


def a1111_fields(text: str) -> tuple[list[str], dict[str, str]]:
    """An A1111 ``parameters`` text: its lines before the last, and the last line's fields."""
    *head, last = text.split("\n")
    return head, dict(field.split(": ", 1) for field in last.split(", "))


def test_a_result_png_carries_the_a1111_parameters_chunk_other_tools_read(rfleet: RevokeFleet) -> None:  # noqa: F811 (the imported fixture)
    """Each PNG result carries AUTOMATIC1111's ``parameters`` text chunk beside the ``homefleet``
    JSON one: prompt, ``Negative prompt:``, then Steps, Sampler (A1111's name of the pipeline's
    scheduler), CFG scale, Seed (image i of n: seed + i), Size, Model hash (10 hex digits), Model;
    an img2img result adds its Denoising strength. Read back with PIL."""
    client = rfleet.client
    params = {
        "prompt": "a lighthouse at dusk",
        "negative_prompt": "blurry, text",
        "steps": 3,
        "guidance_scale": 6.5,
        "seed": 1234,
        "n": 2,
    }
    job = succeeded(rfleet, client.submit(MODEL, "txt2img", params, target="m1")["id"])
    sampler = job["provenance"]["sampler"]
    assert sampler.endswith("Scheduler"), sampler
    hashes = set()
    for index in (0, 1):
        with Image.open(io.BytesIO(client.download(job["id"], index))) as image:
            text, size, embedded = image.text["parameters"], image.size, json.loads(image.text["homefleet"])
        head, fields = a1111_fields(text)
        assert head == ["a lighthouse at dusk", "Negative prompt: blurry, text"], text
        assert list(fields) == ["Steps", "Sampler", "CFG scale", "Seed", "Size", "Model hash", "Model"], text
        assert fields["Steps"] == "3" and fields["CFG scale"] == "6.5", text
        assert fields["Sampler"] == A1111_SAMPLERS.get(sampler, sampler), text
        assert fields["Seed"] == str(1234 + index) == str(embedded["seed"]), text
        assert fields["Size"] == f"{size[0]}x{size[1]}", text
        assert fields["Model"] == MODEL, text
        assert re.fullmatch(r"[0-9a-f]{10}", fields["Model hash"]), text
        hashes.add(fields["Model hash"])
    assert len(hashes) == 1  # one model, one hash

    first = job["results"][0]["digest"]
    redone = succeeded(
        rfleet,
        client.submit(
            MODEL, "img2img", {"prompt": "at night", "image": first, "steps": 4, "strength": 0.5}, target="m1"
        )["id"],
    )
    with Image.open(io.BytesIO(client.download(redone["id"]))) as image:
        head, fields = a1111_fields(image.text["parameters"])
    assert head == ["at night"]  # no negative prompt: no such line
    assert fields["Denoising strength"] == "0.5" and fields["Model hash"] in hashes, fields


def test_homefleet_jobs_requeue_runs_a_job_again_with_its_seed_or_a_new_one(rfleet: RevokeFleet) -> None:  # noqa: F811 (the imported fixture)
    """``homefleet jobs requeue JOB_ID``: a new job with the same params and seed, linked to the
    old one (``requeued_from``), whose result is byte-identical (same seed, same machine);
    ``--new-seed`` draws another; an unknown id exits 2 naming ``job_not_found``."""
    client, env = rfleet.client, settings_env(rfleet.ctx.settings)
    old = succeeded(rfleet, client.submit(MODEL, "txt2img", {"prompt": "again", "steps": 2}, target="m1")["id"])
    done = run_cli("jobs", "requeue", old["id"], env=env)
    new_id = done.stdout.split(" requeued as ")[1].split(":")[0]
    again = succeeded(rfleet, new_id)
    assert again["requeued_from"] == old["id"] and again["seed"] == old["seed"], again
    assert again["result"]["digest"] == old["result"]["digest"]  # same seed, same machine: same bytes
    # by its first 8 characters, as `homefleet demo` and the page print ids
    short = run_cli("jobs", "requeue", old["id"][:8], "--new-seed", env=env).stdout
    assert f"job {old['id']} requeued as " in short, short
    other = short.split(" requeued as ")[1].split(":")[0]
    assert succeeded(rfleet, other)["seed"] != old["seed"]
    empty = run_cli("jobs", "requeue", "", env=env, check=False)
    assert empty.returncode == 2 and "job_not_found" in empty.stderr, empty
    missing = run_cli("jobs", "requeue", "0" * 32, env=env, check=False)
    assert missing.returncode == 2 and "job_not_found" in missing.stdout + missing.stderr, missing
    # `homefleet jobs list`: the newest first, by the short ids requeue takes, the state filter
    listed = run_cli("jobs", "list", "--limit", "3", "--state", "succeeded", env={**env, "COLUMNS": "200"}).stdout
    rows = [
        [cell.strip() for cell in line.strip("│").split("│")] for line in listed.splitlines() if line.startswith("│")
    ]
    assert [row[0] for row in rows] == [other[:8], new_id[:8], old["id"][:8]], listed
    assert rows[-1][1:5] == ["succeeded", MODEL, "txt2img", "m1"] and rows[-1][6] == "again", rows
    narrow = run_cli("jobs", "list", "--limit", "1", env={**env, "COLUMNS": "80"}).stdout
    assert f"│ {other[:8]} │ succeeded │" in narrow and all(len(line) <= 80 for line in narrow.splitlines()), narrow
    wrong = run_cli("jobs", "list", "--state", "done", env=env, check=False)
    assert wrong.returncode == 2 and "unknown_state" in wrong.stdout + wrong.stderr, wrong
