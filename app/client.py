"""A small Python client for Homefleet's public API, for web backends and scripts.

It never retries a POST on its own (R20): a submission is sent once; a failure is raised.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx

from app.core.errors import HomefleetError
from app.core.states import ENDED
from app.core.tls import tls_context


class ApiError(HomefleetError):
    """Raised when the server answers a request with an error; ``status_code`` is its HTTP code,
    ``retry_after_s`` its ``Retry-After`` (whole seconds; None without one), e.g. of a 429
    ``quota_queued`` / ``quota_gpu_seconds`` (an API key over its quota) or ``queue_full``;
    ``param`` the request field at fault (e.g. ``params.image``) and ``job_id`` the journaled
    ``rejected`` job of a refused submission, when the answer names them (None otherwise)."""

    def __init__(
        self,
        status_code: int,
        reason: str,
        message: str,
        retry_after_s: int | None = None,
        param: str | None = None,
        job_id: str | None = None,
    ) -> None:
        super().__init__(message, reason=reason, param=param)
        self.status_code = status_code
        self.retry_after_s = retry_after_s
        self.job_id = job_id


class HomefleetClient:
    def __init__(self, base_url: str, timeout_s: float = 30.0, api_key: str | None = None) -> None:
        # httpx's default transport makes no retries; nothing here adds any (R20).
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(
            base_url=base_url.rstrip("/"), timeout=timeout_s, headers=headers, verify=tls_context()
        )

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> HomefleetClient:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def _json(self, response: httpx.Response) -> Any:
        if response.is_success:
            return response.json()
        try:
            body = response.json()
        except ValueError:
            body = {}
        error = body.get("error") if isinstance(body, dict) else None
        retry = response.headers.get("retry-after", "")
        retry_after_s = int(retry) if retry.isdigit() else None
        if isinstance(error, dict):
            raise ApiError(
                response.status_code,
                error.get("reason") or error.get("code") or "error",  # OpenAI: code
                error.get("message", ""),
                retry_after_s,
                param=error.get("param"),
                job_id=error.get("job_id"),
            )
        raise ApiError(response.status_code, "error", str(body.get("detail", response.text[:500])), retry_after_s)

    def submit(
        self,
        model: str,
        kind: str,
        params: dict[str, Any],
        target: str = "server",
        idempotency_key: str | None = None,
        webhook_url: str | None = None,
    ) -> dict[str, Any]:
        """``POST /v1/jobs`` exactly once. Returns ``{id, state, machine, position, url}``.
        ``webhook_url``: the job's record is POSTed there, signed, when it ends (docs/api.md "Webhooks").

        To retry safely after a transport error, call again with the same ``idempotency_key``:
        the server then returns the original job instead of creating a second one (R20).
        Raises ApiError for an error answer, ``httpx.HTTPError`` for a transport error.
        """
        body: dict[str, Any] = {"model": model, "kind": kind, "params": params, "target": target}
        if webhook_url is not None:
            body["webhook_url"] = webhook_url
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
        return self._json(self.http.post("/v1/jobs", json=body, headers=headers))

    def cancel(self, job_id: str) -> dict[str, Any]:
        """Cancel a job; returns it: ``cancelled`` when it was queued, still ``running`` when it
        runs (it stops between steps and ends ``cancelled`` within seconds: :meth:`wait`).
        ApiError 409 when it has ended."""
        return self._json(self.http.post(f"/v1/jobs/{job_id}/cancel"))

    def requeue(self, job_id: str, idempotency_key: str | None = None, **changes: Any) -> dict[str, Any]:
        """``POST /v1/jobs/{id}/requeue`` exactly once: a new job with that job's params;
        ``seed=None`` draws a new seed, ``seed=N`` takes N, ``target=`` another target. Returns as
        :meth:`submit`. To retry safely, call again with the same ``idempotency_key`` (R20): the
        server returns the first requeue's job. Raises as :meth:`submit`."""
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
        return self._json(self.http.post(f"/v1/jobs/{job_id}/requeue", json=changes, headers=headers))

    def progress(self, job_id: str, timeout_s: float = 300.0, poll_s: float = 0.2) -> Iterator[dict[str, Any]]:
        """Yield the job each time its state or step changes, ending with the ended job.
        Raises ``TimeoutError`` after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        last: tuple[Any, ...] | None = None
        while True:
            job = self.get(job_id)
            seen = (job["state"], (job.get("progress") or {}).get("step"))
            if seen != last:
                last = seen
                yield job
            if job["state"] in ENDED:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} still {job['state']} after {timeout_s} s")
            time.sleep(poll_s)

    def upload(self, data: bytes, filename: str = "input.png") -> dict[str, Any]:
        """``POST /v1/files`` once: store an input image. Returns ``{id, media_type, size_bytes}``;
        name ``id`` in a job's params (``"image": id``). Raises ApiError (422 over a limit)."""
        return self._json(self.http.post("/v1/files", files={"file": (filename, data)}))

    def get(self, job_id: str) -> dict[str, Any]:
        return self._json(self.http.get(f"/v1/jobs/{job_id}"))

    def wait(self, job_id: str, timeout_s: float = 300.0, poll_s: float = 0.2) -> dict[str, Any]:
        """Poll until the job has ended; return it. Raises ``TimeoutError`` after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            job = self.get(job_id)
            if job["state"] in ENDED:
                return job
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} still {job['state']} after {timeout_s} s")
            time.sleep(poll_s)

    def download(self, job_id: str, index: int = 0) -> bytes:
        """The bytes of result ``index`` (0: the first; image i of a job with ``n`` images:
        ``GET /v1/jobs/{id}/result?index=i``); raises ApiError if there is none (404
        ``result_not_found`` past the last)."""
        response = self.http.get(f"/v1/jobs/{job_id}/result", params={"index": index} if index else None)
        if not response.is_success:
            self._json(response)
        return response.content

    def models(self) -> list[dict[str, Any]]:
        """The registered models (``GET /v1/models``'s ``data``: OpenAI's list shape, each model
        with Homefleet's fields: ``family``, ``kinds``, ``params``...)."""
        return self._json(self.http.get("/v1/models"))["data"]

    def model(self, model_id: str) -> dict[str, Any]:
        """One registered model (``GET /v1/models/{id}``); raises ApiError (404 ``unknown_model``)."""
        return self._json(self.http.get(f"/v1/models/{model_id}"))

    def machines(self) -> list[dict[str, Any]]:
        return self._json(self.http.get("/v1/machines"))
