"""The API's documents: ``/docs`` and ``/redoc`` load from assets shipped in a
package (no CDN), the public schema declares the bearer scheme its routes check, and the
workers' routes are absent from it and documented apart, for a machine token (R24)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from app.api.server import create_app
from app.context import ServerContext, build_context
from app.core.config import Settings
from tests.helpers import TEST_API_KEY, make_fleet

OPEN_ROUTES = {("get", "/health"), ("get", "/metrics"), ("get", "/")}  # probes, scrapers, the page (app/api/auth.py)
METHODS = {"get", "post", "put", "delete", "patch"}


@pytest.fixture
def api(settings: Settings) -> Iterator[tuple[TestClient, ServerContext]]:
    ctx = build_context(settings, make_fleet("m1"), migrate=True)
    with TestClient(create_app(settings, ctx)) as client:
        yield client, ctx


def operations(schema: dict) -> list[tuple[str, str, dict]]:  # type: ignore[type-arg]
    return [
        (path, method, op) for path, item in schema["paths"].items() for method, op in item.items() if method in METHODS
    ]


def test_public_schema_declares_the_bearer_scheme_on_every_keyed_route_and_no_internal_route(
    api: tuple[TestClient, ServerContext],
) -> None:
    client, _ctx = api
    schema = client.get("/openapi.json").json()
    assert schema["components"]["securitySchemes"]["ApiKey"] == {
        "type": "http",
        "scheme": "bearer",
        "description": schema["components"]["securitySchemes"]["ApiKey"]["description"],
    }
    ops = operations(schema)
    assert len(ops) >= 15
    assert not [path for path, _, _ in ops if path.startswith("/internal")]
    for path, method, op in ops:
        if (method, path) in OPEN_ROUTES:
            assert "security" not in op, (method, path)
        else:
            assert op.get("security") == [{"ApiKey": []}], (method, path)
    assert "MachineToken" not in schema["components"]["securitySchemes"]
    # The scheme is what the routes check: a key in the header Swagger's Authorize sends works.
    assert client.get("/v1/models").status_code == 401
    assert client.get("/v1/models", headers={"Authorization": f"Bearer {TEST_API_KEY}"}).status_code == 200


def test_internal_schema_is_apart_and_needs_a_machine_token(api: tuple[TestClient, ServerContext]) -> None:
    client, ctx = api
    url = "/internal/openapi.json"
    assert client.get(url).status_code == 401
    assert client.get(url, headers={"Authorization": f"Bearer {TEST_API_KEY}"}).status_code == 401  # a client key
    token = ctx.fleet.machines["m1"].token
    internal = client.get(url, headers={"Authorization": f"Bearer {token}"})
    assert internal.status_code == 200
    schema = internal.json()
    paths = set(schema["paths"])
    assert {
        "/internal/v1/manifest",
        "/internal/v1/jobs/{job_id}/claim",
        "/internal/v1/jobs/{job_id}/result",
        "/internal/v1/syncs/{sync_id}/claim",
    } <= paths
    assert all(path.startswith("/internal/v1/") for path in paths)
    assert schema["components"]["securitySchemes"]["MachineToken"]["scheme"] == "bearer"
    assert all(
        op.get("security") == [{"MachineToken": []}]
        for path, _, op in operations(schema)
        if path != "/internal/v1/join"
    )
    join = schema["paths"]["/internal/v1/join"]["post"]  # a new host has a join token, no machine token yet
    assert join["security"] == [{"JoinToken": []}]
    assert url not in client.get("/openapi.json").json()["paths"]


@pytest.mark.parametrize("page", ["/docs", "/redoc"])
def test_docs_pages_load_only_assets_the_server_serves(api: tuple[TestClient, ServerContext], page: str) -> None:
    client, _ctx = api
    html = client.get(page)
    assert html.status_code == 200 and html.headers["content-type"].startswith("text/html")
    assert not re.findall(r"https?://", html.text), "a docs page must not load anything from the internet"
    assets = re.findall(r"""(?:src|href)=["']?([^"' >]+)""", html.text) + re.findall(
        r"""url: ?['"]([^'"]+)""", html.text
    )
    assert any(asset.endswith(".js") for asset in assets)
    for asset in assets:
        served = client.get(asset)
        assert served.status_code == 200 and served.content, asset
    assert "/openapi.json" in html.text
    policy = html.headers["content-security-policy"]  # the browser may load nothing from elsewhere
    assert "default-src 'self'" in policy and "https:" not in policy and "*" not in policy


def test_the_docs_assets_come_from_the_installed_package() -> None:
    import fastapi_offline

    static = Path(fastapi_offline.__file__).parent / "static"
    assert {"swagger-ui-bundle.js", "swagger-ui.css", "redoc.standalone.js"} <= {p.name for p in static.iterdir()}
