"""The worker's client for the server's internal API (R1: the worker writes nothing itself).
Its bodies and answers are the typed models of ``app/core/protocol.py``."""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import httpx

from app.core.digest import bytes_digest
from app.core.errors import (
    Conflict,
    Forbidden,
    HomefleetError,
    IntegrityFailure,
    NotFound,
    ServiceDown,
    StorageFull,
    Unauthorized,
)
from app.core.protocol import (
    Claim,
    FailureReport,
    Manifest,
    Manifests,
    ProgressReport,
    ResultReceipt,
    RevocationReceipt,
    Revocations,
    SyncFileResult,
    SyncFinish,
    SyncGrant,
    SyncProgress,
)
from app.core.tls import tls_context
from tasks.logfork import no_fork_meanwhile

if TYPE_CHECKING:
    from app.core.config import WorkerSettings

log = logging.getLogger("homefleet.worker")


class ServerClient:
    """Talks to ``<server_url>/internal/v1`` with the machine's bearer token; given several
    servers' URLs (standby servers), to the first that answers.

    Only idempotent calls are repeated, and only while the server is unreachable or answers
    that its Redis or journal is down (see :meth:`_send`); a refusal is never retried. Raises :class:`Conflict` when a
    claim is refused,
    :class:`NotFound`/:class:`Forbidden` for another machine's or an unknown job, and
    ``httpx.HTTPError`` on transport errors.
    """

    def __init__(
        self,
        server_url: str | list[str],
        token: str,
        timeout_s: float,
        boot_id: str = "",
        retry_s: float = 0.0,
        machine: str = "",
    ) -> None:
        self.retry_s = retry_s
        headers = {"Authorization": f"Bearer {token}"}
        if machine:
            headers["X-Homefleet-Machine"] = machine  # the server checks the token is this machine's
        if boot_id:
            headers["X-Homefleet-Boot-Id"] = boot_id  # which worker process claims (reconciliation)
        urls = [server_url] if isinstance(server_url, str) else list(server_url)
        # One connection pool per server; calls go to the current one (docs/operations.md, "A
        # standby server": every server answers the internal API on one journal).
        self.clients = [
            httpx.Client(
                base_url=f"{url.rstrip('/')}/internal/v1", headers=headers, timeout=timeout_s, verify=tls_context()
            )
            for url in urls
        ]
        self.current = 0

    @property
    def http(self) -> httpx.Client:
        """The client of the server calls go to now."""
        return self.clients[self.current]

    @classmethod
    def for_worker(cls, settings: WorkerSettings, boot_id: str = "", *, patient: bool = False) -> ServerClient:
        """The client a worker talks to its servers with: its ``server_urls``, its machine's token
        and name, ``http_timeout_s``; ``boot_id`` (the worker start that claims, sent with every
        call; "": none). ``patient``: repeat idempotent calls while no server is reachable
        for up to ``server_retry_s`` seconds (a job's claim and reports); otherwise one try of each
        server (a report sent again at the next beat, a start-up check). The one place a worker
        builds one (tests/unit/tasks/test_worker_composition.py)."""
        return cls(
            settings.server_urls,
            settings.worker_token,
            settings.http_timeout_s,
            boot_id,
            settings.server_retry_s if patient else 0.0,
            machine=settings.machine,
        )

    def close(self) -> None:
        for client in self.clients:
            client.close()

    def _send(
        self, method: str, url: str, *, once: bool = False, until_answered: bool = False, **kwargs: Any
    ) -> httpx.Response:
        """Send; while the server is unreachable (transport error), or answers 503 because its
        Redis or journal does not (:class:`ServiceDown`), try the next server at once (standby
        servers), and once every server has failed in turn, pause and go round again, for up
        to ``retry_s`` seconds in all (0: each server once). Only idempotent calls go through
        here: a claim carries its claim id, a result or failure for an ended job is refused with
        409, progress overwrites. A claim the journal took before Redis failed under it (its
        answer a 503) is therefore taken again by the same delivery, not left ``running`` with
        nobody running it (R19); and a claim made while one server is down reaches another
        before reconciliation judges its job lost (R19, ``lost_grace_s``). ``once``: each server
        once, without a pause (a step's progress report: the run does not wait on it).
        ``until_answered``: no deadline at all (a claim, :meth:`claim`)."""
        deadline = math.inf if until_answered else time.monotonic() + (0.0 if once else self.retry_s)
        pause_s = 0.2
        failed_in_turn = 0
        while True:
            try:
                with no_fork_meanwhile():  # one attempt at a time (tasks/logfork.py), never a pause
                    return self._check(self.http.request(method, url, **kwargs))
            except (httpx.TransportError, ServiceDown) as error:
                what = "server unreachable" if isinstance(error, httpx.TransportError) else "server's services down"
                failed_in_turn += 1
                if failed_in_turn < len(self.clients):
                    log.warning(
                        "%s at %s (%s); trying %s %s at the next server", what, self.http.base_url, error, method, url
                    )
                    self.current = (self.current + 1) % len(self.clients)
                    continue
                if time.monotonic() + pause_s > deadline:
                    raise
                log.warning("%s (%s); trying %s %s again in %.1f s", what, error, method, url, pause_s)
                time.sleep(pause_s)
                pause_s = min(pause_s * 2, 5.0)
                failed_in_turn = 0
                self.current = (self.current + 1) % len(self.clients)

    def _check(self, response: httpx.Response) -> httpx.Response:
        if response.is_success:
            return response
        try:
            error = response.json().get("error") or {}
        except ValueError:
            error = {}
        message = error.get("message") or response.text[:500]
        reason = error.get("reason")
        for cls in (Conflict, NotFound, Forbidden, Unauthorized, StorageFull):
            if response.status_code == cls.status_code:
                raise cls(message, reason=reason)
        if response.status_code == ServiceDown.status_code and reason in ServiceDown.REASONS:
            raise ServiceDown(f"server answered 503: {message}", reason=reason)
        error = HomefleetError(f"server answered {response.status_code}: {message}", reason=reason)
        error.status_code = response.status_code  # e.g. a 500 or 503: tasks/spool.py retries those uploads
        raise error

    def manifest(self) -> dict[str, Manifest]:
        """Every registered model's manifest, by model id."""
        return self.manifests().models

    def manifests(self) -> Manifests:
        """Every registered model's manifest, by model id, and the families this machine runs
        (its fleet entry's; None from a server that does not say)."""
        answer = self._send("GET", "/manifest").json()
        with no_fork_meanwhile():  # pydantic-core, in the registry follower's thread (tasks/logfork.py)
            return Manifests.model_validate(answer)

    def claim(self, job_id: str, claim_id: str) -> Claim:
        """Claim the job (``queued -> running``) for the delivery ``claim_id``.

        A patient client (``retry_s`` > 0, a pool process's) waits out an unreachable server
        (or its 503 ``redis_down``/``journal_down``) for as long as it takes, not ``retry_s``:
        the delivery's message left the queue when it was delivered (early ack, R8), so a claim
        given up would leave the job ``queued`` with its message nowhere, ended ``lost`` by
        reconciliation once the server is back though it never ran; and each later message
        would go the same way, one per ``retry_s`` of the outage (R19). Nothing else can run
        meanwhile: every job starts with a claim.

        Raises:
            Conflict: a second delivery (another claim id) of a job claimed already.
            HomefleetError: any other refusal (unknown job, another machine's, a token refused).
            httpx.HTTPError: the server unreachable, from a client with ``retry_s`` 0.
        """
        return Claim.model_validate(
            self._send(
                "POST",
                f"/jobs/{job_id}/claim",
                until_answered=self.retry_s > 0,
                headers={"X-Homefleet-Claim-Id": claim_id},
            ).json()
        )

    def progress(
        self,
        job_id: str,
        step: int,
        total: int,
        text: str | None = None,
        tokens: list[int] | None = None,
        logprobs: list[float] | None = None,
    ) -> None:
        body = ProgressReport(step=step, total=total, text=text, tokens=tokens, logprobs=logprobs).model_dump(
            exclude_none=True
        )
        # each server once (a standby takes over: the report reaches it, and so do later ones,
        # so reconciliation there does not judge the job hung); never a pause in the run
        self._send("POST", f"/jobs/{job_id}/progress", once=True, json=body)

    def input_file(self, file_id: str) -> bytes:
        """The bytes of an uploaded input, checked against ``file_id`` (their digest).

        Raises:
            IntegrityFailure: the bytes received hash to another digest (nothing is used).
            NotFound: the server has no such file.
        """
        data = self._send("GET", f"/files/{file_id}").content
        actual = bytes_digest(data)
        if actual != file_id:
            raise IntegrityFailure(f"input {file_id} arrived as bytes that hash to {actual}", reason="integrity")
        return data

    def upload(
        self,
        job_id: str,
        data: bytes,
        media_type: str,
        digest: str,
        *,
        load_s: float,
        run_s: float,
        cold_load: bool,
        provenance: dict[str, Any] | None = None,
        more: list[tuple[bytes, str]] | None = None,
    ) -> ResultReceipt:
        """Upload the result with its digest and provenance; the server verifies and stores it (R2).
        ``more``: (bytes, digest) of images 2..n of a job with n > 1, in order, in the
        same request: the server stores all of them or none."""
        form = {
            "digest": digest,
            "load_s": f"{load_s:.6f}",
            "run_s": f"{run_s:.6f}",
            "cold_load": str(cold_load).lower(),
            "provenance": json.dumps(provenance or {}, sort_keys=True),
            "more_digests": json.dumps([extra_digest for _, extra_digest in more or []]),
        }
        files: list[tuple[str, tuple[str, bytes, str]]] = [("file", ("result", data, media_type))]
        files += [("more", (f"result.{i}", extra, media_type)) for i, (extra, _) in enumerate(more or [], start=1)]
        return ResultReceipt.model_validate(self._send("POST", f"/jobs/{job_id}/result", data=form, files=files).json())

    def fail(
        self, job_id: str, reason: str, message: str, *, load_s: float | None = None, run_s: float | None = None
    ) -> None:
        with no_fork_meanwhile():  # pydantic-core, also in the parent's reporter thread (tasks/logfork.py)
            body = FailureReport(reason=reason, message=message[:4000], load_s=load_s, run_s=run_s).model_dump()
        self._send("POST", f"/jobs/{job_id}/failure", json=body)

    def revocations(self, job_ids: list[str], *, terminated: bool = False, announced: bool = False) -> dict[str, str]:
        """Tell the server these jobs' tasks were revoked (C11; at most
        ``REVOCATIONS_PER_REPORT`` ids); returns the jobs it ended, id -> new state. Idempotent:
        a job already ended is skipped."""
        with no_fork_meanwhile():  # pydantic-core, in the heartbeat's thread (tasks/logfork.py)
            body = Revocations(job_ids=job_ids, terminated=terminated, announced=announced).model_dump()
        answer = self._send("POST", "/revocations", json=body).json()
        with no_fork_meanwhile():
            return RevocationReceipt.model_validate(answer).ended

    # --- sync (R6): see app/jobs/sync.py ---

    def sync_claim(self, sync_id: str) -> SyncGrant:
        """Take the sync (once): the manifests of its models. Raises Conflict."""
        return SyncGrant.model_validate(self._check(self.http.post(f"/syncs/{sync_id}/claim")).json())

    def sync_progress(self, sync_id: str, files_done: int, bytes_done: int, file: str, bytes_kept: int = 0) -> None:
        """Report progress (renews the machine's reservation): bytes at their place so far, of
        them ``bytes_kept`` not downloaded (:class:`app.core.protocol.SyncProgress`). Raises
        Conflict when it expired."""
        body = SyncProgress(files_done=files_done, bytes_done=bytes_done, bytes_kept=bytes_kept, file=file)
        self._send("POST", f"/syncs/{sync_id}/progress", once=True, json=body.model_dump())

    def sync_finish(
        self, sync_id: str, succeeded: bool, message: str, results: list[SyncFileResult], verified: list[str]
    ) -> None:
        """End the sync with every file's outcome and the models verified afterwards (R4)."""
        body = SyncFinish(succeeded=succeeded, message=message[:4000], results=results, verified=verified)
        self._check(self.http.post(f"/syncs/{sync_id}/finish", json=body.model_dump()))

    @contextmanager
    def model_file(self, model_id: str, path: str, offset_bytes: int = 0) -> Iterator[httpx.Response]:
        """Stream one model file from the server, from ``offset_bytes`` on (HTTP Range). The
        response is 206 when the server honoured the range, 200 when it sends the whole file."""
        headers = {"Range": f"bytes={offset_bytes}-"} if offset_bytes else {}
        with self.http.stream("GET", f"/models/{model_id}/files/{path}", headers=headers) as response:
            if not response.is_success:
                response.read()
                self._check(response)
            yield response
