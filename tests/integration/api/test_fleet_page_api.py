"""What the fleet page reads, on a real Redis and journal: ``GET /v1/jobs`` (recent
jobs, newest first, with the reason of every refusal, R10/R22), ``GET /v1/machines``' warm
and committed models and drain estimate (R15, R12), and the page itself at ``/``: served
without a key under a 'self'-only CSP, while the data routes keep theirs."""

from __future__ import annotations

from fastapi.testclient import TestClient

from app.api.routes.page import ASSETS, PAGE_CSP
from app.api.routes.public import MAX_PAGE
from app.context import ServerContext
from tests.helpers import bring_online
from tests.integration.api.test_routing_api import MODEL, api

__all__ = ["api"]  # the fixture: a fleet of nine machines, tiny-sd registered


def submit(client: TestClient, target: str, **params: object) -> dict:
    return client.post(
        "/v1/jobs",
        json={"model": MODEL, "kind": "txt2img", "target": target, "params": {"prompt": "a fox", "steps": 2, **params}},
    ).json()


def test_jobs_are_listed_newest_first_with_refusal_reasons_and_filters(api: tuple[TestClient, ServerContext]) -> None:
    client, _ctx = api
    first = submit(client, "m2")
    refused = submit(client, "m2", width=65)["error"]  # not a multiple of 8 (R22): journaled as rejected
    last = submit(client, "server")
    listed = client.get("/v1/jobs").json()
    assert [job["id"] for job in listed] == [last["id"], refused["job_id"], first["id"]]
    shown = {job["id"]: job for job in listed}
    assert shown[refused["job_id"]]["state"] == "rejected"
    assert (shown[refused["job_id"]]["reason"], shown[refused["job_id"]]["message"]) == (
        refused["reason"],
        refused["message"],
    )
    assert shown[first["id"]]["predicted_s"] is not None and shown[first["id"]]["machine"] == "m2"
    assert [job["id"] for job in client.get("/v1/jobs", params={"limit": 1}).json()] == [last["id"]]
    assert [job["id"] for job in client.get("/v1/jobs", params={"machine": "server"}).json()] == [last["id"]]
    assert [job["id"] for job in client.get("/v1/jobs", params={"state": "rejected"}).json()] == [refused["job_id"]]
    too_many = client.get("/v1/jobs", params={"limit": MAX_PAGE + 1})
    assert too_many.status_code == 422 and "limit" in too_many.json()["error"]["message"]
    assert client.get("/v1/jobs", headers={"Authorization": ""}).status_code == 401


def test_an_unknown_machine_filter_is_refused_naming_the_fleets_machines(api: tuple[TestClient, ServerContext]) -> None:
    """``?machine=`` naming no machine (a typo: ``box-1`` for ``box:1``) is refused as any
    unknown machine (docs/api.md, "Fleet, models, syncs, residency"), not answered with an
    empty list that reads as "no jobs there"; a machine since removed from the fleet file
    still lists the jobs the journal has of it."""
    from app.core.states import JobState
    from app.db.tables import Job

    client, ctx = api
    submit(client, "m2")
    typo = client.get("/v1/jobs", params={"machine": "m-2"})
    assert typo.status_code == 422
    error = typo.json()["error"]
    assert (error["reason"], error["param"]) == ("unknown_machine", "machine")
    assert "'m-2'" in error["message"] and "m2" in error["message"]
    gone = ctx.journal.add(
        Job(state=JobState.succeeded, model_id=MODEL, kind="txt2img", params={}, target="old", machine="old")
    )
    assert [job["id"] for job in client.get("/v1/jobs", params={"machine": "old"}).json()] == [gone.id]
    assert len(client.get("/v1/jobs", params={"machine": "m2"}).json()) == 1


def test_machines_show_warm_and_committed_models_and_drain_time(api: tuple[TestClient, ServerContext]) -> None:
    client, ctx = api
    bring_online(ctx, "m2", {MODEL}, warm=(MODEL,))
    before = {row["name"]: row for row in client.get("/v1/machines").json()}
    assert before["m2"]["drain_s"] == 0 and before["m2"]["warm_models"] == [MODEL]
    assert before["resv"]["committed_models"] == [MODEL] and before["m2"]["committed_models"] == []
    submit(client, "m2")
    after = {row["name"]: row for row in client.get("/v1/machines").json()}
    assert after["m2"]["drain_s"] > 0 and after["m2"]["queued"] == 1
    assert after["m2"]["drain_s"] == {row["name"]: row for row in ctx.status()}["m2"]["drain_s"]


def test_page_and_its_assets_are_served_without_a_key_under_a_self_only_csp(
    api: tuple[TestClient, ServerContext],
) -> None:
    client, _ctx = api
    for path in ["/", *(f"/page/{name}" for name in ASSETS)]:
        answer = client.get(path, headers={"Authorization": ""})
        assert answer.status_code == 200, path
        assert answer.headers["content-security-policy"] == PAGE_CSP
        assert answer.headers["x-content-type-options"] == "nosniff"
    page = client.get("/").text
    assert '<script type="module" src="/page/app.js">' in page and "http" not in page  # nothing from elsewhere
    assert '<link rel="icon" type="image/svg+xml" href="/page/icon.svg">' in page  # no /favicon.ico 404 per visit
    icon = client.get("/page/icon.svg", headers={"Authorization": ""})
    assert icon.headers["content-type"] == "image/svg+xml" and icon.text.startswith("<svg ")
    old_name = client.get("/favicon.ico", headers={"Authorization": ""})  # asked for by the docs, the JSON answers
    assert old_name.status_code == 200 and old_name.content == icon.content
    assert "script-src 'self';" in PAGE_CSP and "unsafe" not in PAGE_CSP
    missing = client.get("/page/../server.py")
    assert missing.status_code == 404
    assert client.get("/page/secrets.txt").json()["error"]["reason"] == "not_found"
    assert "GET" in client.options("/").headers["allow"]
