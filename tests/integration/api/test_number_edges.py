"""Numbers at the edges are refused, never a 5xx (R22): a 400-digit integer, its negative, and
a float such as 1e308 or 5e-324 in every numeric field of ``POST /v1/jobs``, the OpenAI routes
and TGI's get a 422 naming the client's field and the limit. A temperature so small it is
effectively 0 decodes greedily (app/core/kinds.py ``GREEDY_TEMPERATURE``), and a text job that
fails is answered in the route's error shape (TGI: 424 ``generation``), not as a crash."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from app.api.server import create_app
from app.context import ServerContext, build_context
from app.core.config import Settings
from app.core.kinds import GREEDY_TEMPERATURE, greedy
from app.core.states import JobState
from tests.helpers import FAMILIES, TEST_API_KEY, bring_online, make_fleet, refused_status

IMAGE_MODEL, TEXT_MODEL = "tiny-sd", "tiny-llama"
AUTH = {"Authorization": f"Bearer {TEST_API_KEY}"}
M1 = {"Authorization": f"Bearer {make_fleet('m1').machines['m1'].token}", "X-Homefleet-Machine": "m1"}
HUGE = int("9" * 400)
EDGES = [
    pytest.param(HUGE, id="400-digit"),
    pytest.param(-HUGE, id="minus-400-digit"),
    pytest.param(1e308, id="1e308"),
    pytest.param(-1e308, id="minus-1e308"),
]


class Api:
    def __init__(self, client: TestClient, ctx: ServerContext) -> None:
        self.client, self.ctx = client, ctx

    def post(self, path: str, body: dict[str, Any]) -> Any:
        return self.client.post(
            path, headers={**AUTH, "Content-Type": "application/json"}, content=json.dumps(body).encode()
        )


@pytest.fixture(scope="module")
def api(
    redis_base_url: str, tiny_models_dir: Path, tiny_text_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Api]:
    import redis

    url = f"{redis_base_url}/4"
    redis.Redis.from_url(url).flushdb()
    app_settings = Settings(
        data_dir=tmp_path_factory.mktemp("edges") / "server", redis_url=url, api_keys=[TEST_API_KEY], images_wait_s=20
    )
    ctx = build_context(app_settings, make_fleet("m1", families=FAMILIES | {"llama"}), migrate=True)
    ctx.registry.add(tiny_models_dir / IMAGE_MODEL, IMAGE_MODEL)
    ctx.registry.add(tiny_text_dir / TEXT_MODEL, TEXT_MODEL)
    bring_online(ctx, "m1", {IMAGE_MODEL, TEXT_MODEL})
    with TestClient(create_app(app_settings, ctx), raise_server_exceptions=False) as client:
        yield Api(client, ctx)
    ctx.close()


def job(kind: str, model: str, **params: Any) -> dict[str, Any]:
    return {"model": model, "kind": kind, "target": "m1", "params": {"prompt": "a lighthouse", **params}}


# route, body with the value in place of VALUE, the field the error must name
JOB_FIELDS = ["steps", "width", "height", "guidance_scale", "seed", "n"]
TEXT_JOB_FIELDS = ["max_new_tokens", "temperature", "top_p", "seed"]
OPENAI_FIELDS = ["max_tokens", "temperature", "top_p", "seed", "n"]
CHAT_FIELDS = [*OPENAI_FIELDS, "max_completion_tokens"]
TGI_FIELDS = ["max_new_tokens", "temperature", "top_p", "seed", "top_k", "repetition_penalty"]
IMAGE_FIELDS = ["n", "steps"]
HF_FIELDS = ["width", "height", "num_inference_steps", "guidance_scale", "seed"]


def cases() -> Iterator[tuple[str, str, Any, str]]:
    for field in JOB_FIELDS:
        yield "/v1/jobs?dry_run=true", "txt2img", field, f"params.{field}"
    yield "/v1/jobs?dry_run=true", "img2img", "strength", "params.strength"
    for field in TEXT_JOB_FIELDS:
        yield "/v1/jobs?dry_run=true", "text", field, f"params.{field}"
    for field in OPENAI_FIELDS:
        yield "/v1/completions", "", field, field
    for field in CHAT_FIELDS:
        yield "/v1/chat/completions", "", field, field
    for field in IMAGE_FIELDS:
        yield "/v1/images/generations", "", field, field
    for field in HF_FIELDS:
        yield "/hf", "", field, f"parameters.{field}"
    for path in ("/generate", "/generate_stream", "/"):
        for field in TGI_FIELDS:
            yield path, "", field, f"parameters.{field}"


def body_of(path: str, kind: str, field: str, value: Any) -> dict[str, Any]:
    if path.startswith("/v1/jobs"):
        return job(kind, TEXT_MODEL if kind == "text" else IMAGE_MODEL, **{field: value})
    if path == "/v1/completions":
        return {"model": TEXT_MODEL, "prompt": "a lighthouse", "target": "m1", field: value}
    if path == "/v1/chat/completions":
        return {"model": TEXT_MODEL, "messages": [{"role": "user", "content": "hi"}], "target": "m1", field: value}
    if path == "/v1/images/generations":
        return {"model": IMAGE_MODEL, "prompt": "a fox", "target": "m1", field: value}
    if path == "/hf":
        return {"inputs": "a fox", "parameters": {field: value}}
    return {"inputs": "a lighthouse", "model": TEXT_MODEL, "target": "m1", "parameters": {field: value}}


def message_of(answer: Any) -> str:
    body = answer.json()
    error = body.get("error", body.get("detail", body))
    return json.dumps(error)


@pytest.mark.parametrize("value", EDGES)
@pytest.mark.parametrize(("path", "kind", "field", "named"), list(cases()))
def test_a_number_at_the_edge_is_422_naming_the_field(
    api: Api, path: str, kind: str, field: str, named: str, value: Any
) -> None:
    """R22: a 422 naming the client's field, never a 500 (``math.isfinite`` overflowed on a
    400-digit integer; pydantic's float fields take it as a float)."""
    answer = api.post(path, body_of(path, kind, field, value))
    assert answer.status_code == refused_status(path), (answer.status_code, answer.text[:500])
    assert named in answer.text or f"`{field}` must be" in answer.text, answer.text[:500]  # check_submission's
    assert len(answer.text) < 2000, answer.text  # the value is shown cut, not in its 400 digits
    assert not [job.id for job in api.ctx.journal.list() if job.state != JobState.rejected]  # nothing queued


