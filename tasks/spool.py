"""A worker's result spool (R2, R19): a result the server could not store (its
disk full: 507 ``storage_full``, or another 5xx) is kept on the worker's disk, the upload is
retried with backoff, and if the server still cannot take it the job ends ``failed`` with
reason ``result_not_stored``; the spooled file stays, and ``homefleet results recover`` brings
it in later (the job then becomes ``succeeded``: it ran once, its result was kept).
When the spool cannot keep it either (the worker's disk full too), the bytes stay in the task's
memory for the same bounded retries, then the job fails ``result_not_stored`` naming both
refusals, with nothing left to recover (``tasks/run_job.py``: ``upload_result``).

The spool is ``WorkerSettings.spool_dir`` (default: beside the models folder, ``spool/``):
per job ``<job_id>.result`` (the bytes), ``<job_id>.result.<i>`` (image i of a job with n > 1
images) and ``<job_id>.json`` (digest, media type, timings, provenance), each written to a temporary name and renamed.
Uploads are idempotent by digest:
the server answers a repeated upload of a result it stored with the job as it is.

A running worker brings its spool in by itself (:class:`SpoolRecovery`, a heartbeat duty every
``result_recover_interval_s``): a result the server could not be reached to take (its job still
``running`` in the journal) or could not store (``result_not_stored``) reaches the server, and
its job ``succeeded``, within that interval of the server answering again, without anyone
running ``homefleet results recover``.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import redis

from app.core.config import WorkerSettings
from app.core.errors import HomefleetError, StorageFull

if TYPE_CHECKING:
    from tasks.server_client import ServerClient

log = logging.getLogger("homefleet.worker")

RETRIED_STATUS = (StorageFull.status_code, 429, 500, 502, 503, 504)
"""Answers after which the server may take the same upload later: a full disk, too many uploads
at once (``uploads_busy``), a server error."""


@dataclass(frozen=True)
class Spooled:
    """What the spool keeps of one result besides its bytes."""

    job_id: str
    digest: str
    media_type: str
    load_s: float
    run_s: float
    cold_load: bool
    provenance: dict[str, Any]
    spooled_at: float
    more_digests: list[str] = field(default_factory=list)  # images 2..n, in order


class ResultSpool:
    """The spool folder of one worker."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def data_path(self, job_id: str) -> Path:
        return self.root / f"{job_id}.result"

    def more_path(self, job_id: str, index: int) -> Path:
        return self.root / f"{job_id}.result.{index}"

    def more(self, record: Spooled) -> list[bytes]:
        """The bytes of images 2..n of ``record``'s job, in order."""
        return [self.more_path(record.job_id, i).read_bytes() for i in range(1, len(record.more_digests) + 1)]

    def keep(self, record: Spooled, data: bytes, more: tuple[bytes, ...] = ()) -> Path:
        """Write the result (and images 2..n, ``more``) and its record (atomically, data first);
        return the data's path."""
        self.root.mkdir(parents=True, exist_ok=True)
        path = self.data_path(record.job_id)
        for index, extra in enumerate(more, start=1):
            _write_atomic(self.more_path(record.job_id, index), extra)
        _write_atomic(path, data)
        _write_atomic(self.root / f"{record.job_id}.json", json.dumps(asdict(record), sort_keys=True).encode())
        return path

    def entries(self) -> list[tuple[Spooled, Path]]:
        """Every complete entry (record and data), oldest first."""
        found = []
        for meta in sorted(self.root.glob("*.json")) if self.root.is_dir() else []:
            try:
                record = Spooled(**json.loads(meta.read_text()))
            except (ValueError, TypeError) as error:
                log.error("result spool: %s is not a spool record (%s); left as it is", meta, error)
                continue
            more = (self.more_path(record.job_id, i).is_file() for i in range(1, len(record.more_digests) + 1))
            if self.data_path(record.job_id).is_file() and all(more):
                found.append((record, self.data_path(record.job_id)))
        return sorted(found, key=lambda entry: entry[0].spooled_at)

    def remove(self, job_id: str) -> None:
        for extra in self.root.glob(f"{job_id}.result.*"):
            extra.unlink(missing_ok=True)
        self.data_path(job_id).unlink(missing_ok=True)
        (self.root / f"{job_id}.json").unlink(missing_ok=True)


