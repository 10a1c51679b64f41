"""Reservations (R14): every job queued or running on a machine holds one, written under the
fleet lock in the same step as its publish, and released when the job ends in any state.

A reservation is a field of the Redis hash ``<prefix>:machine:<name>:reservations``: job id ->
JSON ``{seq, model_id, kind, steps, size, started_at}`` (``started_at``: Unix seconds, None
while queued). ``seq`` (a fleet-wide counter) keeps FIFO order. Placement reads the backlog
from here, so two Auto jobs submitted at the same instant see each other (R14).
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from operator import attrgetter
from typing import NamedTuple, cast

import redis

from app.core.keys import Keys
from app.core.states import ENDED
from app.fleet.lock import Fence
from app.journal.jobs import Journal
from routing.finish import StepReport, WorkItem

# Every change of a reservations hash replaces its version token (Keys.reservations_version)
# in the same atomic step, with a fresh random token (never a counter: after Redis lost its
# data a counter would start again and repeat an old version), so that a snapshot re-reads a
# machine's hash only when it changed (app/fleet/multiread.py, HGETALL_SINCE).

# KEYS[1]: the fleet lock, KEYS[2]: the fleet-wide sequence counter, KEYS[3]: the machine's
# reservations hash, KEYS[4]: its version, KEYS[5..]: more hashes to write. ARGV[1]: the lock's
# token, ARGV[2]: the lock's TTL (ms), ARGV[3]: job id, ARGV[4]: the record's JSON without
# ``seq``, ARGV[5]: the new version token, then (field, value) for each of KEYS[5..]. One round
# trip and one atomic step: the fence (the lock still holds our token, and its TTL is renewed,
# as redis-py's Lock.reacquire does), the next sequence number into the record, the record, its
# version, the other fields. Nil: the lock was lost.
_ADD = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return false end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
local record = cjson.decode(ARGV[4])
record['seq'] = redis.call('INCR', KEYS[2])
redis.call('HSET', KEYS[3], ARGV[3], cjson.encode(record))
redis.call('SET', KEYS[4], ARGV[5])
for i = 5, #KEYS do
  redis.call('HSET', KEYS[i], ARGV[2 * i - 4], ARGV[2 * i - 3])
end
return record['seq']
"""


# KEYS[1]: the machine's reservations hash, KEYS[2]: its version. ARGV[1]: job id, ARGV[2]:
# started_at (Unix seconds), ARGV[3]: the new version token. Sets the record's started_at only
# if the job still holds a reservation; 1 if so.
_START = """
local raw = redis.call('HGET', KEYS[1], ARGV[1])
if not raw then return 0 end
local record = cjson.decode(raw)
record['started_at'] = tonumber(ARGV[2])
redis.call('HSET', KEYS[1], ARGV[1], cjson.encode(record))
redis.call('SET', KEYS[2], ARGV[3])
return 1
"""

# KEYS[1]: the machine's reservations hash, KEYS[2]: its version. ARGV[1]: job id, ARGV[2]: the
# new version token. 1 if the job held a reservation (then the version changes).
_RELEASE = """
if redis.call('HDEL', KEYS[1], ARGV[1]) == 0 then return 0 end
redis.call('SET', KEYS[2], ARGV[2])
return 1
"""


def _version() -> str:
    return secrets.token_hex(8)


class HashField(NamedTuple):
    """One field of a Redis hash to write: ``HSET key field value``."""

    key: str
    field: str
    value: str


@dataclass(frozen=True)
class _Parsed:
    """One reservation record as placement needs it: FIFO position and work item (queued)."""

    order: tuple[bool, int]  # (queued, seq): running ones first, then by seq
    item: WorkItem  # elapsed_s None
    started_at: float | None  # Unix seconds
    job_id: str  # its reservation's field: the key its step reports are read by


@dataclass(frozen=True)
class _Read:
    """A machine's reservations hash as last read, parsed (see :meth:`Reservations.items_from`)."""

    raw: dict[str, str]  # job id -> record JSON
    parsed: dict[str, _Parsed]  # job id -> parsed record
    fifo: tuple[_Parsed, ...]  # running first, then by seq
    queued_only: tuple[WorkItem, ...] | None  # the items, when none is running (nothing to compute)


