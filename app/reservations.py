"""Reservations (R14): every job queued or running on a machine holds one, written under the
fleet lock in the same step as its publish, and released when the job ends in any state.

A reservation is a field of the Redis hash ``<prefix>:machine:<name>:reservations``: job id ->
JSON ``{seq, model_id, kind, steps, size, started_at}`` (``started_at``: Unix seconds, None
while queued). ``seq`` (a fleet-wide counter) keeps FIFO order. Placement reads the backlog
from here, so two Auto jobs submitted at the same instant see each other (R14).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable

import redis

from app.journal import ENDED, Journal
from app.keys import Keys
from routing.finish import WorkItem


# KEYS: the fleet-wide sequence counter, the machine's reservations hash; ARGV: job id, the
# record's JSON without ``seq``. One round trip: the next sequence number goes into the record.
_ADD = """
local record = cjson.decode(ARGV[2])
record['seq'] = redis.call('INCR', KEYS[1])
redis.call('HSET', KEYS[2], ARGV[1], cjson.encode(record))
return record['seq']
"""


class Reservations:
    def __init__(self, client: redis.Redis, keyspace: Keys) -> None:
        self.redis = client
        self.keys = keyspace
        self._add = client.register_script(_ADD)

    def add(self, machine: str, job_id: str, model_id: str, kind: str, steps: int, size: int,
            pipe: redis.client.Pipeline | None = None) -> None:
        """Reserve ``machine`` for a job (call under the fleet lock, before publishing); with
        ``pipe``, queued on that pipeline instead of sent at once."""
        record = {"model_id": model_id, "kind": kind, "steps": steps, "size": size, "started_at": None}
        self._add(keys=[self.keys.reservation_seq(), self.keys.reservations(machine)],
                  args=[job_id, json.dumps(record)], client=pipe or self.redis)

    def start(self, machine: str, job_id: str, at_s: float | None = None) -> None:
        """Mark a reserved job as running since ``at_s`` (Unix seconds; now by default)."""
        key = self.keys.reservations(machine)
        raw = self.redis.hget(key, job_id)
        if raw is None:
            return
        record = json.loads(raw)
        record["started_at"] = time.time() if at_s is None else at_s
        self.redis.hset(key, job_id, json.dumps(record))

    def release(self, machine: str | None, job_id: str) -> bool:
        """Drop a job's reservation (its job ended in any state); True if it held one."""
        if machine is None:
            return False
        return bool(self.redis.hdel(self.keys.reservations(machine), job_id))

    def count(self, machine: str) -> int:
        return int(self.redis.hlen(self.keys.reservations(machine)))

    def records(self, machine: str) -> list[tuple[str, dict]]:
        """(job id, record) in FIFO order: running ones first, then by ``seq``."""
        return self._ordered(self.redis.hgetall(self.keys.reservations(machine)))

    @staticmethod
    def _ordered(raw: dict[str, str]) -> list[tuple[str, dict]]:
        rows = [(job_id, json.loads(value)) for job_id, value in raw.items()]
        return sorted(rows, key=lambda row: (row[1]["started_at"] is None, row[1]["seq"]))

    def items(self, machine: str, now_s: float | None = None) -> tuple[WorkItem, ...]:
        """The machine's reserved jobs as :class:`WorkItem` in FIFO order (running first)."""
        return self.items_from(self.redis.hgetall(self.keys.reservations(machine)), now_s)

    def items_from(self, raw: dict[str, str], now_s: float | None = None) -> tuple[WorkItem, ...]:
        """:meth:`items` from an already-read reservations hash (``HGETALL``)."""
        now_s = time.time() if now_s is None else now_s
        return tuple(
            WorkItem(r["model_id"], r["kind"], int(r["steps"]), int(r["size"]),
                     elapsed_s=None if r["started_at"] is None else max(0.0, now_s - float(r["started_at"])))
            for _, r in self._ordered(raw)
        )

    def reconcile(self, machines: Iterable[str], journal: Journal) -> list[str]:
        """Release the reservations of jobs that ended (or are unknown to the journal); return
        their ids. Repairs what a crash between a job's end and its release left behind."""
        released = []
        for machine in machines:
            for job_id, _ in self.records(machine):
                state = journal.state_of(job_id)
                if state is None or state in ENDED:
                    self.release(machine, job_id)
                    released.append(job_id)
        return released
