"""Every Redis key Homefleet uses, built in one place so that a prefix changes once.

Two prefixes: ``key_prefix`` (``hf``) before Homefleet's own keys, and ``broker_key_prefix``
(kombu's ``global_keyprefix``, "" by default) before the keys of the broker's structures,
which kombu writes and Homefleet only reads or edits (cancel, reconciliation, status):

- a queue is named ``machine.<name>`` (:func:`queue`, what Celery and ``celery -Q`` see); its
  Redis list is ``<broker_key_prefix>machine.<name>`` (:meth:`Keys.queue_list`): kombu
  publishes with LPUSH and consumes with BRPOP (index -1 runs next); priority 0 only
  (Homefleet never sets priorities, so no ``\x06\x16N`` lists exist);
- delivered-but-unacked messages: the hash ``<broker_key_prefix>unacked`` (:meth:`Keys.unacked`),
  indexed by delivery time in the sorted set ``<broker_key_prefix>unacked_index``; kombu restores
  them after the visibility timeout with RPUSH, to the end consumers read from.
"""

from __future__ import annotations

QUEUE_PREFIX = "machine."


def queue(machine: str) -> str:
    """Celery queue (and Redis list key) of one machine: ``machine.<name>`` (R8)."""
    return f"{QUEUE_PREFIX}{machine}"


UNACKED = "unacked"  # kombu's default ``unacked_key`` (kombu/transport/redis.py)
UNACKED_INDEX = "unacked_index"  # kombu's default ``unacked_index_key``


