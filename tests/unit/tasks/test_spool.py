"""The worker's result spool and its retries: what is retried, how often, and
what ``recover`` keeps or drops. The real path, with a server under ``prlimit --fsize`` and a
real worker, is tests/e2e/test_full_disk.py."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from app.core.config import WorkerSettings
from app.core.errors import Conflict, HomefleetError, IntegrityFailure, StorageFull
from tasks.spool import ResultSpool, Spooled, SpoolRecovery, recover, retriable, upload_with_retries


def answered(status: int) -> HomefleetError:
    error = HomefleetError(f"server answered {status}: x")
    error.status_code = status
    return error


def record(job_id: str, at: float = 1.0) -> Spooled:
    return Spooled(
        job_id=job_id,
        digest="blake3:" + "0" * 64,
        media_type="image/png",
        load_s=0.1,
        run_s=0.2,
        cold_load=False,
        provenance={"seed": 1},
        spooled_at=at,
    )


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        (StorageFull("full"), True),
        (answered(500), True),
        (answered(503), True),
        (answered(429), True),
        (Conflict("ended"), False),
        (answered(422), False),
        (IntegrityFailure("digest mismatch"), False),
    ],
)
def test_only_a_full_disk_a_busy_or_failing_server_is_retried(error: HomefleetError, expected: bool) -> None:
    assert retriable(error) is expected


def test_uploads_are_retried_with_doubling_pauses_then_the_last_error_is_raised(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pauses: list[float] = []
    monkeypatch.setattr("tasks.spool.time.sleep", pauses.append)
    calls = []

    def full() -> None:
        calls.append(1)
        raise StorageFull("no room")

    with pytest.raises(StorageFull):
        upload_with_retries(full, attempts=4, first_pause_s=0.5, job_id="j")
    assert len(calls) == 4 and pauses == [0.5, 1.0, 2.0]
    outcomes = iter([StorageFull("no room"), "stored"])

    def then_stored() -> object:
        outcome = next(outcomes)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    assert upload_with_retries(then_stored, attempts=3, first_pause_s=0.0, job_id="j") == "stored"
    with pytest.raises(Conflict):  # a job that ended: never retried
        upload_with_retries(lambda: (_ for _ in ()).throw(Conflict("ended")), attempts=3, first_pause_s=0, job_id="j")


def test_recover_drops_what_the_server_took_or_refused_and_keeps_what_it_cannot_take_yet(tmp_path: Path) -> None:
    spool = ResultSpool(tmp_path / "spool")
    for index, job_id in enumerate(("taken", "refused", "still_full")):
        spool.keep(record(job_id, at=float(index)), f"bytes of {job_id}".encode())
    (spool.root / "junk.json").write_text("not a record")
    answers = {"taken": None, "refused": answered(422), "still_full": StorageFull("no room yet")}
    uploaded = []

    def upload(entry: Spooled, data: bytes) -> None:
        uploaded.append((entry.job_id, data))
        if (error := answers[entry.job_id]) is not None:
            raise error

    outcomes = dict(recover(spool, upload))
    assert [job for job, _ in uploaded] == ["taken", "refused", "still_full"]  # oldest first
    assert uploaded[0][1] == b"bytes of taken"
    assert outcomes["taken"] == "recovered" and outcomes["refused"].startswith("refused")
    assert outcomes["still_full"].startswith("kept")
    assert [entry.job_id for entry, _ in spool.entries()] == ["still_full"]


def test_a_job_of_n_images_is_spooled_whole_and_only_a_whole_entry_is_recovered(tmp_path: Path) -> None:
    """Images 2..n are kept beside the first; an entry missing one is not offered to
    ``recover`` (it would upload fewer images than the job asks), and removing it removes all."""
    spool = ResultSpool(tmp_path)
    batch = Spooled(**{**record("batch").__dict__, "more_digests": ["blake3:" + "1" * 64, "blake3:" + "2" * 64]})
    spool.keep(batch, b"first", (b"second", b"third"))
    [(kept, path)] = spool.entries()
    assert kept == batch and path.read_bytes() == b"first" and spool.more(kept) == [b"second", b"third"]
    spool.more_path("batch", 2).unlink()
    assert spool.entries() == []  # incomplete: not uploaded
    spool.keep(batch, b"first", (b"second", b"third"))
    spool.remove("batch")
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def recovery_settings(tmp_path: Path, **fields: object) -> WorkerSettings:
    """Machine m1's worker settings with its spool under ``tmp_path``."""
    models = tmp_path / "models"
    models.mkdir(exist_ok=True)
    return WorkerSettings(
        machine="m1", models_dir=models, worker_token="t" * 16, spool_dir=tmp_path / "spool", **fields
    )  # type: ignore[arg-type]


