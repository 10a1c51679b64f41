"""No request gets a 5xx, whatever its bytes (R22, R24): NaN, Infinity and
1e999 are refused as invalid JSON numbers, strings UTF-8 cannot encode (a lone surrogate) as
invalid text, each a 422 naming the field; the validation-error handler itself never fails.

The named cases of the issue first, then Hypothesis properties over the body of every route
that takes one (JSON and multipart), on a real Redis and journal, through the real ASGI app
with a registered tiny model and an online machine, so that valid-looking bodies reach the
tokenizer, the registry, placement and the journal. ``CASES`` counts the requests sent; the
module's teardown prints the figures (``-s`` shows them)."""

from __future__ import annotations

import json
import math
import re
import types
import typing
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from app.api.routes.hf import HF_PARAMS
from app.api.server import create_app
from app.api.strict_json import faults, printable, strict_loads
from app.context import ServerContext, build_context
from app.core.config import Settings
from app.core.digest import bytes_digest
from app.core.states import JobState
from tests.helpers import TEST_API_KEY, bring_online, make_fleet, png, refused_status

MODEL = "tiny-sd"
AUTH = {"Authorization": f"Bearer {TEST_API_KEY}"}
M1 = {"Authorization": f"Bearer {make_fleet('m1').machines['m1'].token}", "X-Homefleet-Machine": "m1"}
CASES: Counter[str] = Counter()
FIVE_XX: list[str] = []
PROPERTY = settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)


class Hostile:
    """What one module's worth of hostile requests run against: the app, and ids that exist."""

    def __init__(self, client: TestClient, ctx: ServerContext) -> None:
        self.client, self.ctx = client, ctx
        queued = client.post(
            "/v1/jobs",
            headers=AUTH,
            json={"model": MODEL, "kind": "txt2img", "target": "m1", "params": {"prompt": "a lighthouse", "steps": 2}},
        )
        assert queued.status_code == 202, queued.text
        self.job_id = queued.json()["id"]
        assert client.post(f"/internal/v1/jobs/{self.job_id}/claim", headers=M1).status_code == 200
        self.file_id = client.post(
            "/v1/files", headers=AUTH, files={"file": ("a.png", png(64, 64), "image/png")}
        ).json()["id"]

    def path(self, route: APIRoute) -> str:
        values = {
            "job_id": self.job_id,
            "machine": "m1",
            "sync_id": "0" * 32,
            "model": MODEL,
            "model_id": MODEL,
            "file_id": self.file_id,
            "path": "model_index.json",
        }
        return re.sub(r"\{(\w+)(:path)?\}", lambda m: values[m.group(1)], route.path)

    def send(self, method: str, path: str, label: str | None = None, **kwargs: Any) -> int:
        headers = M1 if path.startswith("/internal/") else AUTH
        answer = self.client.request(method, path, headers={**headers, **kwargs.pop("headers", {})}, **kwargs)
        CASES[label or f"{method} {path.replace(self.job_id, '{job_id}')}"] += 1
        if answer.status_code >= 500 and not documented(answer.status_code, answer.text, path):
            FIVE_XX.append(f"{method} {path} {kwargs!r:.300} -> {answer.status_code} {answer.text[:300]}")
        return answer.status_code


def documented(status: int, text: str, path: str) -> bool:
    """The 5xx answers docs/api.md lists for a request: 503 naming the machine that is unavailable."""
    return status == 503 and "machine_unavailable" in text


@pytest.fixture(scope="module")
def hostile(redis_base_url: str, tiny_models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hostile]:
    import redis

    url = f"{redis_base_url}/3"
    redis.Redis.from_url(url).flushdb()
    app_settings = Settings(
        data_dir=tmp_path_factory.mktemp("hostile") / "server",
        redis_url=url,
        api_keys=[TEST_API_KEY],
        fleet_lock_ttl_s=5,
        fleet_lock_wait_s=5,
        images_wait_s=2,
    )
    ctx = build_context(app_settings, make_fleet("m1", "m2"), migrate=True)
    ctx.registry.add(tiny_models_dir / MODEL, MODEL)
    bring_online(ctx, "m1", {MODEL})  # server and m2 stay offline: images routes answer 503 fast
    with TestClient(create_app(app_settings, ctx), raise_server_exceptions=False) as client:
        yield Hostile(client, ctx)
    print(f"\nhostile input: {sum(CASES.values())} requests, {len(FIVE_XX)} 5xx; per route: {dict(CASES)}")


