"""The OpenAPI document tells the truth (R22, R24), on a real Redis and
journal through the real ASGI app: every status a route answers is listed with the common
error body; the limits the server enforces are in the schema; OPTIONS and unknown methods
answer with the path's ``Allow``; result URLs never come from ``Host``; progress for a job
that is not running is 409."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from app.api.openai_errors import is_openai_route, is_tgi_route
from app.api.server import create_app
from app.context import ServerContext, build_context
from app.core.config import Settings
from app.core.limits import DEFAULT_FAMILY, FamilyLimits
from app.core.states import JobState
from tests.helpers import TEST_API_KEY, bring_online, make_fleet, refused_status

MODEL = "tiny-sd"
AUTH = {"Authorization": f"Bearer {TEST_API_KEY}"}
LIMITS = FamilyLimits(max_pixels=64 * 64, max_steps=3, max_prompt_chars=50)


@pytest.fixture
def api(settings: Settings, tiny_models_dir: Path) -> Iterator[tuple[TestClient, ServerContext]]:
    settings = settings.model_copy(update={"limits": {DEFAULT_FAMILY: LIMITS}, "images_wait_s": 1})
    ctx = build_context(settings, make_fleet("m1"), migrate=True)
    ctx.registry.add(tiny_models_dir / MODEL, MODEL)
    with TestClient(create_app(settings, ctx), headers=AUTH) as client:
        yield client, ctx


def test_every_operation_lists_its_error_statuses_with_the_common_body(api: tuple[TestClient, ServerContext]) -> None:
    client, _ctx = api
    schema = client.get("/openapi.json").json()
    error = schema["components"]["schemas"]["Error"]
    assert error["required"] == ["error"] and error["properties"]["error"]["required"] == ["reason", "message"]
    for path, item in schema["paths"].items():
        for method, op in item.items():
            responses = op["responses"]
            expected = (
                {"503"} if (method, path) not in {("get", "/metrics"), ("get", "/")} else set()
            )  # no Redis or journal
            if op.get("security"):
                expected.add("401")
            if any(p["in"] == "path" for p in op.get("parameters", [])):
                expected.add("404")
            if "requestBody" in op:
                expected |= {"400", "413", "422"}
            assert expected <= set(responses), (method, path, sorted(responses))
            for status, answer in responses.items():
                if status.startswith(("4", "5")):
                    error = answer["content"]["application/json"]["schema"]
                    shape = "/OpenAIError" if is_openai_route(path) else "/TGIError" if is_tgi_route(path) else "/Error"
                    if path == "/hf/models/{model}":  # a text model's URL answers as TGI does
                        refs = [one["$ref"].rpartition("/")[2] for one in error["anyOf"]]
                        assert refs == ["OpenAIError", "TGIError"], (method, path, status, refs)
                    else:
                        assert error["$ref"].endswith(shape), (method, path, status)
    submit = schema["paths"]["/v1/jobs"]["post"]["responses"]
    assert {"200", "202", "404", "409", "429"} <= set(submit)
    assert {"GetJob", "JobResult", "CancelJob", "JobEvents"} <= set(submit["202"]["links"])  # the stateful way
    # queued: 200 cancelled; running: 202, still running (the stateful fuzz met an undocumented 202)
    assert {"200", "202", "409"} <= set(schema["paths"]["/v1/jobs/{job_id}/cancel"]["post"]["responses"])


def test_the_schema_states_the_limits_the_server_enforces(api: tuple[TestClient, ServerContext]) -> None:
    client, ctx = api
    schema = client.get("/openapi.json").json()
    [txt2img] = [
        v
        for v in schema["components"]["schemas"]["JobCreate"]["oneOf"]
        if v["properties"]["kind"]["const"] == "txt2img"
    ]
    params = txt2img["properties"]["params"]
    assert params["additionalProperties"] is False and params["required"] == ["prompt"]
    steps = params["properties"]["steps"]["anyOf"][0]
    assert (steps["minimum"], steps["maximum"]) == (1, LIMITS.max_steps)
    width = params["properties"]["width"]["anyOf"][0]
    assert (width["multipleOf"], width["minimum"]) == (LIMITS.multiple_of, LIMITS.min_side)
    assert params["properties"]["prompt"]["maxLength"] == LIMITS.max_prompt_chars
    assert txt2img["properties"]["model"]["enum"] == [MODEL]
    assert txt2img["properties"]["target"]["enum"] == ["m1", "server", "auto"]
    # Each limit stated is the one enforced: one past it is refused, naming it.
    bring_online(ctx, "server", {MODEL})
    for params_past, reason in (
        ({"steps": LIMITS.max_steps + 1}, "invalid_steps"),
        ({"width": 12}, "invalid_width"),
        ({"prompt": "x" * 51}, "invalid_prompt"),
        ({"scheduler": "ddim"}, "unknown_param"),
    ):
        answer = client.post(
            "/v1/jobs", json={"model": MODEL, "kind": "txt2img", "params": {"prompt": "a", **params_past}}
        )
        assert (answer.status_code, answer.json()["error"]["reason"]) == (422, reason)
    machine = schema["paths"]["/v1/machines/{machine}/residency"]["get"]["parameters"][0]
    assert machine["schema"]["enum"] == ["m1", "server"]


def test_options_lists_every_method_of_the_path_and_other_methods_are_405(
    api: tuple[TestClient, ServerContext],
) -> None:
    client, _ctx = api
    ooms = client.options("/v1/ooms")
    assert ooms.status_code == 204 and ooms.headers["allow"] == "DELETE, GET, HEAD, OPTIONS"  # two routes, one path
    assert client.options("/v1/jobs/abc").headers["allow"] == "GET, HEAD, OPTIONS"
    refused = client.request("PATCH", "/v1/ooms")
    assert refused.status_code == 405 and refused.headers["allow"] == "DELETE, GET, HEAD, OPTIONS"
    assert client.options("/v1/jobs").headers["allow"] == "GET, HEAD, OPTIONS, POST"
    assert refused.json()["error"]["reason"] == "method_not_allowed"
    assert client.request("PUT", "/v1/jobs").status_code == 405
    assert client.options("/no/such/path").status_code == 404


def test_the_docs_pages_alone_carry_the_content_security_policy(api: tuple[TestClient, ServerContext]) -> None:
    """The docs pages load nothing from elsewhere (the header is added by a pure ASGI
    middleware, app/api/middleware.py); other answers carry no such header."""
    client, _ctx = api
    for page in ("/docs", "/redoc", "/docs/oauth2-redirect"):
        answer = client.get(page)
        assert answer.status_code == 200 and answer.headers["content-security-policy"].startswith("default-src 'self'")
    assert "content-security-policy" not in client.get("/v1/machines").headers
    assert "content-security-policy" not in client.get("/openapi.json").headers


def test_starlettes_own_refusals_have_the_common_error_body(api: tuple[TestClient, ServerContext]) -> None:
    client, _ctx = api
    missing = client.get("/no/such/path")
    assert missing.status_code == 404 and missing.json()["error"]["reason"] == "not_found"
    garbled = client.post(
        "/v1/files", content=b"--x\r\nnot multipart", headers={"content-type": "multipart/form-data; boundary=x"}
    )
    assert garbled.status_code in (400, 422) and garbled.json()["error"]["message"]


def test_result_urls_never_come_from_the_host_header(settings: Settings, tiny_models_dir: Path, tmp_path: Path) -> None:
    import threading
    import time

    own = f"http://{settings.api_host}:{settings.api_port}/v1/jobs/"
    for base, expected in ((None, own), ("https://fleet.example/hf", "https://fleet.example/hf/v1/jobs/")):
        ctx = build_context(settings.model_copy(update={"public_base_url": base}), make_fleet("m1"), migrate=True)
        if base is None:
            ctx.registry.add(tiny_models_dir / MODEL, MODEL)
        bring_online(ctx, "server", {MODEL})
        result = tmp_path / "r.png"
        result.write_bytes(b"\x89PNG\r\n\x1a\n")
        stop = threading.Event()

        def worker(ctx: ServerContext = ctx, stop: threading.Event = stop, result: Path = result) -> None:
            while not stop.is_set():
                for job in ctx.journal.list([JobState.queued]):
                    ctx.journal.claim(job.id, "server")
                    ctx.journal.succeed(job.id, "server", result_path=str(result), result_media_type="image/png")
                time.sleep(0.05)

        thread = threading.Thread(target=worker, daemon=True)
        thread.start()
        try:
            with TestClient(create_app(ctx.settings, ctx), headers=AUTH) as client:
                answer = client.post(
                    "/v1/images/generations",
                    headers={"Host": "evil.example"},
                    json={"prompt": "a", "model": MODEL, "response_format": "url"},
                )
        finally:
            stop.set()
            thread.join()
        url = answer.json()["data"][0]["url"]
        assert url.startswith(expected) and "evil.example" not in url, url


def test_progress_for_a_job_that_is_not_running_is_409(api: tuple[TestClient, ServerContext]) -> None:
    client, ctx = api
    bring_online(ctx, "server", {MODEL})
    job_id = client.post("/v1/jobs", json={"model": MODEL, "kind": "txt2img", "params": {"prompt": "a"}}).json()["id"]
    token = {"Authorization": f"Bearer {ctx.fleet.machines['server'].token}"}
    url = f"/internal/v1/jobs/{job_id}/progress"
    assert client.post(url, json={"step": 1, "total": 2}, headers=token).status_code == 409  # queued
    ctx.journal.claim(job_id, "server")
    assert client.post(url, json={"step": 1, "total": 2}, headers=token).status_code == 204
    ctx.journal.succeed(job_id, "server", result_path="/nonexistent", result_media_type="image/png")
    ended = client.post(url, json={"step": 2, "total": 2}, headers=token)
    assert ended.status_code == 409 and ended.json()["error"]["reason"] == "not_running"
    assert ctx.progress.read(job_id).step == 1  # nothing recorded after the end


@pytest.mark.parametrize("text_model", ["x" * 65, "", 7])
def test_expand_prompt_beyond_its_schema_is_422_in_a_dry_run_too(
    api: tuple[TestClient, ServerContext], text_model: object
) -> None:
    """The schema's limits on ``params.expand_prompt`` (a model id: 1-64 characters) hold on every
    path, the dry run included (the fuzz run found a dry run that accepted 65 characters)."""
    client, ctx = api
    body = {
        "model": MODEL,
        "kind": "txt2img",
        "params": {"prompt": "a", "expand_prompt": text_model, "expanded_by": ""},
    }
    answer = client.post("/v1/jobs", params={"dry_run": "true"}, json=body)
    assert answer.status_code == 422, answer.text
    assert answer.json()["error"]["reason"] == "invalid_expand_prompt"
    assert "params.expand_prompt" in answer.text and "1-64 characters" in answer.text
    assert ctx.journal.list() == []


@pytest.mark.parametrize("dry_run", ["false", "true"])
def test_a_chats_shown_message_sent_by_a_client_is_refused_naming_it(
    api: tuple[TestClient, ServerContext], dry_run: str
) -> None:
    """``params.user_message`` is the server's (a chat's last user message, which the fleet page
    shows as the job's prompt): a client's would put other words on the page than the job ran."""
    client, ctx = api
    body = {"model": MODEL, "kind": "txt2img", "params": {"prompt": "a", "user_message": "not what ran"}}
    answer = client.post("/v1/jobs", params={"dry_run": dry_run}, json=body)
    assert answer.status_code == 422, answer.text
    error = answer.json()["error"]
    assert (error["reason"], error["param"]) == ("invalid_params", "params.user_message")
    assert "POST /v1/chat/completions" in error["message"] and ctx.journal.list() == []


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/", {"inputs": "a", "model": ""}),
        ("/generate", {"inputs": "a", "model": ""}),
        ("/v1/completions", {"prompt": "a", "model": ""}),
        ("/v1/images/generations", {"prompt": "a", "model": ""}),
    ],
)
def test_an_empty_model_is_refused_not_read_as_the_default(
    api: tuple[TestClient, ServerContext], path: str, body: dict[str, Any]
) -> None:
    """The document lists a route's models (or none, for its default); ``""`` is neither: a 422
    naming ``model``, nothing run (the fuzz run's stateful phase once got a text job for it)."""
    client, ctx = api
    answer = client.post(path, json=body)
    assert answer.status_code == refused_status(path), answer.text
    assert "`model`: String should have at least 1 character" in answer.text  # in TGI's or OpenAI's error body
    assert ctx.journal.list() == []


@pytest.mark.parametrize(
    ("method", "path", "body", "field"),
    [
        ("post", "/hf", {"inputs": "a", "parameters": {"guidance_scale": False}}, "guidance_scale"),
        ("post", "/v1/images/generations", {"prompt": "a", "steps": True}, "steps"),
        ("post", "/v1/completions", {"prompt": "a", "max_tokens": True}, "max_tokens"),
        ("post", "/generate", {"inputs": "a", "parameters": {"max_new_tokens": True}}, "max_new_tokens"),
        ("post", "/v1/jobs", {"model": MODEL, "kind": "txt2img", "params": {"prompt": "a", "steps": True}}, "steps"),
    ],
)
def test_a_boolean_is_no_number_on_any_route(
    api: tuple[TestClient, ServerContext], method: str, path: str, body: dict[str, Any], field: str
) -> None:
    """Pydantic's lax mode would read ``false`` as 0.0 (the fuzz run's stateful phase got an image
    for ``"guidance_scale": false``): every request body refuses a boolean where the schema says
    number (app/core/request_body.py), with a 422 naming the field; nothing runs (a refused
    ``POST /v1/jobs`` keeps its reason in the journal, R19)."""
    client, ctx = api
    answer = client.request(method, path, json=body)
    assert answer.status_code == refused_status(path), answer.text
    assert field in answer.text
    assert [job.state for job in ctx.journal.list()] == (["rejected"] if path == "/v1/jobs" else [])


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/v1/images/generations", {"prompt": "a", "steps": "2"}, "steps"),
        ("/v1/images/generations", {"prompt": "a", "n": "2"}, "n"),
        ("/v1/completions", {"prompt": "a", "max_tokens": "10"}, "max_tokens"),
        ("/generate", {"inputs": "a", "parameters": {"max_new_tokens": "3"}}, "max_new_tokens"),
    ],
)
def test_a_string_is_no_number_on_any_route(
    api: tuple[TestClient, ServerContext], path: str, body: dict[str, Any], field: str
) -> None:
    """Lax mode would read ``"2"`` as 2 for a body's own number fields, while the same value as a
    job param (``"seed": "5"``, or ``params.steps`` on ``POST /v1/jobs``) is refused: every route
    refuses it alike, a 422 naming the field, nothing submitted (app/core/request_body.py)."""
    client, ctx = api
    answer = client.post(path, json=body)
    assert answer.status_code == refused_status(path), answer.text
    assert field in answer.text and "must be a number, not a string" in answer.text
    assert ctx.journal.list() == []


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/generate_stream", {"inputs": "a", "stream": 0}, "stream"),
        ("/generate", {"inputs": "a", "parameters": {"return_full_text": 0}}, "return_full_text"),
        ("/v1/completions", {"prompt": "a", "stream": "yes"}, "stream"),
    ],
)
def test_a_number_or_a_word_is_no_boolean(
    api: tuple[TestClient, ServerContext], path: str, body: dict[str, Any], field: str
) -> None:
    """Lax mode would read ``0`` or ``"yes"`` as a boolean (the fuzz run's negative phase had
    ``"stream": 0`` stream events, once a text model was in its fleet): a 422 naming the field,
    nothing submitted (app/core/request_body.py)."""
    client, ctx = api
    answer = client.post(path, json=body)
    assert answer.status_code == refused_status(path), answer.text
    assert field in answer.text and "must be true or false" in answer.text
    assert ctx.journal.list() == []


