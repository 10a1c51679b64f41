"""One-way sync (R6): the server asks a worker to pull model files from the server.

How the server asks: ``homefleet sync MACHINE [MODEL…]`` (or ``POST /v1/machines/{name}/sync``)
takes the fleet lock, refuses with 409 while the machine has a job queued or running,
sets a *sync reservation* on the machine (a Redis key with a TTL; placement skips a machine
holding one, reason ``machine_syncing``), records the sync in Redis, and publishes the Celery
task ``homefleet.sync`` to the machine's own queue ``machine.<name>``. That queue is the
only line the worker reads and it is FIFO, so a sync can never overtake a job, and a job
can never be placed behind a running copy (the reservation refuses it first). Using the
queue keeps R3: the server needs no worker address, the worker only connects out.

How the worker copies (``tasks/sync.py``): it *claims* the sync here first (at most once,
like a job's claim, R19), gets the server's current manifests, downloads each missing file
from the authenticated internal file endpoint (HTTP Range resumes a partial copy) into a
temporary name in the same folder, fsyncs, verifies the full-content digest, sets aside a
file of other content at the final name (renamed ``.<name>.<digest[:16]>.superseded``: never
deleted), and links the new copy to its final name only if nothing is there.
Its progress reports renew the reservation; ``finish`` releases it. A worker killed
mid-copy stops renewing, so the reservation expires after ``sync_reservation_ttl_s``
and the sync reads as ``interrupted``; nothing sits at a final name but verified bytes.
Before its claim, a published sync's reservation lasts ``sync_claim_wait_s``: a worker
still starting is not a worker gone.
After copying, the worker re-verifies its whole model folder and replaces its advertised
set (R4).
"""

from __future__ import annotations

import json
import time
import uuid
from enum import StrEnum
from typing import Any, cast

import redis
from celery import Celery

from app.core import keys
from app.core.celery_app import SYNC_TASK
from app.core.config import Settings
from app.core.errors import Conflict, Forbidden, MachineUnavailable, NotFound, PlacementLost, Rejected
from app.core.keys import Keys
from app.core.protocol import SyncFinish, SyncGrant
from app.fleet.config import Fleet
from app.fleet.lock import FleetLock
from app.fleet.machines import MachineStates
from app.journal.jobs import Journal
from app.store.registry import Registry

RECORD_TTL_S = 24 * 3600

# KEYS[1] reservation, ARGV[1] sync id, ARGV[2] ttl ms: renew only our own reservation.
_RENEW = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end return 0"
# KEYS[1] reservation, ARGV[1] sync id: release only our own reservation.
_RELEASE = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0"


class SyncState(StrEnum):
    queued = "queued"  # reserved and published to machine.<name>; not yet claimed by its worker
    running = "running"  # claimed by the worker; copying
    succeeded = "succeeded"  # every file is present and verified on the worker
    failed = "failed"  # ended with files not copied (conflict, digest mismatch, error); see results
    interrupted = "interrupted"  # its reservation expired (worker killed or gone); nothing unverified was kept


SYNC_ENDED = frozenset({SyncState.succeeded, SyncState.failed, SyncState.interrupted})


