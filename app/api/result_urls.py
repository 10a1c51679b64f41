"""Result URLs a client can open without the API key: what OpenAI's image routes answer for
``response_format: "url"`` (a link valid for a while, opened by a browser, an ``<img>`` tag,
``urllib``), where a Homefleet result otherwise needs ``Authorization: Bearer <key>``.

A URL of the image routes is ``<base_url>/v1/jobs/<id>/result?index=<i>&expires=<unix s>&
signature=<hex>``: HMAC-SHA256, under the API key that asked for the image, of the job, the
index and the expiry, ``result_url_ttl_s`` (one hour, as OpenAI's) after it was answered.
:func:`signature_grants` checks such a URL (app/api/auth.py lets a request that carries one
through without a key): no secret beyond the API keys, and a key taken out of
``HOMEFLEET_API_KEYS`` ends every link made for it. With no API key configured (the routes open,
``allow_open_api``) the URL is the plain one.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import time
from collections.abc import Mapping
from datetime import UTC, datetime

from app.core.config import Settings
from app.core.errors import Unauthorized

RESULT_PATH = re.compile(r"/v1/jobs/(?P<job>[^/]+)/result")
"""The path of ``GET /v1/jobs/{id}/result`` (the only path a signature opens)."""
SIGNATURE = "signature"
EXPIRES = "expires"


def _signature(api_key: str, job_id: str, index: int, expires: int) -> str:
    message = f"result\n{job_id}\n{index}\n{expires}".encode()
    return hmac.new(api_key.encode(), message, hashlib.sha256).hexdigest()


def signed_result_url(
    settings: Settings, api_key: str | None, job_id: str, index: int = 0, now: float | None = None
) -> str:
    """The absolute URL of result ``index`` of ``job_id``: ``settings.base_url`` (never the
    request's Host) + ``/v1/jobs/<id>/result``, ``?index=i`` after the first; when API keys
    are configured and ``api_key`` (the caller's key) is given, also ``expires`` (Unix seconds,
    ``now`` + ``settings.result_url_ttl_s``) and ``signature``, so that it opens without the key
    until then (:func:`signature_grants`)."""
    url = f"{settings.base_url}/v1/jobs/{job_id}/result"
    query = [f"index={index}"] if index else []
    if settings.api_keys and api_key:
        expires = int((time.time() if now is None else now) + settings.result_url_ttl_s)
        query += [f"{EXPIRES}={expires}", f"{SIGNATURE}={_signature(api_key, job_id, index, expires)}"]
    return url + (f"?{'&'.join(query)}" if query else "")


def signature_grants(settings: Settings, path: str, query: Mapping[str, str], now: float | None = None) -> bool:
    """Whether a request for ``path`` with ``query`` (its query parameters) is let through by a
    result URL's signature: False when it carries none, or is for another path (a key is then
    needed as usual); True when the signature is one of a configured API key's for this job,
    index and expiry, and the expiry has not passed.

    Raises:
        Unauthorized: a signature on a result path that is past its expiry (reason
            ``result_url_expired``, naming when and the fixes) or that no configured key made,
            e.g. altered, or made for a key since removed (``invalid_signature``).
    """
    match = RESULT_PATH.fullmatch(path)
    if match is None or SIGNATURE not in query:
        return False
    index_text, expires_text = query.get("index", "0"), query.get(EXPIRES, "")
    if not index_text.isdigit() or not expires_text.isdigit():
        raise Unauthorized(
            "a result URL's `index` and `expires` must be whole numbers; use the URL as the image route answered it",
            reason="invalid_signature",
        )
    index, expires = int(index_text), int(expires_text)
    given = query[SIGNATURE].encode()
    if not any(
        hmac.compare_digest(given, _signature(key, match["job"], index, expires).encode()) for key in settings.api_keys
    ):
        raise Unauthorized(
            "this result URL's signature was not made by any of this server's API keys (altered, or its key was "
            "removed); use the URL as the image route answered it, or fetch the result with "
            "'Authorization: Bearer <API key>'",
            reason="invalid_signature",
        )
    if (time.time() if now is None else now) >= expires:
        at = datetime.fromtimestamp(expires, UTC).isoformat(timespec="seconds")
        raise Unauthorized(
            f"this result URL expired at {at} (result URLs are valid for result_url_ttl_s = "
            f"{settings.result_url_ttl_s:g} s after the answer); fetch the result with "
            "'Authorization: Bearer <API key>', or ask for the image again",
            reason="result_url_expired",
        )
    return True
