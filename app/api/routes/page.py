"""The fleet page (docs/operations.md, "The fleet page"): ``GET /`` and its assets
``GET /page/{name}``, static files that ship inside the package (``app/api/page/``; no build step, no CDN).

The page holds no data, so it is served without a key; it asks for an API key once, keeps it
in ``sessionStorage`` and sends it as ``Authorization: Bearer <key>`` on every call to the
JSON API (``/v1/...``), which checks it as for any client. Every answer here carries
:data:`PAGE_CSP`: the browser loads and connects to this server only.
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse

from app.core.errors import NotFound

router = APIRouter()

PAGE_DIR = Path(str(files("app.api") / "page"))
#: The page's files and their media types; nothing else is served from ``/page/``.
ASSETS = {
    "index.html": "text/html; charset=utf-8",
    "app.js": "text/javascript; charset=utf-8",
    "style.css": "text/css; charset=utf-8",
    "icon.svg": "image/svg+xml",  # the tab's icon: the server above its machines
}
#: 'self' only: scripts, styles and requests to this server; results are shown from blob: URLs
#: (fetched with the key, since an <img> cannot send one).
PAGE_CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' blob: data:; "
    "media-src 'self' blob:; connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)


def _asset(name: str) -> FileResponse:
    if name not in ASSETS:
        raise NotFound(f"the page has no file {name!r} (it has {', '.join(sorted(ASSETS))})", reason="not_found")
    return FileResponse(
        PAGE_DIR / name,
        media_type=ASSETS[name],
        headers={"Content-Security-Policy": PAGE_CSP, "X-Content-Type-Options": "nosniff", "Cache-Control": "no-cache"},
    )


@router.get(
    "/", response_class=FileResponse, responses={200: {"content": {"text/html": {}}, "description": "the page"}}
)
def fleet_page() -> FileResponse:
    """The fleet page (HTML): Fleet, Jobs, Gallery and Submit views over the JSON API."""
    return _asset("index.html")


@router.get("/favicon.ico", include_in_schema=False)
def favicon() -> FileResponse:
    """The tab icon where a browser asks for it by the old name (pages without a ``<link
    rel="icon">``: the JSON answers, the docs): ``icon.svg``, as an SVG."""
    return _asset("icon.svg")


@router.get("/page/{name}", include_in_schema=False)
def page_asset(name: str) -> FileResponse:
    """One of the page's files (:data:`ASSETS`); 404 naming them for any other name."""
    return _asset(name)
