"""Results as inputs (generate -> img2img -> edit, no download and upload in between) and the
client's reach into a job's results and refusals, end to end: a real API and a real worker for
m1 (the revoke fleet of tests/e2e/test_revoke_and_flower.py), real tiny pipelines."""

from __future__ import annotations

import pytest

from app.client import ApiError
from app.core.digest import bytes_digest
from tests.e2e.test_revoke_and_flower import EDIT_MODEL, MODEL, RevokeFleet, rfleet  # noqa: F401 (the fixture)

pytestmark = pytest.mark.e2e


def succeeded(fleet: RevokeFleet, job_id: str) -> dict:
    job = fleet.client.wait(job_id, timeout_s=180)
    assert job["state"] == "succeeded", job
    return job


def test_a_result_s_digest_is_an_input_generate_img2img_edit_and_another_key_s_or_an_unknown_one_is_422(
    rfleet: RevokeFleet,
) -> None:
    """A succeeded job's result digest as ``params.image``: img2img on a txt2img result, then an
    edit on the img2img result, each succeeds and its provenance names the result it took. A
    result of a job another key submitted, and a digest nothing has, are 422 ``unknown_file``
    with param ``params.image`` (kept by ``ApiError``)."""
    client = rfleet.client
    made = succeeded(rfleet, client.submit(MODEL, "txt2img", {"prompt": "a red square", "steps": 2}, target="m1")["id"])
    first = made["result"]["digest"]
    redone = succeeded(rfleet, client.submit(MODEL, "img2img", {"prompt": "bluer", "image": first, "steps": 2,
                                                                  "strength": 0.6}, target="m1")["id"])
    assert redone["provenance"]["inputs"] == {"image": first}, redone["provenance"]
    second = redone["result"]["digest"]
    assert second != first
    edited = succeeded(rfleet, client.submit(EDIT_MODEL, "edit", {"prompt": "make it green", "image": second,
                                                                  "steps": 1}, target="m1")["id"])
    assert edited["provenance"]["inputs"] == {"image": second}, edited["provenance"]
    assert bytes_digest(client.download(edited["id"])) == edited["result"]["digest"]

    theirs = rfleet.ctx.dispatcher.submit(MODEL, "txt2img", {"prompt": "theirs", "steps": 2, "seed": 7}, "m1",
                                          api_key_id="another-tenant").job
    their_digest = succeeded(rfleet, theirs.id)["result"]["digest"]
    for image, what in ((their_digest, "another key's result"), ("blake3:" + "0" * 64, "a digest nothing has")):
        with pytest.raises(ApiError) as refused:
            client.submit(MODEL, "img2img", {"prompt": "x", "image": image, "steps": 2}, target="m1")
        error = refused.value
        assert (error.status_code, error.reason, error.param) == (422, "unknown_file", "params.image"), what
        assert error.message.startswith("params.image: no uploaded file and no result of yours"), error.message
        assert error.job_id is not None  # the refusal is journaled: GET /v1/jobs/{id} shows it
        assert client.get(error.job_id)["state"] == "rejected"


def test_download_fetches_every_image_of_a_job_by_index(rfleet: RevokeFleet) -> None:
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
