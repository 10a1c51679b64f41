"""A result neither the server nor the worker's spool can store (R2, R19): the upload is
retried while the task holds the bytes, then the job is reported ``failed`` ``result_not_stored``
at once, naming both refusals. The real path (a server under ``prlimit --fsize``, a spool on a
full tmpfs, a real worker) is tests/e2e/test_full_disk.py."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from app.core.config import WorkerSettings
from app.core.errors import StorageFull
from app.core.states import RESULT_NOT_STORED
from tasks.run_job import JobNotSucceeded, upload_result


class Server:
    """The server's side of an upload: answers 507 ``full`` times, then stores; records failures."""

    def __init__(self, full: int) -> None:
        self.full, self.uploads, self.failures = full, 0, []

    def upload(self, job_id: str, data: bytes, *args: Any, **kwargs: Any) -> dict[str, str]:
        self.uploads += 1
        if self.uploads <= self.full:
            raise StorageFull("the result (45000 bytes) could not be stored in /srv/results: File too large")
        return {"id": job_id}

    def fail(self, job_id: str, reason: str, message: str, **timings: float | None) -> None:
        self.failures.append((job_id, reason, message))


def worker(tmp_path: Path, spool: Path, server: Server) -> SimpleNamespace:
    models = tmp_path / "models"
    models.mkdir(exist_ok=True)
    settings = WorkerSettings(
        machine="m1",
        models_dir=models,
        worker_token="t" * 16,
        spool_dir=spool,
        result_upload_attempts=3,
        result_retry_s=0.0,
    )
    return SimpleNamespace(settings=settings, server=server)


def unwritable_spool(tmp_path: Path) -> Path:
    blocker = tmp_path / "a-file"
    blocker.write_text("where the spool's folder should be")
    return blocker / "spool"


def test_both_refusals_fail_the_job_at_once_naming_each(tmp_path: Path) -> None:
    server = Server(full=99)
    spool = unwritable_spool(tmp_path)
    with pytest.raises(JobNotSucceeded) as ended:
        upload_result(
            worker(tmp_path, spool, server), "j1", b"png", "image/png", "blake3:" + "0" * 64, 0.1, 0.2, False, {}
        )
    assert server.uploads == 3  # every attempt, the bytes held in memory
    [(job_id, reason, message)] = server.failures
    assert (job_id, reason) == ("j1", RESULT_NOT_STORED) and ended.value.reason == RESULT_NOT_STORED
    assert "after 3 attempts (507 storage_full: the result (45000 bytes)" in message and "File too large" in message
    assert f"could not keep it in its spool {spool} (ENOTDIR: Not a directory)" in message, message
    assert "the result is lost" in message and "results recover" not in message


def test_a_server_that_gets_room_takes_the_result_held_in_memory(tmp_path: Path) -> None:
    server = Server(full=2)
    upload_result(
        worker(tmp_path, unwritable_spool(tmp_path), server),
        "j2",
        b"png",
        "image/png",
        "blake3:" + "0" * 64,
        0.1,
        0.2,
        False,
        {},
        more=[(b"second", "blake3:" + "1" * 64)],
    )
    assert server.uploads == 3 and server.failures == []


def test_a_spool_with_room_still_keeps_the_result_for_recover(tmp_path: Path) -> None:
    server = Server(full=99)
    spool = tmp_path / "spool"
    with pytest.raises(JobNotSucceeded):
        upload_result(
            worker(tmp_path, spool, server), "j3", b"png", "image/png", "blake3:" + "0" * 64, 0.1, 0.2, False, {}
        )
    [(_, reason, message)] = server.failures
    assert reason == RESULT_NOT_STORED and str(spool / "j3.result") in message and "results recover" in message
    assert (spool / "j3.result").read_bytes() == b"png"


class Unreachable(Server):
    """A server that does not answer past its client's own retries (stopped, its port closed)."""

    def upload(self, job_id: str, data: bytes, *args: Any, **kwargs: Any) -> dict[str, str]:
        self.uploads += 1
        raise httpx.ConnectError("[Errno 111] Connection refused")


def test_a_result_the_unreachable_server_did_not_take_is_kept_for_recover(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The server gone past the client's retries (a stop of minutes): the result was logged and
    thrown away; it is kept in the spool, and the log says how to bring it in."""
    from tasks.spool import ResultSpool

    server = Unreachable(full=0)
    spool = tmp_path / "spool"
    with pytest.raises(httpx.ConnectError):
        upload_result(
            worker(tmp_path, spool, server), "j4", b"png", "image/png", "blake3:" + "0" * 64, 0.1, 0.2, False, {}
        )
    assert server.uploads == 1 and server.failures == []  # no report reaches a server that does not answer
    [(record, _)] = ResultSpool(spool).entries()
    assert record.job_id == "j4" and (spool / "j4.result").read_bytes() == b"png"
    assert "this worker uploads it within 30 s of the server answering" in caplog.text
    assert "run `homefleet results recover` on machine m1 once it answers" in caplog.text
