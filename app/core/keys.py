"""Every Redis key Homefleet uses, built in one place so that a prefix changes once.

Queue names are Celery's: with kombu's Redis transport the list key of a queue is the
queue's name (priority 0; Homefleet never sets priorities, shared/notes/celery-redis.md).
"""

from __future__ import annotations

QUEUE_PREFIX = "machine."


def queue(machine: str) -> str:
    """Celery queue (and Redis list key) of one machine: ``machine.<name>`` (R8)."""
    return f"{QUEUE_PREFIX}{machine}"


class Keys:
    """Homefleet's own keys under one prefix (``hf`` by default)."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix

    def heartbeat(self, machine: str) -> str:
        """JSON liveness record of a machine's worker, expiring after ``heartbeat_ttl_s``."""
        return f"{self.prefix}:machine:{machine}:heartbeat"

    def verified(self, machine: str) -> str:
        """Set of model ids whose files that machine has verified against the manifest (R4)."""
        return f"{self.prefix}:machine:{machine}:verified"

    def journal(self) -> str:
        """The identity of the journal this Redis runs with (app/fleet/pairing.py)."""
        return f"{self.prefix}:journal"

    def fleet_lock(self) -> str:
        """The one placement lock of the fleet (R14)."""
        return f"{self.prefix}:lock:fleet"

    def syncing(self, machine: str) -> str:
        """The sync reservation of a machine (R6): the id of the sync copying to it, with a TTL
        (``sync_reservation_ttl_s``) renewed by its progress reports. Placement skips a machine
        holding one."""
        return f"{self.prefix}:machine:{machine}:syncing"

    def sync(self, sync_id: str) -> str:
        """Hash of one sync's state and progress (bytes done/total, current file), kept a day."""
        return f"{self.prefix}:sync:{sync_id}"

    def warm(self, machine: str) -> str:
        """JSON list of the models resident in that machine's worker, for its heartbeat."""
        return f"{self.prefix}:machine:{machine}:warm"

    def residency(self, machine: str) -> str:
        """Set of model ids the machine is committed to keep resident (its protected set, R16)."""
        return f"{self.prefix}:machine:{machine}:residency"

    def oom(self, machine: str) -> str:
        """Hash ``<model>\t<kind>`` -> smallest job size (pixels x frames x batch) that ran out of
        memory on that machine (R21), with the failing job as JSON ``{size, job_id, at}``."""
        return f"{self.prefix}:machine:{machine}:oom"

    def progress(self, job_id: str) -> str:
        """Hash ``{step, total, at}`` of a running job's per-step progress (``at``: unix seconds)."""
        return f"{self.prefix}:job:{job_id}:progress"

    def restart(self, machine: str) -> str:
        """Watchdog request: the machine's worker restarts its pool process (value: hung job id)."""
        return f"{self.prefix}:machine:{machine}:restart"

    def running(self, machine: str) -> str:
        """JSON ``{job_id, pid}``: the job a machine's pool process runs now, written by that
        process when the job starts and removed when it ends. The watchdog kills a pool process
        only when this names the job of the restart request and a live pool process (R19)."""
        return f"{self.prefix}:machine:{machine}:running"

    def worker_lease(self, machine: str) -> str:
        """The boot id of the one worker of the machine, with a TTL its holder renews
        (``tasks.worker.WorkerLease``): one worker per machine, from its start."""
        return f"{self.prefix}:machine:{machine}:worker"

    def draining(self, machine: str) -> str:
        """Set while an operator drains the machine: placement puts nothing new there."""
        return f"{self.prefix}:machine:{machine}:draining"

    def missing(self) -> str:
        """Hash job id -> unix seconds since when a queued job's message was not found (reconciliation)."""
        return f"{self.prefix}:reconcile:missing"

    def reservations(self, machine: str) -> str:
        """Hash job id -> JSON reservation of every job queued or running on that machine (R14)."""
        return f"{self.prefix}:machine:{machine}:reservations"

    def reservation_seq(self) -> str:
        """Counter giving reservations their FIFO order across the fleet."""
        return f"{self.prefix}:reservations:seq"

    def demand(self) -> str:
        """Hash demand class -> JSON decayed submissions (routing.demand), for Auto's scarcity charge."""
        return f"{self.prefix}:demand"

    def registry_changed(self) -> str:
        """Random token replaced after every committed change of the model registry, so a
        process can tell that its cached model profiles are stale (app/fleet/costs.py, ChangeMark)."""
        return f"{self.prefix}:registry:changed"

    def timings_changed(self) -> str:
        """Random token replaced after every committed write of the learned timings (R13), so a
        process can tell that its cached timings are stale (app/fleet/costs.py, ChangeMark)."""
        return f"{self.prefix}:timings:changed"

    def residency_durable(self) -> str:
        """Marker set when the residency facts (``residency``, ``oom``) were restored from the
        journal's database; its absence means Redis lost them (app/fleet/residency_store.py)."""
        return f"{self.prefix}:residency:durable"

    def dead_letters(self) -> str:
        """List of JSON ``{queue, raw, error, at}``: messages a worker's queue held that could not
        be decoded, moved aside so the worker goes on consuming (app/core/dead_letters.py)."""
        return f"{self.prefix}:deadletters"
