"""The Celery task ``homefleet.sync``: pull model files from the server (R6).

Published by the server to this machine's own queue (design in ``app/jobs/sync.py``). Per file:

1. already at its final name with the manifest's size and digest: kept (``present``); a
   regular file with other content (a copy of content the registry no longer holds, after
   ``homefleet models update``, or a damaged one): set aside once the new copy is verified,
   renamed to ``.<name>.<its digest[:16]>.superseded`` in the same folder, and reported
   ``replaced`` - a sync never deletes a file on the worker (R6). A link there is judged by
   the bytes it leads to: kept when they match, else the link itself is set aside the same way
   (what it points to is never touched); a folder there is left untouched (``conflict``);
2. otherwise downloaded to ``.<name>.<digest[:16]>.partial`` in the same folder, resuming
   from that file's length with HTTP Range when an earlier copy was cut;
3. fsynced, hashed in full and compared with the manifest; a mismatch after a resume (the
   partial copy was damaged, not a prefix of this file) downloads the whole file again, once;
   a mismatch then removes the partial (the sync's own file) and reports ``digest_mismatch``;
4. hard-linked to its final name (after the superseded file, if any, was set aside), which
   fails if anything appeared there meanwhile (an atomic rename that cannot overwrite), then
   the partial name is removed and the folder fsynced.

A process killed at any point leaves at most the ``.partial`` file: nothing unverified ever
sits at a final name (C06). After copying, the whole model folder is re-verified and the
advertised set replaced (R4).

From claim to finish, a :class:`Renewal` thread reports progress every ``REPORT_EVERY_S``,
whatever the copy is doing, so the machine's reservation (R6) stays alive while a large file
is hashed (many seconds in one call, with no bytes to report) as well as while it downloads.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from app.core.digest import algorithm_of, file_digest, hex_part
from app.core.errors import HomefleetError
from app.core.protocol import SYNC_FILE_DONE, ManifestFile, SyncFileResult
from tasks import runtime
from tasks.server_client import ServerClient
from tasks.verify import advertise

log = logging.getLogger("homefleet.worker")

CHUNK_BYTES = 256 * 1024
REPORT_EVERY_S = 0.5  # progress reports renew the reservation (Settings.sync_reservation_ttl_s)


class Renewal:
    """Keeps a sync's reservation alive (R6): a daemon thread that calls ``report`` (a progress
    report, which renews the reservation) every ``interval_s`` seconds until the ``with`` block
    ends, however it ends; leaving the block waits for a report in flight (at most the HTTP
    client's timeout), so none arrives after the sync's finish.

    A report the server refuses (``HomefleetError``, e.g. ``Conflict`` when the reservation
    expired) stops the thread; :meth:`check` raises it in the copying thread, which then stops
    copying. A transport error is logged and the next report tries again.
    """

    def __init__(self, report: Callable[[], None], interval_s: float = REPORT_EVERY_S) -> None:
        self.report = report
        self.interval_s = interval_s
        self.refusal: HomefleetError | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="homefleet-sync-renewal", daemon=True)

    def __enter__(self) -> Renewal:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()

    def check(self) -> None:
        """Raises the server's refusal of a renewal (``HomefleetError``), if there was one."""
        if self.refusal is not None:
            raise self.refusal

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.report()
            except HomefleetError as refusal:
                self.refusal = refusal
                return
            except httpx.HTTPError as error:
                log.warning("sync progress not reported (retrying in %.1f s): %s", self.interval_s, error)


def _result(model_id: str, path: str, status: str, size_bytes: int, message: str = "") -> SyncFileResult:
    """One file's outcome: ``present`` | ``copied`` | ``replaced`` | ``conflict`` | ``digest_mismatch``."""
    return SyncFileResult(model_id=model_id, path=path, status=status, size_bytes=size_bytes, message=message)


class Copier:
    """Copies manifest files from the server into ``models_dir``, reporting bytes as it goes.

    ``on_bytes(n, kept)`` is called after every chunk written (``kept`` False), and for bytes
    found in place rather than downloaded (``kept`` True: a file present with its digest, the
    part of a partial copy a download resumes after; negative when a resume is refused and
    counting starts again); ``max_bytes_per_s`` (None: no cap) throttles the download.
    """

    def __init__(
        self,
        server: ServerClient,
        models_dir: Path,
        on_bytes: Callable[[int, bool], None],
        max_bytes_per_s: int | None = None,
    ) -> None:
        self.server = server
        self.models_dir = models_dir
        self.on_bytes = on_bytes
        self.max_bytes_per_s = max_bytes_per_s

    def copy(self, model_id: str, entry: ManifestFile) -> SyncFileResult:
        """Bring one manifest entry to its final name. Raises ``httpx.HTTPError``/``HomefleetError``
        on transport or server errors (the partial stays)."""
        path, size, digest = entry.path, entry.size, entry.digest
        final = self.models_dir / model_id / path
        superseded: Path | None = None  # where a file of other content is set aside (R6: never deleted)
        if final.exists() or final.is_symlink():
            if not final.is_symlink() and not final.is_file():
                return _result(
                    model_id,
                    path,
                    "conflict",
                    size,
                    f"{final} is a folder; a sync replaces only a file or a link - move it away and sync again",
                )
            # A link (a Hugging Face cache's snapshot links to its blobs; a link made by hand) is
            # judged by the bytes it leads to; when they differ, or it leads nowhere, the link
            # itself is set aside (its target is never touched) as a regular file of other content is.
            tag = "dangling"  # a link that leads nowhere
            if final.is_file():  # a regular file, or a link to one
                held = file_digest(final, algorithm_of(digest))
                if final.stat().st_size == size and held == digest:
                    self.on_bytes(size, True)
                    return _result(model_id, path, "present", size)
                tag = hex_part(held)[:16]
            superseded = final.parent / f".{final.name}.{tag}.superseded"
        final.parent.mkdir(parents=True, exist_ok=True)
        partial = final.parent / f".{final.name}.{hex_part(digest)[:16]}.partial"
        offset = partial.stat().st_size if partial.exists() else 0
        if offset > size:  # not a prefix of this file: the sync's own leftover, start again
            partial.unlink()
            offset = 0
        self.on_bytes(offset, True)
        if offset:
            log.info("resuming %s/%s at byte %d of %d (HTTP Range)", model_id, path, offset, size)
        if offset < size:
            self._download(model_id, path, partial, offset)
        actual = self._digest(partial, digest)
        if actual != digest and offset:
            # the partial copy resumed was not a prefix of this file (damaged, or another's):
            # download the whole file again, once, rather than fail the sync over its leftover
            log.warning(
                "%s/%s: the partial copy resumed at byte %d did not match (%s); downloading it again from byte 0",
                model_id,
                path,
                offset,
                actual,
            )
            partial.unlink()
            self.on_bytes(-offset, True)
            self.on_bytes(-(size - offset), False)
            self._download(model_id, path, partial, 0)
            actual = self._digest(partial, digest)
        if actual != digest:
            partial.unlink()
            return _result(
                model_id,
                path,
                "digest_mismatch",
                size,
                f"downloaded bytes hash to {actual}, manifest says {digest}; the partial copy was removed",
            )
        if superseded is not None:
            os.replace(final, superseded)  # set aside, not deleted; only now that the new copy is verified
        try:
            os.link(partial, final)  # fails if anything is at the final name: never overwrites
        except FileExistsError:
            return _result(model_id, path, "conflict", size, f"{final} appeared during the copy; left untouched")
        partial.unlink()
        _fsync_dir(final.parent)
        if superseded is not None:
            return _result(
                model_id,
                path,
                "replaced",
                size,
                f"the content that was there is kept at {superseded.name}; remove it when not needed",
            )
        return _result(model_id, path, "copied", size)

    @staticmethod
    def _digest(partial: Path, digest: str) -> str:
        """The digest of ``partial``, flushed to disk first, in the algorithm of ``digest``."""
        with open(partial, "rb") as handle:
            os.fsync(handle.fileno())
        return file_digest(partial, algorithm_of(digest))

    def _download(self, model_id: str, path: str, partial: Path, offset: int) -> None:
        started, sent = time.monotonic(), 0
        with self.server.model_file(model_id, path, offset) as response:
            mode = "ab" if response.status_code == 206 else "wb"
            if mode == "wb" and offset:
                self.on_bytes(-offset, True)  # the server sent the whole file: count from zero again
            with open(partial, mode) as out:
                for chunk in response.iter_bytes(CHUNK_BYTES):
                    out.write(chunk)
                    out.flush()
                    self.on_bytes(len(chunk), False)
                    sent += len(chunk)
                    if self.max_bytes_per_s:
                        ahead_s = sent / self.max_bytes_per_s - (time.monotonic() - started)
                        if ahead_s > 0:
                            time.sleep(ahead_s)
                os.fsync(out.fileno())


def sync(sync_id: str) -> None:
    """Run one sync: claim it, copy every file of its models, re-verify, report."""
    rt = runtime.current()
    settings = rt.settings
    try:
        grant = rt.server.sync_claim(sync_id)
    except HomefleetError as refusal:
        log.warning("sync %s refused at claim (%s: %s); nothing copied", sync_id, refusal.reason, refusal.message)
        return
    manifests = grant.models
    entries = [(model_id, entry) for model_id, manifest in manifests.items() for entry in manifest.files]
    log.info("sync %s: %d files of %s", sync_id, len(entries), ", ".join(manifests) or "no models")

    state: dict[str, Any] = {"bytes": 0, "kept": 0, "files": 0, "file": ""}

    def report() -> None:
        rt.server.sync_progress(
            sync_id, int(state["files"]), int(state["bytes"]), str(state["file"]), int(state["kept"])
        )

    def on_bytes(count: int, kept: bool) -> None:
        state["bytes"] += count
        if kept:
            state["kept"] += count
        renewal.check()  # the reservation was lost: stop copying

    copier = Copier(rt.server, settings.models_dir, on_bytes, settings.sync_max_bytes_per_s)
    results: list[SyncFileResult] = []
    error: str = ""
    with Renewal(report) as renewal:  # R6: renewed while files are hashed, copied and re-verified
        try:
            for model_id, entry in entries:
                state["file"] = f"{model_id}/{entry.path}"
                report()
                results.append(copier.copy(model_id, entry))
                renewal.check()
                state["files"] += 1
            report()
        except Exception as failure:  # reported to the server with the files done so far; nothing is lost
            error = f"{type(failure).__name__}: {failure}"
            log.exception("sync %s stopped", sync_id)
        answer = rt.server.manifests()
        verified = advertise(rt.redis, rt.keys, settings.machine, settings.models_dir, answer.models, answer.families)
    bad = [r for r in results if r.status not in SYNC_FILE_DONE]
    missing = sorted(m for m in manifests if m not in verified)
    succeeded = not error and not bad and not missing
    message = error or "; ".join(f"{r.model_id}/{r.path}: {r.status} ({r.message})" for r in bad[:10])
    if not message and missing:
        message = f"not verified after the copy: {', '.join(missing)}"
    rt.server.sync_finish(sync_id, succeeded, message, results, sorted(verified))
    log.info("sync %s %s: %s", sync_id, "succeeded" if succeeded else "failed", message or "all files verified")


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