def answer_to_a_failed_job(api: Api, path: str, body: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """POST ``body`` to ``path`` in a thread while the job it submits is claimed and failed;
    (the route's answer, the ended job)."""
    answers: list[Any] = []
    sender = threading.Thread(target=lambda: answers.append(api.post(path, body)))
    sender.start()
    try:
        ended = end_job(api, fail=True)
    finally:
        sender.join(30)
    (answer,) = answers
    return answer, ended


def test_a_400_digit_integer_is_refused_naming_the_param_and_its_range(api: Api) -> None:
    """R22: check_numbers compares an int as it is (math.isfinite overflowed: a 500 before)."""
    answer = api.post("/v1/jobs?dry_run=true", job("txt2img", IMAGE_MODEL, guidance_scale=HUGE))
    assert answer.status_code == 422, answer.text
    error = answer.json()["error"]
    assert error["param"] == "params.guidance_scale"
    assert "must be a number from 0 to 50, got 9999999999" in error["message"]
    assert "(400 digits)" in error["message"]


def test_a_temperature_below_the_greedy_bound_is_journaled_as_greedy(api: Api) -> None:
    """5e-324 is above 0 (TGI and OpenAI both accept it) but divides logits to inf: the job is
    journaled with temperature 0.0, greedy decoding, as OpenAI's 0 (GREEDY_TEMPERATURE)."""
    cases = ((5e-324, 0.0), (GREEDY_TEMPERATURE / 2, 0.0), (GREEDY_TEMPERATURE, GREEDY_TEMPERATURE), (0.7, 0.7))
    for temperature, journaled in cases:
        params: dict[str, Any] = {"prompt": "once", "temperature": temperature, "seed": 1}
        api.ctx.dispatcher.validator.request(TEXT_MODEL, "text", params, "m1")
        assert params["temperature"] == journaled, (temperature, params)
    assert greedy(5e-324) and greedy(0.0) and not greedy(GREEDY_TEMPERATURE)


def end_job(api: Api, fail: bool) -> dict[str, Any]:
    """The one queued text job, once a route has submitted it: claimed by m1 and failed (its
    params as journaled)."""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        queued = [job for job in api.ctx.journal.list() if job.state == JobState.queued and job.kind == "text"]
        if queued:
            break
        time.sleep(0.05)
    else:
        raise AssertionError("no text job was queued")
    (job,) = queued
    assert api.client.post(f"/internal/v1/jobs/{job.id}/claim", headers=M1).status_code == 200
    if fail:
        failed = api.client.post(
            f"/internal/v1/jobs/{job.id}/failure",
            headers=M1,
            json={"reason": "error", "message": "probability tensor contains inf"},
        )
        assert failed.status_code == 200, failed.text
    return {"id": job.id, "params": dict(job.params or {})}


@pytest.mark.parametrize("path", ["/generate", "/"])
def test_a_failed_job_on_a_tgi_route_is_424_generation_with_its_reason(api: Api, path: str) -> None:
    """TGI answers a failed generation 424 ``error_type: generation`` (never a 500): the job's
    reason and message, its id, ``x-should-retry: false``. The tiny temperature reached the job
    as 0.0 (greedy)."""
    body = {
        "inputs": "once upon",
        "model": TEXT_MODEL,
        "target": "m1",
        "parameters": {"temperature": 5e-324, "max_new_tokens": 4, "seed": 3},
    }
    answer, ended = answer_to_a_failed_job(api, path, body)
    assert ended["params"]["temperature"] == 0.0
    assert answer.status_code == 424, answer.text
    error = answer.json()
    assert error["error_type"] == "generation" and error["reason"] == "error"
    assert "probability tensor contains inf" in error["error"] and ended["id"] in error["error"]
    assert error["job_ids"] == [ended["id"]]
    assert answer.headers["x-should-retry"] == "false"


def test_a_failed_job_on_an_openai_route_stays_a_server_error(api: Api) -> None:
    """OpenAI's routes answer a failed job as OpenAI does (500 ``server_error``, its reason as
    ``code``), naming the job."""
    body = {"model": TEXT_MODEL, "prompt": "once upon", "target": "m1", "temperature": 5e-324, "max_tokens": 4}
    answer, ended = answer_to_a_failed_job(api, "/v1/completions", body)
    assert answer.status_code == 500, answer.text
    error = answer.json()["error"]
    assert error["type"] == "server_error" and error["code"] == "error" and error["job_ids"] == [ended["id"]]


@pytest.mark.parametrize(("path", "status"), [("/v1/completions", 409), ("/generate", 424)])
def test_a_job_cancelled_while_running_is_no_server_error(api: Api, path: str, status: int) -> None:
    """A running text job cancelled by ``POST /v1/jobs/{id}/cancel`` (its worker stops between
    steps and reports ``cancelled``): the OpenAI route answers 409 with the job's reason as
    ``code``, the request having been ended by a caller; TGI's answers a generation without a
    result, 424. Neither is a 5xx, and both name the job and say not to retry."""
    body: dict[str, Any] = {"model": TEXT_MODEL, "target": "m1"}
    body |= {"prompt": "once upon", "max_tokens": 4} if path == "/v1/completions" else {"inputs": "once upon"}
    answers: list[Any] = []
    sender = threading.Thread(target=lambda: answers.append(api.post(path, body)))
    sender.start()
    try:
        ended = end_job(api, fail=False)  # claimed: running on m1
        assert api.post(f"/v1/jobs/{ended['id']}/cancel", {}).status_code == 202
        stopped = api.client.post(
            f"/internal/v1/jobs/{ended['id']}/failure",
            headers=M1,
            json={"reason": "cancelled", "message": "cancelled by request while running, after 1 of 4 steps"},
        )
        assert stopped.status_code == 200, stopped.text
    finally:
        sender.join(30)
    (answer,) = answers
    assert answer.status_code == status, answer.text
    assert answer.headers["x-should-retry"] == "false"
    assert api.ctx.journal.get(ended["id"]).state == JobState.cancelled
    if status == 409:
        error = answer.json()["error"]
        assert (error["type"], error["code"], error["job_ids"]) == ("conflict_error", "cancelled", [ended["id"]])
    else:
        assert answer.json()["error_type"] == "generation" and answer.json()["reason"] == "cancelled"


def test_a_chat_message_of_an_unknown_role_is_422_naming_it(api: Api) -> None:
    """OpenAI's roles only (system, developer, user, assistant; no tool calls here): another is
    a 422 naming ``messages.0.role``, before any job."""
    before = len(api.ctx.journal.list())
    body = {"model": TEXT_MODEL, "messages": [{"role": "bogus", "content": "x"}], "target": "m1"}
    answer = api.post("/v1/chat/completions", body)
    assert answer.status_code == 400, answer.text  # OpenAI's status (BadRequestError)
    error = answer.json()["error"]
    assert error["param"] == "messages.0.role" and "'system', 'developer', 'user' or 'assistant'" in error["message"]
    assert len(api.ctx.journal.list()) == before


def test_a_chat_message_s_unknown_field_is_refused_and_an_answers_own_fields_are_taken(api: Api) -> None:
    """A field a chat message does not have (``foo``) is refused naming it, never dropped; an
    earlier answer's assistant message sent back as history (the SDK's ``model_dump()``:
    ``refusal``, ``annotations``, ``audio``, ``function_call``, ``tool_calls`` empty or null) and
    OpenAI's ``name`` are taken, the job running as without them."""
    before = len(api.ctx.journal.list())
    body = {"model": TEXT_MODEL, "messages": [{"role": "user", "content": "hi", "foo": 1}], "target": "m1"}
    answer = api.post("/v1/chat/completions", body)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == "messages.0.foo" and "Extra inputs are not permitted" in error["message"], error
    with_calls = {**body, "messages": [{"role": "assistant", "content": "x", "tool_calls": [{"id": "1"}]}]}
    called = api.post("/v1/chat/completions", with_calls).json()["error"]
    assert called["param"] == "messages.0.tool_calls" and "at most 0 items" in called["message"], called
    assert len(api.ctx.journal.list()) == before
    history = [
        {"role": "user", "content": "name a colour", "name": "bob"},
        {
            "role": "assistant",
            "content": "red",
            "refusal": None,
            "annotations": [],
            "audio": None,
            "function_call": None,
            "tool_calls": None,
        },
        {"role": "user", "content": "another"},
    ]
    answer, ended = answer_to_a_failed_job(
        api, "/v1/chat/completions", {"model": TEXT_MODEL, "messages": history, "target": "m1", "max_tokens": 2}
    )
    assert answer.status_code == 500, answer.text  # accepted, then failed by the test (not refused)
    assert "red" in ended["params"]["prompt"] and "another" in ended["params"]["prompt"]


def test_a_chat_message_s_text_parts_make_the_same_prompt_as_its_string(api: Api) -> None:
    """OpenAI's list form of ``content`` (``[{"type": "text", "text": ...}]``, what several SDK
    helpers send) is read as its text parts joined with newlines: the job journals the same
    chat-templated prompt as the string form."""
    prompts = []
    for content in (
        "be brief\nname a colour",
        [{"type": "text", "text": "be brief"}, {"type": "text", "text": "name a colour"}],
    ):
        body = {
            "model": TEXT_MODEL,
            "messages": [{"role": "user", "content": content}],
            "target": "m1",
            "max_tokens": 2,
        }
        answer, ended = answer_to_a_failed_job(api, "/v1/chat/completions", body)
        assert answer.status_code == 500, answer.text  # accepted, then failed by the test (not refused: 422)
        prompts.append(ended["params"]["prompt"])
    assert prompts[0] == prompts[1] and "name a colour" in prompts[0]


def test_a_chat_message_s_image_part_is_422_naming_its_content(api: Api) -> None:
    """A text model cannot see an image: an ``image_url`` part is a 422 naming
    ``messages.0.content`` and the part's type, before any job."""
    before = len(api.ctx.journal.list())
    parts = [{"type": "text", "text": "what is this"}, {"type": "image_url", "image_url": {"url": "data:,"}}]
    body = {"model": TEXT_MODEL, "messages": [{"role": "user", "content": parts}], "target": "m1"}
    answer = api.post("/v1/chat/completions", body)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == "messages.0.content", error
    assert "part 1 is not a text part" in error["message"] and "'image_url'" in error["message"], error
    assert len(api.ctx.journal.list()) == before


# route, body, the field its error's ``param`` must name: values in the schema's range but over
# the family's limits (app/core/limits.py), refused by the job's checks (app/jobs/validation.py)
OVER_LIMITS = [
    pytest.param("/v1/jobs?dry_run=true", job("txt2img", IMAGE_MODEL, steps=151), "params.steps", id="jobs-steps"),
    pytest.param("/v1/jobs?dry_run=true", job("txt2img", IMAGE_MODEL, width=12), "params.width", id="jobs-width"),
    pytest.param(
        "/v1/jobs?dry_run=true", job("txt2img", IMAGE_MODEL, prompt="x" * 4097), "params.prompt", id="jobs-prompt"
    ),
    pytest.param(
        "/v1/jobs?dry_run=true", job("txt2img", IMAGE_MODEL, steps="many"), "params.steps", id="jobs-steps-string"
    ),
    pytest.param(
        "/v1/images/generations",
        {"model": IMAGE_MODEL, "prompt": "a fox", "target": "m1", "steps": 151},
        "steps",
        id="openai-steps",
    ),
    pytest.param(
        "/hf",
        {"inputs": "a fox", "parameters": {"num_inference_steps": 151}},
        "parameters.num_inference_steps",
        id="hf-steps",
    ),
    pytest.param("/hf", {"inputs": "a fox", "parameters": {"width": 12}}, "parameters.width", id="hf-width"),
    pytest.param(  # far over the limit: the same refusal as just over it (a schema bound answered before)
        "/v1/images/generations",
        {"model": IMAGE_MODEL, "prompt": "a fox", "target": "m1", "steps": 20000},
        "steps",
        id="openai-steps-far",
    ),
    pytest.param(
        "/hf",
        {"inputs": "a fox", "parameters": {"num_inference_steps": 20000}},
        "parameters.num_inference_steps",
        id="hf-steps-far",
    ),
]


@pytest.mark.parametrize(("path", "body", "param"), OVER_LIMITS)
def test_a_value_over_the_family_limit_names_the_client_field_in_param(
    api: Api, path: str, body: dict[str, Any], param: str
) -> None:
    """R22: the refusal's ``param`` is the field the client sent (``params.steps`` on
    ``POST /v1/jobs``, ``steps`` on OpenAI's route, ``parameters.num_inference_steps`` on
    Hugging Face's), as the message names it, so a client can point at it without parsing text."""
    answer = api.post(path, body)
    assert answer.status_code == refused_status(path), answer.text[:500]
    error = answer.json()["error"]
    assert error["param"] == param, error
    if param.endswith("steps") and '"many"' not in json.dumps(body):  # the family's limit, whatever the number
        assert error.get("reason", error.get("code")) == "invalid_steps" and "between 1 and" in error["message"], error


# route, body, the field its error's ``param`` must name and the reason: a model, kind or target
# that does not fit, refused by the registry, the validator or placement (which know no field names)
WRONG_CHOICES = [
    pytest.param("/v1/jobs", job("txt2img", "no-such-model"), "model", "unknown_model", id="jobs-model"),
    pytest.param("/v1/jobs", job("text", IMAGE_MODEL), "kind", "kind_not_supported", id="jobs-kind"),
    pytest.param(
        "/v1/jobs", {**job("txt2img", IMAGE_MODEL), "target": "m9"}, "target", "unknown_machine", id="jobs-target"
    ),
    pytest.param(
        "/v1/chat/completions",
        {"model": IMAGE_MODEL, "messages": [{"role": "user", "content": "hi"}]},
        "model",
        "kind_not_supported",
        id="chat-image-model",
    ),
    pytest.param(
        "/v1/completions", {"model": IMAGE_MODEL, "prompt": "hi"}, "model", "kind_not_supported", id="completion-image"
    ),
]


@pytest.mark.parametrize(("path", "body", "param", "reason"), WRONG_CHOICES)
def test_a_model_kind_or_target_that_does_not_fit_names_its_field(
    api: Api, path: str, body: dict[str, Any], param: str, reason: str
) -> None:
    """R10, R22: an unknown model, a kind the model does not run (a chat with an image model
    included: not a missing chat template) or an unknown machine names the client's field."""
    answer = api.post(path, body)
    assert answer.status_code in (404, refused_status(path)), answer.text[:500]
    error = answer.json()["error"]
    assert (error["param"], error.get("code", error.get("reason"))) == (param, reason), error


def test_a_missing_input_image_is_refused_naming_its_param(api: Api) -> None:
    """R22: img2img without ``params.image`` names the field in ``param``, as every other
    refusal of one request field does (docs/api.md, errors)."""
    answer = api.post("/v1/jobs?dry_run=true", job("img2img", IMAGE_MODEL))
    assert answer.status_code == 422, answer.text
    error = answer.json()["error"]
    assert (error["reason"], error["param"]) == ("invalid_params", "params.image"), error
    assert "params.image is required for kind 'img2img'" in error["message"]