class Syncs:
    """Start, claim, follow and finish syncs. State lives in Redis (``Keys.sync``)."""

    def __init__(
        self,
        settings: Settings,
        client: redis.Redis,
        celery: Celery,
        fleet: Fleet,
        journal: Journal,
        registry: Registry,
        machines: MachineStates,
        lock: FleetLock,
    ) -> None:
        self.settings = settings
        self.redis = client
        self.celery = celery
        self.fleet = fleet
        self.journal = journal
        self.registry = registry
        self.machines = machines
        self.keys = Keys(settings.key_prefix, settings.broker_key_prefix)
        self.lock = lock
        self.ttl_ms = int(settings.sync_reservation_ttl_s * 1000)  # renewed by claim and progress
        self.claim_wait_ms = int(max(settings.sync_claim_wait_s, settings.sync_reservation_ttl_s) * 1000)

    def start(self, machine: str, model_ids: list[str]) -> dict[str, Any]:
        """Reserve ``machine`` and publish its sync of ``model_ids`` (default: every registered
        model of a family it supports). Returns the sync record (state ``queued``).

        Raises:
            Rejected: unknown machine (``unknown_machine``) or a model of a family the
                machine does not support (``family_not_supported``).
            NotFound: an unknown model, or a retired one (``model_retired``: its workers withdrew it).
            MachineUnavailable: the machine is offline (its worker would not copy anything).
            Conflict: the machine has work queued or running (``machine_busy``) or is already
                syncing (``machine_syncing``): 409, nothing reserved or published.
            PlacementLost: the fleet lock was not free or expired; nothing was published.
        """
        config = self.fleet.machines.get(machine)
        if config is None:
            known = ", ".join(sorted(self.fleet.machines))
            raise Rejected(f"machine {machine!r} is not in this fleet; machines: {known}", reason="unknown_machine")
        if model_ids:
            for model_id in model_ids:
                model = self.registry.get(model_id)
                self.registry.check_in_service(model_id)
                if model.family not in config.families:
                    raise Rejected(
                        f"machine {machine!r} does not support family {model.family!r} of model "
                        f"{model_id!r}; it supports: {', '.join(sorted(config.families))}",
                        reason="family_not_supported",
                    )
        else:
            model_ids = [m.id for m in self.registry.list() if m.family in config.families]
        manifests = [self.registry.manifest(model_id) for model_id in dict.fromkeys(model_ids)]

        # Under the lock (R14, R6): the checks that the machine is online and idle, the record,
        # and the message, so that no job is placed there between the idle check and the
        # publication (the manifests were read above, outside).
        with self.lock.held("sync again") as fence:
            view = self.machines.view(machine)
            if not view.online:
                raise MachineUnavailable(
                    f"machine {machine!r} is offline (no live heartbeat); start its worker, then sync again"
                )
            holder = cast("str | None", self.redis.get(self.keys.syncing(machine)))  # decoded (create_redis)
            if holder:
                raise Conflict(f"machine {machine!r} is already syncing (sync {holder})", reason="machine_syncing")
            active, waiting = self.journal.count_active(machine), self.machines.queued_in_redis(machine)
            if active or waiting:
                raise Conflict(
                    f"machine {machine!r} has work: {active} job(s) queued or running, {waiting} message(s) in "
                    f"{self.keys.queue_list(machine)}; sync refuses to run while a machine has work (R6) - wait "
                    f"until it is idle or cancel its queued jobs",
                    reason="machine_busy",
                )
            sync_id = uuid.uuid4().hex
            files = [f for m in manifests for f in m.files]
            record: dict[str, str | int | float] = {
                "id": sync_id,
                "machine": machine,
                "models": json.dumps([m.model_id for m in manifests]),
                "state": SyncState.queued,
                "created_at": time.time(),
                "files_total": len(files),
                "bytes_total": sum(f.size for f in files),
                "files_done": 0,
                "bytes_done": 0,
                "bytes_kept": 0,
                "file": "",
                "message": "",
                "results": "[]",
                "verified": "[]",
            }
            with self.redis.pipeline() as pipe:
                pipe.hset(self.keys.sync(sync_id), mapping=record)  # type: ignore[arg-type]  # redis-py: Mapping keys
                pipe.expire(self.keys.sync(sync_id), RECORD_TTL_S)
                pipe.set(self.keys.syncing(machine), sync_id, px=self.claim_wait_ms)  # the claim renews it to ttl_ms
                pipe.execute()
            if not fence.holds():  # C04: a placer that lost the lock commits nothing
                self.redis.delete(self.keys.syncing(machine), self.keys.sync(sync_id))
                raise PlacementLost("the fleet lock expired before the sync was published; nothing was published")
            self.celery.send_task(SYNC_TASK, args=[sync_id], task_id=sync_id, queue=keys.queue(machine))
        return self.get(sync_id)

    def get(self, sync_id: str) -> dict[str, Any]:
        """The sync's record (``state``, ``bytes_done``/``bytes_total``, ``bytes_kept`` of
        ``bytes_done`` already in place rather than downloaded, ``file``, ``results``…).
        A queued or running sync whose reservation is gone reads as ``interrupted``. Raises NotFound."""
        raw = cast("dict[str, str]", self.redis.hgetall(self.keys.sync(sync_id)))  # decoded (create_redis)
        if not raw:
            raise NotFound(f"no sync with id {sync_id!r} (records are kept {RECORD_TTL_S} s)", reason="sync_not_found")
        expired = raw["state"] not in SYNC_ENDED and self.redis.get(self.keys.syncing(raw["machine"])) != sync_id
        if expired:
            # finish() writes the end state, then releases the reservation: a record read just
            # before a finish and the reservation just after it would read as interrupted. Read
            # the record again; an end state there is the truth (seen in a suite run on one core:
            # `homefleet sync` printed interrupted for a sync its worker finished in 0.6 s).
            raw = cast("dict[str, str]", self.redis.hgetall(self.keys.sync(sync_id))) or raw
            expired = raw["state"] not in SYNC_ENDED
        record: dict[str, Any] = dict(raw)
        for field in ("files_total", "bytes_total", "files_done", "bytes_done", "bytes_kept"):
            record[field] = int(record.get(field, 0))  # bytes_kept: absent in a record an older server wrote
        for field in ("models", "results", "verified"):
            record[field] = json.loads(record[field])
        for field in ("created_at", "claimed_at", "finished_at"):  # Unix seconds, as numbers
            if record.get(field) is not None:
                record[field] = float(record[field])
        if expired:
            record["state"] = SyncState.interrupted
            record["message"] = record["message"] or (
                "the sync's reservation expired: its worker stopped reporting (killed or offline); "
                "no unverified bytes were put at a final name; sync again to resume"
            )
        return record

    def claim(self, sync_id: str, machine: str) -> SyncGrant:
        """The worker takes the sync (``queued -> running``), once; returns the current manifests
        ``{"sync_id", "models": {model_id: manifest}}``.

        Raises:
            NotFound: no such sync. Forbidden: another machine's sync.
            Conflict: a second delivery (``sync_claimed``) or a reservation that expired
                (``sync_not_reserved``); nothing is copied.
        """
        record = self._own(sync_id, machine)
        if not self.redis.hsetnx(self.keys.sync(sync_id), "claimed_at", time.time()):
            raise Conflict(
                f"sync {sync_id} was already claimed; a second delivery copies nothing", reason="sync_claimed"
            )
        if not self.redis.eval(_RENEW, 1, self.keys.syncing(machine), sync_id, self.ttl_ms):
            self.redis.hset(self.keys.sync(sync_id), "state", SyncState.interrupted)
            raise Conflict(
                f"sync {sync_id} no longer holds machine {machine!r} (its reservation expired)",
                reason="sync_not_reserved",
            )
        self.redis.hset(self.keys.sync(sync_id), "state", SyncState.running)
        manifests = {m: self.registry.manifest(m) for m in record["models"]}
        return SyncGrant(sync_id=sync_id, models=manifests)

    def progress(
        self, sync_id: str, machine: str, files_done: int, bytes_done: int, file: str, bytes_kept: int = 0
    ) -> None:
        """Record progress (``bytes_kept``: of ``bytes_done``, those already in place, not
        downloaded) and renew the reservation. Raises Conflict (``sync_not_reserved``) when the
        reservation expired meanwhile: the worker then stops copying."""
        self._own(sync_id, machine)
        if not self.redis.eval(_RENEW, 1, self.keys.syncing(machine), sync_id, self.ttl_ms):
            raise Conflict(
                f"sync {sync_id} no longer holds machine {machine!r} (its reservation expired)",
                reason="sync_not_reserved",
            )
        self.redis.hset(
            self.keys.sync(sync_id),
            mapping={"files_done": files_done, "bytes_done": bytes_done, "bytes_kept": bytes_kept, "file": file},
        )

    def finish(self, sync_id: str, machine: str, report: SyncFinish) -> dict[str, Any]:
        """End the sync with the worker's per-file results and its re-verified model set;
        release the reservation. Returns the record."""
        self._own(sync_id, machine)
        state = SyncState.succeeded if report.succeeded else SyncState.failed
        self.redis.hset(
            self.keys.sync(sync_id),
            mapping={
                "state": state,
                "message": report.message,
                "verified": json.dumps(report.verified),
                "results": json.dumps([result.model_dump() for result in report.results]),
                "finished_at": time.time(),
                "file": "",
            },
        )
        self.redis.eval(_RELEASE, 1, self.keys.syncing(machine), sync_id)
        return self.get(sync_id)

    def _own(self, sync_id: str, machine: str) -> dict[str, Any]:
        record = self.get(sync_id)
        if record["machine"] != machine:
            raise Forbidden(f"sync {sync_id} copies to {record['machine']!r}, not to {machine!r}")
        return record
