"""API keys on the public routes (``Authorization: Bearer <key>``).

Keys come from ``Settings.api_keys``. With no key configured the server refuses to start
unless ``allow_open_api`` is set, and then says at start-up that the public routes are open
(:func:`check_api_keys`). ``/health`` and ``/metrics`` stay open for probes and scrapers;
the internal routes use per-machine tokens instead (app/api/routes/deps.py).
"""

from __future__ import annotations

import hmac
import logging
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from app.core.config import Settings
from app.core.errors import HomefleetError, Unauthorized

log = logging.getLogger(__name__)


class OpenApiRefused(HomefleetError):
    """Raised at start-up when no API key is configured and ``allow_open_api`` is not set."""

    default_reason = "no_api_keys"


def check_api_keys(settings: Settings) -> None:
    """Fail at start-up without keys unless open access was asked for explicitly.

    Raises:
        OpenApiRefused: ``api_keys`` is empty and ``allow_open_api`` is false.
    """
    if settings.api_keys:
        return
    if not settings.allow_open_api:
        raise OpenApiRefused(
            "no API key configured: set HOMEFLEET_API_KEYS='[\"<key>\"]' (a JSON list), or "
            "HOMEFLEET_ALLOW_OPEN_API=true to serve the public routes without a key"
        )
    log.warning("no API key configured and allow_open_api is set: the public routes are OPEN to anyone who can reach them")


def bearer_token(authorization: str) -> str | None:
    scheme, _, token = authorization.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


#: The public routes' security scheme in the OpenAPI document (Swagger's "Authorize" button).
#: ``auto_error=False``: a missing key is refused by :func:`require_api_key` as a domain error.
API_KEY_SCHEME = HTTPBearer(scheme_name="ApiKey", auto_error=False,
                            description="an API key of this server (HOMEFLEET_API_KEYS): `Authorization: Bearer <key>`")


def require_api_key(request: Request,
                    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(API_KEY_SCHEME)] = None) -> None:
    """Dependency of every public route.

    Raises:
        Unauthorized: no ``Authorization: Bearer <key>`` header, or a key not configured.
    """
    settings: Settings = request.app.state.settings
    if not settings.api_keys:
        return  # open only when allow_open_api was set (check_api_keys at start-up)
    token = credentials.credentials.strip() if credentials is not None and credentials.credentials.strip() else None
    if token is None:
        raise Unauthorized("public routes need 'Authorization: Bearer <API key>'", reason="missing_api_key")
    if not any(hmac.compare_digest(token.encode(), key.encode()) for key in settings.api_keys):
        raise Unauthorized("the API key is not one of this server's keys", reason="invalid_api_key")


ApiKey = Depends(require_api_key)