def _write_atomic(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(prefix=".incoming.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def retriable(error: BaseException) -> bool:
    """Whether the server may take the same upload later: a full disk (507), too many uploads
    (429) or a server error (5xx), not a refusal of the bytes (422) or a job that has ended (409)."""
    return isinstance(error, HomefleetError) and error.status_code in RETRIED_STATUS


def upload_with_retries(upload: Callable[[], Any], attempts: int, first_pause_s: float, job_id: str) -> Any:
    """Call ``upload`` up to ``attempts`` times, pausing ``first_pause_s`` then twice as long each
    time, while it fails :func:`retriable`; the last error is raised."""
    pause_s = first_pause_s
    for attempt in range(1, attempts + 1):
        try:
            return upload()
        except HomefleetError as error:
            if not retriable(error) or attempt == attempts:
                raise
            log.warning(
                "job %s: the server could not store the result (attempt %d of %d: %s); retrying in %.1f s",
                job_id,
                attempt,
                attempts,
                error.message,
                pause_s,
            )
            time.sleep(pause_s)
            pause_s *= 2
    raise AssertionError("unreachable")


def recover(
    spool: ResultSpool, upload: Callable[[Spooled, bytes], Any], skip: Callable[[str], bool] = lambda _: False
) -> list[tuple[str, str]]:
    """Upload every spooled result again (``homefleet results recover``, :class:`SpoolRecovery`)
    but those whose job id ``skip`` names; an entry the server took, or will never take (its job
    ended otherwise, the bytes refused), leaves the spool. An entry removed meanwhile (another
    recovery took it) is passed over. Returns (job id, outcome) per entry tried: ``recovered``,
    ``refused: …`` or ``kept: …``."""
    outcomes = []
    for record, path in spool.entries():
        if skip(record.job_id):
            continue
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            continue
        try:
            upload(record, data)
        except (HomefleetError, httpx.HTTPError) as error:
            message = getattr(error, "message", str(error))
            if isinstance(error, HomefleetError) and not retriable(error):
                spool.remove(record.job_id)
                outcomes.append((record.job_id, f"refused: {message}"))
            else:
                outcomes.append((record.job_id, f"kept: {message}"))
            continue
        spool.remove(record.job_id)
        outcomes.append((record.job_id, "recovered"))
    return outcomes


def spool_uploader(client: ServerClient, spool: ResultSpool) -> Callable[[Spooled, bytes], Any]:
    """The upload :func:`recover` calls: the spooled result and its images 2..n, through the
    internal API (``client``, with the machine's token)."""

    def upload(record: Spooled, data: bytes) -> Any:
        return client.upload(
            record.job_id,
            data,
            record.media_type,
            record.digest,
            load_s=record.load_s,
            run_s=record.run_s,
            cold_load=record.cold_load,
            provenance=record.provenance,
            more=list(zip(spool.more(record), record.more_digests, strict=True)),
        )

    return upload


def recover_spool(settings: WorkerSettings) -> list[tuple[str, str]]:
    """``homefleet results recover``: :func:`recover` over this worker's spool, uploading through
    the internal API with the machine's token."""
    from tasks.server_client import ServerClient

    client = ServerClient.for_worker(settings)
    spool = ResultSpool(settings.result_spool)
    try:
        return recover(spool, spool_uploader(client, spool))
    finally:
        client.close()


class SpoolRecovery:
    """A heartbeat duty of the worker's parent process (R2, R19): every
    ``settings.result_recover_interval_s`` seconds, while the spool holds an entry, a round of
    :func:`recover` over it in a thread of its own (an upload of a large result takes longer
    than the heartbeat's TTL: the heartbeat's thread never waits for it; one round at a time),
    through ``client`` (the parent's reporter: no waiting out an unreachable server, the next
    round tries again). The job the pool process runs now (``running_job()``, from its running
    record) is left alone: its own upload may still be retrying that entry; when its running
    record cannot be read (Redis down) nothing is tried that round. Each outcome is logged; a
    result still kept is logged once, not every round."""

    def __init__(self, settings: WorkerSettings, client: ServerClient, running_job: Callable[[], str | None]) -> None:
        self.settings = settings
        self.spool = ResultSpool(settings.result_spool)
        self.client = client
        self.running_job = running_job
        self._next_at = 0.0  # time.monotonic() of the next round
        self._told_kept: set[str] = set()
        self._round: threading.Thread | None = None

    def __call__(self) -> None:
        now = time.monotonic()
        if now < self._next_at or (self._round is not None and self._round.is_alive()):
            return
        self._next_at = now + self.settings.result_recover_interval_s
        if not self.spool.root.is_dir() or not any(self.spool.root.glob("*.json")):
            return
        self._round = threading.Thread(target=self.run_round, name="homefleet-spool-recovery", daemon=True)
        self._round.start()

    def join(self, timeout_s: float | None = None) -> None:
        """Wait for the round in progress, if any (seconds; None: as long as it takes)."""
        if self._round is not None:
            self._round.join(timeout_s)

    def run_round(self) -> None:
        """One round: :func:`recover` over every entry but the running job's; errors are logged."""
        try:
            running = self.running_job()
        except redis.RedisError as error:
            log.warning("%s: spooled results not tried this round (%s)", self.settings.machine, error)
            return
        try:
            outcomes = recover(self.spool, spool_uploader(self.client, self.spool), lambda job_id: job_id == running)
        except (OSError, ValueError) as error:  # the spool unreadable, a record's images gone: next round
            log.warning("%s: spooled results not brought in this round (%s)", self.settings.machine, error)
            return
        for job_id, outcome in outcomes:
            if not outcome.startswith("kept"):
                self._told_kept.discard(job_id)
                log.info("job %s: spooled result %s", job_id, outcome)
            elif job_id not in self._told_kept:
                self._told_kept.add(job_id)
                log.warning(
                    "job %s: spooled result %s; tried again every %.0f s",
                    job_id,
                    outcome,
                    self.settings.result_recover_interval_s,
                )