@pytest.fixture(autouse=True)
def no_5xx() -> Iterator[None]:
    FIVE_XX.clear()
    yield
    assert not FIVE_XX, "5xx answers:\n" + "\n".join(FIVE_XX[:10])


# -- the named cases of the issue ---------------------------------------------------------------

SURROGATE = '"\\ud800"'
NAMED = [
    ("/v1/jobs", '{"model": NaN, "kind": "txt2img"}', "body.model"),
    ("/v1/jobs", '{"model": "tiny-sd", "kind": "txt2img", "params": {"steps": Infinity}}', "body.params.steps"),
    (
        "/v1/jobs",
        '{"model": "tiny-sd", "kind": "txt2img", "params": {"guidance_scale": 1e999}}',
        "body.params.guidance_scale",
    ),
    ("/v1/jobs", '{"model": "tiny-sd", "kind": "txt2img", "params": {"prompt": "a \\ud800 b"}}', "body.params.prompt"),
    (
        "/v1/jobs?dry_run=true",
        '{"model": "tiny-sd", "kind": "txt2img", "target": "m1", '
        '"params": {"prompt": "a", "negative_prompt": ' + SURROGATE + "}}",
        "body.params.negative_prompt",
    ),
    (
        "/v1/jobs",
        '{"model": "tiny-sd", "kind": "txt2img", "target": "m1", "params": {"prompt": "a", "\\udfff": 1}}',
        "body.params.\\udfff",
    ),
    ("/v1/jobs", '{"model": ' + SURROGATE + ', "kind": "txt2img"}', "body.model"),
    ("/v1/jobs", '{"model": "tiny-sd", "kind": ' + SURROGATE + "}", "body.kind"),
    ("/v1/jobs", '{"model": "tiny-sd", "kind": "txt2img", "target": ' + SURROGATE + "}", "body.target"),
    ("PUT /v1/machines/m1/residency", '{"models": NaN}', "body.models"),
    ("PUT /v1/machines/m1/residency", '{"models": [' + SURROGATE + "]}", "body.models.0"),
    ("/internal/v1/jobs/{job_id}/progress", '{"step": NaN, "total": 4}', "body.step"),
    ("/internal/v1/jobs/{job_id}/failure", '{"reason": "error", "message": "x", "load_s": -Infinity}', "body.load_s"),
    ("/internal/v1/jobs/{job_id}/failure", '{"reason": ' + SURROGATE + ', "message": "x"}', "body.reason"),
    ("/internal/v1/syncs/{sync_id}/progress", '{"files_done": 1e999, "bytes_done": 0}', "body.files_done"),
    ("/internal/v1/syncs/{sync_id}/finish", '{"results": [], "x": NaN}', "body.x"),
    ("/v1/images/generations", '{"prompt": "a fox", "guidance_scale": NaN}', "guidance_scale"),
    ("/v1/images/generations", '{"prompt": "a fox", "guidance_scale": 1e999}', "guidance_scale"),
    ("/hf", '{"inputs": "a fox", "parameters": {"guidance_scale": NaN}}', "parameters.guidance_scale"),
    ("/hf", '{"inputs": ' + SURROGATE + "}", "inputs"),
]


@pytest.mark.parametrize(("route", "body", "field"), NAMED)
def test_nan_infinity_and_lone_surrogates_are_422_naming_the_field(
    hostile: Hostile, route: str, body: str, field: str
) -> None:
    """Each case it found (R22): 422, the field named, nothing journaled as a
    job and no traceback."""
    method, _, path = route.rpartition(" ")
    path = path.replace("{job_id}", hostile.job_id).replace("{sync_id}", "0" * 32)
    jobs_before = len(hostile.ctx.journal.list())
    answer = hostile.client.request(
        method or "POST",
        path,
        content=body.encode(),
        headers={**(M1 if path.startswith("/internal/") else AUTH), "content-type": "application/json"},
    )
    assert answer.status_code == refused_status(path), answer.text
    assert f"`{field}`" in answer.json()["error"]["message"], answer.text
    assert len(hostile.ctx.journal.list()) == jobs_before