class Keys:
    """Homefleet's own keys under ``prefix`` (``hf`` by default), and the broker's under
    ``broker_prefix`` (kombu's ``global_keyprefix``; settings ``key_prefix`` and ``broker_key_prefix``)."""

    def __init__(self, prefix: str, broker_prefix: str = "") -> None:
        self.prefix = prefix
        self.broker_prefix = broker_prefix

    # -- the broker's structures (kombu writes them) -----------------------------------------
    def queue_list(self, machine: str) -> str:
        """The Redis list holding ``machine``'s queue :func:`queue` (what LLEN counts, R8)."""
        return f"{self.broker_prefix}{queue(machine)}"

    def unacked(self) -> str:
        """kombu's hash delivery tag -> JSON ``[message, exchange, routing key]`` of messages
        delivered to a consumer and not yet acked (one per Redis database)."""
        return f"{self.broker_prefix}{UNACKED}"

    def unacked_index(self) -> str:
        """kombu's sorted set delivery tag -> delivery time (unix seconds) of the :meth:`unacked` messages."""
        return f"{self.broker_prefix}{UNACKED_INDEX}"

    # -- Homefleet's own keys -----------------------------------------------------------------

    def heartbeat(self, machine: str) -> str:
        """JSON liveness record of a machine's worker, expiring after ``heartbeat_ttl_s``."""
        return f"{self.prefix}:machine:{machine}:heartbeat"

    def verified(self, machine: str) -> str:
        """Set of model ids whose files that machine has verified against the manifest (R4)."""
        return f"{self.prefix}:machine:{machine}:verified"

    def verified_kept(self, machine: str) -> str:
        """That machine's worker's marker (its boot id, no TTL), written with each heartbeat: its
        absence under a running worker means Redis lost its data (flushed, or restarted without
        persistence), and the worker writes its advertised set back (tasks/heartbeat.py)."""
        return f"{self.prefix}:machine:{machine}:verified_kept"

    def journal(self) -> str:
        """The identity of the journal this Redis runs with (app/fleet/pairing.py)."""
        return f"{self.prefix}:journal"

    def journal_where(self) -> str:
        """Where that journal and its data folder are (``journal <url>, data folder <path>``),
        written with :meth:`journal`: what a refused command names (app/fleet/pairing.py)."""
        return f"{self.prefix}:journal:where"

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

    def job_changes(self) -> str:
        """Pub/sub channel of every job's change, as JSON ``{"job": id, "state": s}`` (a
        journal transition, app/jobs/endings.py) or ``{"job": id, "progress": true}`` (a progress
        report): what app/jobs/waiting.py's waiters wake on."""
        return f"{self.prefix}:jobs:changed"

    def cancel(self, job_id: str) -> str:
        """Set (value: unix seconds of the request) when a running job's cancel was asked
        (``POST /v1/jobs/{id}/cancel``); its worker reads it at each step and stops between
        steps. Expires after a day."""
        return f"{self.prefix}:job:{job_id}:cancel"

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

    def node(self, machine: str) -> str:
        """The Celery node name (``<machine>@<host>``) of the machine's last started worker, kept
        without a TTL: the server sends the task events of the jobs it ends itself under it, so
        Flower counts them on that worker (app/jobs/task_events.py)."""
        return f"{self.prefix}:machine:{machine}:node"

    def draining(self, machine: str) -> str:
        """Set while an operator drains the machine: placement puts nothing new there."""
        return f"{self.prefix}:machine:{machine}:draining"

    def delivered(self, job_id: str) -> str:
        """Set by a worker when a job's message reaches it, before the message is acked (it expires
        after a day): reconciliation tells a message a worker took and never claimed (``lost``)
        from one removed from its queue (``purged``)."""
        return f"{self.prefix}:job:{job_id}:delivered"

    def token_refused(self, job_id: str) -> str:
        """Set by a worker whose claim of the job the server refused with 401 (its machine token
        was rotated or removed: the claim changed nothing, the job never ran; it expires after a
        day): reconciliation publishes that job again, in journal order, instead of ending it
        ``lost`` (app/jobs/reconcile.py)."""
        return f"{self.prefix}:job:{job_id}:token_refused"

    def redis_seen(self) -> str:
        """Unix seconds since when reconciliation has known this Redis's data. Written at the end of
        the first pass that finds it missing: its absence means Redis lost its data (restarted
        without persistence, flushed) or is new (app/jobs/reconcile.py)."""
        return f"{self.prefix}:reconcile:redis_seen"

    def redis_replid(self) -> str:
        """The replication id (``INFO replication`` ``master_replid``) of the Redis master the last
        reconciliation pass ran against: another one means a failover (a promoted replica, which
        may lack the master's last writes) or a restart (app/jobs/reconcile.py)."""
        return f"{self.prefix}:reconcile:replid"

    def missing(self) -> str:
        """Hash job id -> unix seconds since when a queued job's message was not found (reconciliation)."""
        return f"{self.prefix}:reconcile:missing"

    def reservations(self, machine: str) -> str:
        """Hash job id -> JSON reservation of every job queued or running on that machine (R14)."""
        return f"{self.prefix}:machine:{machine}:reservations"

    def reservations_version(self, machine: str) -> str:
        """A token replaced at every change of :meth:`reservations` (app/fleet/reservations.py),
        so that placement re-reads only a machine whose backlog changed. Its name is the hash's
        plus ``:version``, as app/fleet/multiread.py's ``HGETALL_SINCE`` derives it."""
        return f"{self.reservations(machine)}:version"

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

    def call(self, fingerprint: str) -> str:
        """JSON ``{jobs, complete}`` of one call of an image route, kept ``sdk_retry_window_s``,
        so that a client's automatic retry gets that call's jobs (app/jobs/calls.py, C10)."""
        return f"{self.prefix}:call:{fingerprint}"

    def residency_durable(self) -> str:
        """Marker set when the residency facts (``residency``, ``oom``) were restored from the
        journal's database; its absence means Redis lost them (app/fleet/residency_store.py)."""
        return f"{self.prefix}:residency:durable"

    def dead_letters(self) -> str:
        """List of JSON ``{queue, raw, error, at}``: messages a worker's queue held that could not
        be decoded, moved aside so the worker goes on consuming (app/core/dead_letters.py)."""
        return f"{self.prefix}:deadletters"

    def join_token(self, digest: str) -> str:
        """Hash ``{machine, expires_at, spent}`` of one join token, keyed by the token's SHA-256
        (hex; the token itself is never stored), expiring after its lifetime plus an hour so a
        reused token is told apart from an unknown one (app/fleet/live.py ``JoinTokens``)."""
        return f"{self.prefix}:join:{digest}"

    def fleet_loaded(self) -> str:
        """JSON ``{digest, state, reason, at, pid}``: what the running server last did with the fleet
        file (``state`` ``loaded`` or ``refused``; ``digest``: SHA-256 of the file's text), read by
        ``homefleet machines`` to know the server took a change (app/api/fleet_reload.py)."""
        return f"{self.prefix}:fleet:loaded"