def _parse(raw: str, job_id: str) -> _Parsed:
    record = json.loads(raw)
    started_at = None if record["started_at"] is None else float(record["started_at"])
    item = WorkItem(
        record["model_id"], record["kind"], int(record["steps"]), int(record["size"]), batch=int(record.get("batch", 1))
    )  # a record written before batches were kept: one image
    return _Parsed((started_at is None, int(record["seq"])), item, started_at, job_id)


class Reservations:
    def __init__(self, client: redis.Redis, keyspace: Keys) -> None:
        self.redis = client
        self.keys = keyspace
        self._add = client.register_script(_ADD)
        self._start = client.register_script(_START)
        self._release = client.register_script(_RELEASE)
        self._reads: dict[str, _Read] = {}  # machine -> its last read by items_from
        self._seen: dict[str, tuple[str, dict[str, str]]] = {}  # machine -> (version, hash) of its last snapshot read

    def add(
        self,
        machine: str,
        job_id: str,
        model_id: str,
        kind: str,
        steps: int,
        size: int,
        fence: Fence,
        also: Sequence[HashField] = (),
        batch: int = 1,
    ) -> bool:
        """Reserve ``machine`` for a job under the fleet lock, before publishing it, and write
        ``also`` in the same atomic step, only if the lock still holds ``fence.token`` (its TTL
        is then renewed to ``fence.ttl_ms``; C04).

        Returns:
            True when written; False when the fence failed (the lock expired, or another placer
            holds it): nothing was written.
        """
        record = {"model_id": model_id, "kind": kind, "steps": steps, "size": size, "batch": batch, "started_at": None}
        keys = [
            fence.key,
            self.keys.reservation_seq(),
            self.keys.reservations(machine),
            self.keys.reservations_version(machine),
        ]
        args: list[str | int] = [fence.token, fence.ttl_ms, job_id, json.dumps(record), _version()]
        for write in also:
            keys.append(write.key)
            args += [write.field, write.value]
        return self._add(keys=keys, args=args) is not None

    def start(self, machine: str, job_id: str, at_s: float | None = None) -> bool:
        """Mark a reserved job as running since ``at_s`` (Unix seconds; now by default), in one
        atomic step: a reservation released meanwhile (its job ended or was cancelled) is not
        brought back. True if the job held a reservation."""
        started = time.time() if at_s is None else at_s
        keys = [self.keys.reservations(machine), self.keys.reservations_version(machine)]
        return bool(self._start(keys=keys, args=[job_id, repr(float(started)), _version()]))

    def release(self, machine: str | None, job_id: str) -> bool:
        """Drop a job's reservation (its job ended in any state); True if it held one."""
        if machine is None:
            return False
        keys = [self.keys.reservations(machine), self.keys.reservations_version(machine)]
        return bool(self._release(keys=keys, args=[job_id, _version()]))

    def count(self, machine: str) -> int:
        return int(self.redis.hlen(self.keys.reservations(machine)))

    def records(self, machine: str) -> list[tuple[str, dict]]:
        """(job id, record) in FIFO order: running ones first, then by ``seq``."""
        return self._ordered(cast("dict[str, str]", self.redis.hgetall(self.keys.reservations(machine))))

    @staticmethod
    def _ordered(raw: dict[str, str]) -> list[tuple[str, dict]]:
        rows = [(job_id, json.loads(value)) for job_id, value in raw.items()]
        return sorted(rows, key=lambda row: (row[1]["started_at"] is None, row[1]["seq"]))

    def snapshot_read(self, machine: str) -> tuple[tuple[str, str, str, int], tuple[str, dict[str, str]]]:
        """The read of ``machine``'s hash for a snapshot (app/fleet/multiread.py), and the
        (version, hash) it was made against: the records come back only if the hash's version
        or field count differs from that one's. Give both to :meth:`snapshot_hash`."""
        seen = self._seen.get(machine, ("", {}))
        version, raw = seen
        return ("HGETALL_SINCE", self.keys.reservations(machine), version, len(raw) if version else -1), seen

    def snapshot_hash(
        self, machine: str, reply: tuple[str | None, dict[str, str] | None], seen: tuple[str, dict[str, str]]
    ) -> dict[str, str]:
        """``machine``'s reservations hash from the reply to :meth:`snapshot_read`: ``seen``'s
        when unchanged (the same object, so :meth:`items_from` reuses its parse). Each cached
        (version, hash) pair is consistent on its own, so threads that read at once cannot mix
        one read's version with another's records."""
        version, raw = reply
        if raw is None:
            return seen[1]
        if version is None:
            self._seen.pop(machine, None)  # no version (Redis lost it): read in full next time
        else:
            self._seen[machine] = (version, raw)
        return raw

    def items(self, machine: str, now_s: float | None = None) -> tuple[WorkItem, ...]:
        """The machine's reserved jobs as :class:`WorkItem` in FIFO order (running first)."""
        raw = cast("dict[str, str]", self.redis.hgetall(self.keys.reservations(machine)))  # decoded (create_redis)
        return self.items_from(machine, raw, now_s)

    def items_from(
        self,
        machine: str,
        raw: dict[str, str],
        now_s: float | None = None,
        progress: Mapping[str, StepReport | None] | None = None,
    ) -> tuple[WorkItem, ...]:
        """:meth:`items` from ``machine``'s already-read reservations hash (``HGETALL``);
        ``progress``: running job id -> its worker's last step report
        (``app.fleet.running.step_report``), set on its item (``report``).

        Placement reads every machine's whole backlog under the fleet lock at each submission
        (R14), and most of it is as it was at the previous read: a hash equal to the last one
        read gives the same items (only a running job's ``elapsed_s`` and progress are set
        again), and a record's JSON is parsed again only when its text changed (its job started).
        """
        last = self._reads.get(machine)
        if last is None or (last.raw is not raw and last.raw != raw):
            before, before_raw = (last.parsed, last.raw) if last is not None else ({}, {})
            parsed = {
                job_id: before[job_id] if before_raw.get(job_id) == value else _parse(value, job_id)
                for job_id, value in raw.items()
            }
            fifo = tuple(sorted(parsed.values(), key=attrgetter("order")))
            queued_only = None if any(p.started_at is not None for p in fifo) else tuple(p.item for p in fifo)
            last = self._reads[machine] = _Read(raw, parsed, fifo, queued_only)
        if last.queued_only is not None:
            return last.queued_only
        now_s = time.time() if now_s is None else now_s
        progress = progress or {}
        return tuple(
            p.item
            if p.started_at is None
            else replace(p.item, elapsed_s=max(0.0, now_s - p.started_at), report=progress.get(p.job_id))
            for p in last.fifo
        )

    def running(self, machine: str) -> list[str]:
        """The ids of ``machine``'s running jobs as its last :meth:`items_from` read them (the
        jobs whose progress the next snapshot reads)."""
        last = self._reads.get(machine)
        return [] if last is None or last.queued_only is not None else [p.job_id for p in last.fifo if p.started_at]

    def machines_holding(self) -> set[str]:
        """Names of every machine with a reservations hash in Redis (SCAN), fleet config or not."""
        pattern = self.keys.reservations("*")
        prefix, suffix = pattern.split("*")
        return {key[len(prefix) : len(key) - len(suffix)] for key in self.redis.scan_iter(match=pattern, count=1000)}

    def reconcile(self, machines: Iterable[str], journal: Journal) -> list[str]:
        """Release the reservations of jobs that ended (or are unknown to the journal); return
        their ids. Repairs what a crash between a job's end and its release left behind."""
        released = []
        for machine in machines:
            records = self.records(machine)
            states = journal.states_of(job_id for job_id, _ in records)  # one query per batch, not per job
            for job_id, _ in records:
                state = states.get(job_id)
                if state is None or state in ENDED:
                    self.release(machine, job_id)
                    released.append(job_id)
        return released