@pytest.mark.parametrize("path", ["/v1/jobs", "/v1/chat/completions", "/v1/images/generations", "/hf"])
def test_a_body_that_is_not_json_is_refused_as_the_body_not_a_field(hostile: Hostile, path: str) -> None:
    """A truncated body is 422 naming ``body`` and the character where parsing stopped, not a
    field called ``body.9`` (the decoder's offset used to stand in the field's place)."""
    answer = hostile.client.post(path, content=b'{"model":', headers={**AUTH, "content-type": "application/json"})
    assert answer.status_code == refused_status(path), answer.text
    message = answer.json()["error"]["message"]
    assert "invalid JSON" in message and "(char 9)" in message, message
    assert "body.9" not in answer.text and answer.json()["error"].get("param") in (None, "body"), answer.text


def test_result_form_numbers_and_provenance_must_be_finite(hostile: Hostile) -> None:
    """The worker's result form: ``load_s=nan``/``inf`` and a provenance with NaN are 422 and
    store nothing; the job stays running."""
    data = png(64, 64)
    form = {"digest": bytes_digest(data), "load_s": "0.1", "run_s": "0.2", "cold_load": "false"}
    for bad in (
        {"load_s": "nan"},
        {"run_s": "inf"},
        {"provenance": '{"seed": NaN}'},
        {"provenance": '{"x": "\\ud800"}'},
    ):
        answer = hostile.client.post(
            f"/internal/v1/jobs/{hostile.job_id}/result",
            headers=M1,
            data={**form, **bad},
            files={"file": ("r.png", data, "image/png")},
        )
        assert answer.status_code == 422, (bad, answer.text)
    assert hostile.ctx.journal.get(hostile.job_id).state == JobState.running


def test_strict_loads_names_every_fault() -> None:
    """The parser itself: every non-finite number and unencodable string, keys included, with
    its path; what is echoed back is always serializable."""
    value = json.loads('{"a": [1, NaN, {"\\ud800": Infinity}], "b": "\\udfff", "c": 1e999, "ok": 1.5}')
    found = {location for location, _message, _value in faults(value)}
    assert found == {("a", 1), ("a", 2, "\\ud800"), ("a", 2, "\ud800"), ("b",), ("c",)}
    json.dumps(printable(value), allow_nan=False).encode("utf-8")
    with pytest.raises(RequestValidationError) as raised:
        strict_loads(b'{"x": NaN}')
    assert raised.value.errors()[0]["loc"] == ("body", "x")
    assert strict_loads(b'{"x": 1.5, "y": "\xc3\xa9"}') == {"x": 1.5, "y": "é"}


# -- properties over every route's body ---------------------------------------------------------

ANY_TEXT = st.text(st.characters(codec=None, categories=None), max_size=40)
TEXT = (
    ANY_TEXT
    | st.builds("{}\ud800{}".format, ANY_TEXT, ANY_TEXT)
    | st.sampled_from(
        ["", " ", "\ud800", "a\udfffb", "\x00", "tiny-sd", "txt2img", "video", "auto", "m1", "server", "ü" * 80]
    )
)
NUMBER = (
    st.sampled_from([math.nan, math.inf, -math.inf])
    | st.floats()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.sampled_from([0, 1, 2, 8, 64, 4096, 2**31, -1, 0.5])
)
LEAF = st.none() | st.booleans() | NUMBER | TEXT
JSON = st.recursive(
    LEAF, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TEXT, inner, max_size=4), max_leaves=12
)