def test_the_tgi_streaming_routes_say_they_answer_server_sent_events(api: tuple[TestClient, ServerContext]) -> None:
    """``POST /generate_stream`` answers ``text/event-stream`` only, and TGI's root route
    ``POST /`` JSON or, with ``stream``, ``text/event-stream``: the description says what a
    client gets (a schema-driven fuzzer checks answers against it)."""
    client, _ = api
    paths = client.get("/openapi.json").json()["paths"]
    assert list(paths["/generate_stream"]["post"]["responses"]["200"]["content"]) == ["text/event-stream"]
    assert set(paths["/"]["post"]["responses"]["200"]["content"]) == {"application/json", "text/event-stream"}
    assert list(paths["/generate"]["post"]["responses"]["200"]["content"]) == ["application/json"]


def test_head_answers_where_get_does_without_a_body(api: tuple[TestClient, ServerContext]) -> None:
    """``curl -I`` and uptime probes: HEAD gets GET's status and headers, no body (RFC 9110)."""
    client, _ctx = api
    for path in ("/health", "/", "/page/icon.svg", "/openapi.json", "/v1/machines"):
        get, head = client.get(path), client.head(path)
        assert (head.status_code, head.content) == (get.status_code, b""), path
        assert head.headers["content-type"] == get.headers["content-type"], path
        assert head.headers.get("content-length") == get.headers.get("content-length"), path
    unauthorised = client.head("/v1/machines", headers={"Authorization": ""})
    assert (unauthorised.status_code, unauthorised.content) == (401, b"")
    assert client.head("/no/such/path").status_code == 404
    assert client.request("HEAD", "/v1/ooms").status_code == 200


def test_head_of_a_jobs_event_stream_ends_at_once(api: tuple[TestClient, ServerContext]) -> None:
    """A queued job's server-sent events never end by themselves; HEAD gets their start only."""
    client, ctx = api
    model = ctx.registry.list()[0].id
    bring_online(ctx, "m1", {model})
    job = client.post("/v1/jobs", json={"model": model, "kind": "txt2img", "target": "m1", "params": {"prompt": "x"}})
    assert job.status_code == 202, job.text
    head = client.head(f"/v1/jobs/{job.json()['id']}/events")
    assert (head.status_code, head.content) == (200, b"") and head.headers["content-type"].startswith(
        "text/event-stream"
    )