class Server:
    """The internal API's upload as the worker's reporter client calls it: 507 while ``full``."""

    def __init__(self) -> None:
        self.full, self.uploads = True, []

    def upload(self, job_id: str, data: bytes, *args: object, **kwargs: object) -> dict[str, str]:
        self.uploads.append(job_id)
        if self.full:
            raise StorageFull("the result could not be stored: No space left on device")
        return {"id": job_id}


def test_a_running_worker_brings_its_spool_in_each_interval_leaving_the_running_job_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """R2, R19: results spooled while the server was full or unreachable reach it without
    ``homefleet results recover``; the entry of the job the pool process runs is its upload's own
    (it may still be retrying it), and a result still refused is logged once, not every round."""
    settings = recovery_settings(tmp_path, result_recover_interval_s=30)
    spool = ResultSpool(settings.result_spool)
    spool.keep(record("done", at=1.0), b"png-1")
    spool.keep(record("running-now", at=2.0), b"png-2")
    server = Server()
    clock = [100.0]
    monkeypatch.setattr("tasks.spool.time.monotonic", lambda: clock[0])
    recovery = SpoolRecovery(settings, server, lambda: "running-now")  # type: ignore[arg-type]

    caplog.set_level(logging.INFO, logger="homefleet.worker")

    def beat() -> None:  # the heartbeat's thread calls the duty; the round runs in its own thread
        recovery()
        recovery.join(timeout_s=10)

    beat()
    assert server.uploads == ["done"]  # the running job's entry is not touched
    clock[0] += 10
    beat()
    assert server.uploads == ["done"]  # not before the interval
    clock[0] += 25
    beat()
    assert server.uploads == ["done", "done"]
    assert caplog.text.count("job done: spooled result kept") == 1
    assert "tried again every 30 s" in caplog.text

    server.full = False
    clock[0] += 30
    beat()
    assert server.uploads == ["done", "done", "done"]
    assert [entry.job_id for entry, _ in spool.entries()] == ["running-now"]
    assert "job done: spooled result recovered" in caplog.text


def test_a_spool_recovery_that_cannot_read_the_running_record_tries_nothing(tmp_path: Path) -> None:
    import redis

    settings = recovery_settings(tmp_path)
    ResultSpool(settings.result_spool).keep(record("maybe-running"), b"png")
    server = Server()

    def unreadable() -> str | None:
        raise redis.ConnectionError("Connection refused")

    recovery = SpoolRecovery(settings, server, unreadable)  # type: ignore[arg-type]
    recovery()
    recovery.join(timeout_s=10)
    assert server.uploads == []


def test_a_spool_round_never_holds_up_the_heartbeat(tmp_path: Path) -> None:
    """An upload slower than the heartbeat's TTL (a large video over a slow link) runs in the
    round's own thread: the duty returns at once, and no second round starts while it runs."""
    import threading

    settings = recovery_settings(tmp_path, result_recover_interval_s=0.01)
    ResultSpool(settings.result_spool).keep(record("big"), b"mp4")
    release, started = threading.Event(), threading.Event()

    class Slow(Server):
        def upload(self, job_id: str, data: bytes, *args: object, **kwargs: object) -> dict[str, str]:
            self.uploads.append(job_id)
            started.set()
            release.wait(10)
            return {"id": job_id}

    server = Slow()
    recovery = SpoolRecovery(settings, server, lambda: None)  # type: ignore[arg-type]
    recovery()
    assert started.wait(10)
    for _ in range(3):  # beats while the upload runs
        recovery()
    release.set()
    recovery.join(timeout_s=10)
    assert server.uploads == ["big"] and ResultSpool(settings.result_spool).entries() == []