def half(usual: Any, hostile: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """``usual`` half the time (so that validation gets past it), else a ``hostile`` value."""
    return st.booleans().flatmap(lambda ok: st.just(usual) if ok else hostile)


def typed(annotation: Any) -> st.SearchStrategy[Any]:
    """Hostile values of a body field's type: text for ``str``, numbers for numbers, lists and
    models of those, anything for the rest."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        return st.one_of([typed(arg) for arg in args if arg is not type(None)] or [LEAF])
    if origin is list:
        return st.lists(typed(args[0]) if args else LEAF, max_size=3)
    if origin is dict:
        return st.dictionaries(TEXT, LEAF, max_size=3)
    if annotation is str:
        return TEXT
    if annotation in (int, float):
        return NUMBER
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return st.fixed_dictionaries(
            {name: half(usual(f.annotation), typed(f.annotation)) for name, f in annotation.model_fields.items()}
        )
    return LEAF


def usual(annotation: Any) -> Any:
    """A plain valid-looking value of a body field's type."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        return usual(next((arg for arg in args if arg is not type(None)), str))
    return {str: "m1", int: 1, float: 0.5, bool: False, list: []}.get(origin or annotation)


PARAMS = st.fixed_dictionaries(
    {"prompt": half("a lighthouse", TEXT)},
    optional=dict.fromkeys(
        ("negative_prompt", "width", "height", "steps", "seed", "guidance_scale", "frames", "n", "image"), LEAF
    ),
) | st.dictionaries(TEXT | st.sampled_from(["prompt", "negative_prompt", "steps"]), LEAF, max_size=4)
SHAPED = {
    # The images routes wait for their jobs (images_wait_s; no worker runs them here): their
    # usual target is m2, offline, so a valid body is answered 503 at once.
    "/v1/jobs": st.fixed_dictionaries(
        {"model": half(MODEL, LEAF), "kind": half("txt2img", LEAF), "target": half("m1", LEAF), "params": PARAMS}
    ),
    "/v1/images/generations": st.fixed_dictionaries(
        {"prompt": half("a fox", LEAF), "model": half(MODEL, LEAF), "target": half("m2", LEAF)},
        optional={"negative_prompt": LEAF, "size": LEAF, "n": LEAF, "steps": LEAF, "guidance_scale": LEAF},
    ),
    "/hf": st.fixed_dictionaries(
        {
            "inputs": half("a fox", LEAF),
            "parameters": PARAMS | st.fixed_dictionaries({}, optional=dict.fromkeys(HF_PARAMS, LEAF)),
        }
    ),
}


def shaped(route: APIRoute) -> st.SearchStrategy[Any]:
    """Bodies with the route's own fields, each its usual value or a hostile one of its type."""
    if route.path.startswith(tuple(SHAPED)):
        return SHAPED[next(path for path in SHAPED if route.path.startswith(path))]
    assert route.body_field is not None
    return typed(route.body_field.field_info.annotation)


def dumps(value: Any, big: bool) -> bytes:
    """JSON text as a careless client writes it: NaN/Infinity literals, ``\\ud800`` escapes, and
    with ``big`` every infinity written as ``1e999``."""
    text = json.dumps(value, allow_nan=True)
    if big:
        text = text.replace("-Infinity", "-1e999").replace("Infinity", "1e999")
    return text.encode()


def routes_with_bodies(kind: str) -> list[APIRoute]:
    from app.api.routes import (
        events,
        images,
        internal,
        public,
        residency,
        serving,
        sync,
    )

    routes = [
        route
        for router in (
            public.router,
            events.router,
            images.router,
            internal.router,
            sync.public_router,
            sync.internal_router,
            residency.router,
            serving.router,
        )
        for route in router.routes
        if isinstance(route, APIRoute) and route.body_field is not None
    ]
    multipart = {"File", "Form"}
    return [r for r in routes if (type(r.body_field.field_info).__name__ in multipart) == (kind == "multipart")]  # type: ignore[union-attr]


def method(route: APIRoute) -> str:
    return min(route.methods - {"HEAD"})


@pytest.mark.parametrize("route", routes_with_bodies("json"), ids=lambda r: f"{method(r)} {r.path}")
def test_no_5xx_for_any_json_body(hostile: Hostile, route: APIRoute) -> None:
    """Property: any JSON value, any bytes claiming to be JSON, and bodies with
    the route's own fields holding hostile values (NaN, Infinity, 1e999, huge integers, lone
    surrogates, NUL, wrong types) are answered below 500; a non-finite number or lone surrogate
    is always a 4xx."""
    path = hostile.path(route)
    verb = method(route)
    query = "?dry_run=true" if route.path == "/v1/jobs" else ""

    @PROPERTY
    @given(body=st.one_of(shaped(route), JSON), big=st.booleans())
    def hostile_json(body: Any, big: bool) -> None:
        for suffix in {"", query}:
            status = hostile.send(
                verb, path + suffix, content=dumps(body, big), headers={"content-type": "application/json"}
            )
            if any(True for _ in faults(body)):
                assert 400 <= status < 500, (body, status)

    @PROPERTY
    @given(raw=st.binary(max_size=200) | st.text(max_size=60).map(str.encode))
    def raw_bytes(raw: bytes) -> None:
        hostile.send(verb, path, content=raw, headers={"content-type": "application/json"})

    hostile_json()
    raw_bytes()


@pytest.mark.parametrize("route", routes_with_bodies("multipart"), ids=lambda r: f"{method(r)} {r.path}")
def test_no_5xx_for_any_multipart_body(hostile: Hostile, route: APIRoute) -> None:
    """Property: any form fields (text that is not UTF-8, ``nan``, ``inf``,
    huge numbers) and any file bytes (garbage, truncated or valid PNGs) are answered below 500."""
    path = hostile.path(route)
    names = [
        "file",
        "image",
        "mask",
        "digest",
        "load_s",
        "run_s",
        "cold_load",
        "provenance",
        "prompt",
        "model",
        "n",
        "size",
        "response_format",
    ]
    value = st.binary(max_size=40) | st.sampled_from(
        [b"nan", b"inf", b"-inf", b"1e999", b"\xed\xa0\x80", b"true", b"0.1", b"tiny-sd", b'{"a": NaN}', b"64x64"]
    )
    image = st.sampled_from([png(64, 64), png(64, 64)[:50], b"\x89PNG\r\n\x1a\n<html>", b""]) | st.binary(max_size=64)

    @PROPERTY
    @given(
        fields=st.dictionaries(st.sampled_from(names), value, max_size=6),
        upload=image,
        field=st.sampled_from(["file", "image"]),
    )
    def hostile_form(fields: dict[str, bytes], upload: bytes, field: str) -> None:
        data = {name: raw for name, raw in fields.items() if name not in ("file", "image")}
        boundary = "hostileboundary"
        parts = [
            f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n'.encode() + raw + b"\r\n"
            for name, raw in data.items()
        ]
        parts.append(
            f'--{boundary}\r\nContent-Disposition: form-data; name="{field}"; filename="x.png"\r\n'
            f"Content-Type: image/png\r\n\r\n".encode()
            + upload
            + b"\r\n"
        )
        body = b"".join(parts) + f"--{boundary}--\r\n".encode()
        hostile.send("POST", path, content=body, headers={"content-type": f"multipart/form-data; boundary={boundary}"})

    hostile_form()


@PROPERTY
@given(segment=st.binary(min_size=1, max_size=30), query=st.binary(max_size=30))
def test_no_5xx_for_any_path_or_query(hostile: Hostile, segment: bytes, query: bytes) -> None:
    """Property: percent-encoded arbitrary bytes (invalid UTF-8, encoded surrogates) in ids and
    query strings are answered below 500."""
    from urllib.parse import quote_from_bytes

    part, q = quote_from_bytes(segment, safe=""), quote_from_bytes(query, safe="")
    for path in (
        f"/v1/jobs/{part}",
        f"/v1/syncs/{part}",
        f"/v1/machines/{part}/residency",
        f"/v1/ooms?machine={q}",
        f"/v1/jobs?dry_run={q}",
    ):
        hostile.send(
            "GET" if "dry_run" not in path else "POST",
            path,
            label="paths and queries",
            **({"json": {"model": MODEL, "kind": "txt2img"}} if "dry_run" in path else {}),
        )
