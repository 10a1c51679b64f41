"""Reconciliation (R19): find jobs whose way was cut and say so in the journal. Nothing that
may have started is ever re-run automatically; nothing vanishes silently.

One pass, under the fleet lock (so no submission sits between "journaled" and "published"):

- Redis lost its data (restarted without persistence, flushed: the marker ``Keys.redis_seen``
  is gone) -> every ``queued`` job whose message is gone is published again: its machine's
  queued backlog is put back in journal order in one atomic step, ahead of the jobs published
  since, so that an idle worker too takes the oldest first (R8; none of them had started: a
  claim is atomic and refuses a second delivery, so none runs twice); every queued or running job's reservation
  is written again, in journal order (R14); and no worker is judged ``worker_lost`` until it
  had ``heartbeat_ttl_s`` to write its heartbeat again (its lease and heartbeat were lost
  with the data, tasks/lease.py);
- the Redis master is another one than at the last pass (``Keys.redis_replid``: a Sentinel
  failover promoted a replica, which may lack the last writes the old master acknowledged,
  replication being asynchronous; or a restart) -> the same publishing again of every ``queued``
  job whose message is gone, in journal order, before such a job could be judged ``purged``
  (docs/operations.md, "Redis Sentinel"); a purge in the same moments is undone by it;
- Redis was out of reach while it kept its data (a pass of this reconciler failed on it, its
  master changed, or every heartbeat the last pass found live lapsed at once: a restart, a
  pause, the host asleep) -> the marker's time moves to now, so that no worker is judged
  ``worker_lost`` until ``heartbeat_ttl_s`` after Redis answered again: the heartbeat keys
  expired meanwhile, and live workers beat again within a few heartbeat intervals
  (:meth:`Reconciler._beating_since`, the grace's one home);
- a ``running`` job whose machine has no live heartbeat (and no progress report within
  ``heartbeat_ttl_s``) -> ``interrupted`` (``worker_lost``; ``token_refused`` when that worker
  stopped because the server refused its token mid-run, ``Keys.token_refused``, in its words);
- a ``running`` job whose machine's worker has another boot id than the one that claimed
  it, in a heartbeat written after the claim -> ``interrupted`` (``worker_restarted``);
- a ``running`` job without progress for ``hung_after_s`` -> ``interrupted`` (``hung``), and
  the machine's worker is asked to restart its pool process (watchdog); a job with no report
  kept at all (Redis lost it) is timed from the first pass that finds it so;
- a ``queued`` job that is neither in its machine's list nor delivered-unacked, for longer
  than ``lost_grace_s``, while Redis kept its data: if the server refused that worker's token
  at its claim (``Keys.token_refused``: a rotated token; the claim changed nothing) -> published
  again in journal order (``requeued``), for the worker started with the new token; if its
  message had reached a worker (``Keys.delivered``) -> ``interrupted`` (``lost``: that worker
  stopped before claiming it);
  else -> ``cancelled`` (``purged``: its message was removed from the queue, e.g. ``celery purge``);
- a ``queued`` job whose machine is no longer in the fleet config -> ``interrupted``
  (``machine_removed``), its message removed;
- reservations of jobs that have ended are released (R14);
- residency commitments (R16) and remembered OOMs (R21) are written back to Redis from the
  journal's database when Redis lost them (``app/fleet/residency_store.py``), and so are the
  drained machines' flags (``app/fleet/drains.py``);
- idempotency keys older than ``idempotency_ttl_s`` are forgotten.

A pass first checks that the Redis runs with this journal (app/fleet/pairing.py): a process that
opened another journal would release every live reservation as "unknown to the journal".
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import cast

import redis

from app.core.config import Settings
from app.core.connections import RedisOutageLog
from app.core.errors import ConfigError, Conflict, HomefleetError
from app.core.keys import Keys, queue
from app.core.kinds import job_request
from app.core.states import ACTIVE, JobState
from app.db.tables import Job, utcnow
from app.fleet.drains import Drains
from app.fleet.lock import Fence, FleetLock
from app.fleet.machines import MachineStates
from app.fleet.pairing import Pairing
from app.fleet.queues import MachineQueues
from app.fleet.residency_store import DurableResidencyFacts
from app.jobs.endings import Endings
from app.jobs.progress import ProgressStore
from app.journal.jobs import Journal

log = logging.getLogger(__name__)


@dataclass
class ReconcileReport:
    interrupted: dict[str, str] = field(default_factory=dict)  # job id -> reason
    cancelled: dict[str, str] = field(default_factory=dict)  # job id -> reason (``purged``, ``cancelled``)
    # published again after Redis lost its data or failed over, in order; or at last (never published)
    requeued: list[str] = field(default_factory=list)
    redis_lost: bool = False  # this pass found Redis without its data (Keys.redis_seen gone)
    master_changed: bool = False  # another Redis master than at the last pass (Keys.redis_replid): a failover
    forgotten_idempotency_keys: int = 0
    released_reservations: int = 0  # reservations of jobs that had ended (R14)
    residency_restored: bool = False  # Redis had lost the residency facts; rewritten from the database
    drains_restored: list[str] = field(default_factory=list)  # drain flags Redis had lost, written again

    def __str__(self) -> str:
        reasons = ", ".join(f"{j[:8]}:{r}" for j, r in self.interrupted.items()) or "nothing"
        lost = (
            f"Redis had lost its data: published {len(self.requeued)} queued jobs again; "
            if self.redis_lost
            else f"Redis failed over: published {len(self.requeued)} queued jobs again; "
            if self.master_changed
            else ""
        )
        cancelled = (
            f"; cancelled {len(self.cancelled)} ({', '.join(sorted(set(self.cancelled.values())))})"
            if self.cancelled
            else ""
        )
        return (
            f"{lost}interrupted {len(self.interrupted)} ({reasons}){cancelled}; released "
            f"{self.released_reservations} reservations; forgot {self.forgotten_idempotency_keys} idempotency keys"
            + ("; residency facts restored from the database" if self.residency_restored else "")
            + (f"; drained again: {', '.join(self.drains_restored)}" if self.drains_restored else "")
        )


@dataclass
class Reconciler:
    """Reconciliation passes. ``server``: this is the server's own loop, which records its
    journal in Redis when none is (app/fleet/pairing.py); a pass from the CLI (``server=False``)
    never records one, and refuses to run while none is recorded. Built by
    ``ServerContext.reconciler``."""

    settings: Settings
    redis: redis.Redis
    keys: Keys
    journal: Journal
    machines: MachineStates
    queues: MachineQueues
    residency: DurableResidencyFacts
    progress: ProgressStore
    lock: FleetLock
    pairing: Pairing
    server: bool = True
    # The pass's ends (app/jobs/endings.py): announced to Flower; their reservations are released
    # by the pass's own Reservations.reconcile, which counts them.
    endings: Endings | None = None
    # The drained machines' durable copy (app/fleet/drains.py), written back to a Redis that lost it.
    drains: Drains | None = None
    # A pass of this reconciler failed on Redis (ConnectionError, TimeoutError) since the last
    # one that reached it (:meth:`_beating_since`).
    _unreachable: bool = field(default=False, init=False)
    # The machines whose heartbeat the last pass found live (:meth:`_beating_since`).
    _live: set[str] = field(default_factory=set, init=False)

    def run_once(self) -> ReconcileReport:
        """One reconciliation pass; see the module docstring.

        Raises:
            ConfigError: the Redis runs with another journal (``journal_mismatch``,
                app/fleet/pairing.py), or (from the CLI) with none yet (``journal_unpaired``);
                nothing was changed.
            PlacementLost: the fleet lock cannot be had within ``fleet_lock_wait_s``.
        """
        try:
            return self._pass()
        except (redis.ConnectionError, redis.TimeoutError):
            self._unreachable = True  # the next pass that reaches Redis gives the workers time to beat
            raise

    def _pass(self) -> ReconcileReport:
        self.pairing.check(record=self.server, require=not self.server)  # before trusting this journal
        report = ReconcileReport()
        with self.lock.held("reconciliation tries again at its next pass") as fence:
            seen = cast("str | None", self.redis.get(self.keys.redis_seen()))  # decoded (create_redis)
            report.redis_lost = seen is None
            report.residency_restored = self.residency.restore().source == "database"
            report.drains_restored = self.drains.restore() if self.drains is not None else []
            replid, recorded = self._replication_ids()
            report.master_changed = recorded is not None and replid != recorded
            since = self._beating_since(seen, report.master_changed)
            self._running(report, judge_liveness=time.time() - since >= self.settings.heartbeat_ttl_s)
            if report.redis_lost or report.master_changed:
                self._requeue(report, fence)
            self._queued(report, fence)
            if report.redis_lost:  # last: a pass cut short finds the loss again
                self.redis.set(self.keys.redis_seen(), repr(since), nx=True)
            if replid is not None and replid != recorded:  # last, likewise
                self.redis.set(self.keys.redis_replid(), replid)
            # Also the machines no longer in the fleet config that still hold reservations.
            machines = set(self.machines.fleet.machines) | self.machines.reservations.machines_holding()
            report.released_reservations = len(self.machines.reservations.reconcile(sorted(machines), self.journal))
        cutoff = utcnow() - timedelta(seconds=self.settings.idempotency_ttl_s)
        report.forgotten_idempotency_keys = self.journal.forget_idempotency_keys(cutoff)
        if (
            report.interrupted
            or report.cancelled
            or report.released_reservations
            or report.requeued
            or report.drains_restored
        ):
            log.warning("reconciliation: %s", report)
        return report

    def _beating_since(self, seen: str | None, master_changed: bool) -> float:
        """Unix seconds since which every worker has been able to write its heartbeat to this
        Redis: no worker is judged ``worker_lost`` before ``heartbeat_ttl_s`` after it (R19).
        ``seen``: the marker ``Keys.redis_seen`` as this pass read it (None: Redis lost its data).

        Workers write their lease, then their heartbeat, again within a few heartbeat intervals
        of a Redis that answers again; meanwhile their heartbeat keys expire (a Redis stopped and
        started with its data keeps none whose TTL ran out, a paused one expires them on waking).
        So the marker's time moves to now when this pass finds that Redis was out of reach: an
        earlier pass of this reconciler failed on it (:attr:`_unreachable`), its master is
        another one (``master_changed``: a restart or a failover), or the heartbeats of two or
        more machines that the last pass found live have all lapsed at once (one machine's
        lapse is its worker's death, judged without this delay). Kept in Redis, the grace holds for any
        reconciler's pass (a standby server's, ``homefleet reconcile``); a Redis that lost its
        data gets the marker written at the end of the pass, with this pass's time.

        Raises:
            redis.ConnectionError, redis.TimeoutError: Redis does not answer.
        """
        now = time.time()
        live = {name for name in self.machines.fleet.machines if self.machines.heartbeat(name) is not None}
        lapsed = len(self._live) >= 2 and not (live & self._live)  # one machine's lapse: its worker died
        self._live = live
        if seen is None:  # Redis lost its data: the marker, written at the end of the pass, says now
            self._unreachable = False
            return now
        if self._unreachable or master_changed or lapsed:
            self.redis.set(self.keys.redis_seen(), repr(now), xx=True)
            if not self._unreachable:  # (the loop says an outage its passes met, ReconcileLoop)
                log.info(
                    "reconciliation: Redis was out of reach (%s): no worker is judged lost for heartbeat_ttl_s=%g s",
                    "its master changed" if master_changed else "every live heartbeat lapsed at once",
                    self.settings.heartbeat_ttl_s,
                )
            self._unreachable = False
            return now
        return float(seen)

    def _replication_ids(self) -> tuple[str | None, str | None]:
        """``(the master's replication id now, the one the last pass recorded)``; the first is
        None where ``INFO`` is refused (an ACL without it: no failover is then detected)."""
        try:
            info = cast("dict[str, object]", self.redis.info("replication"))
        except redis.ResponseError:
            return None, None
        replid = str(info.get("master_replid") or "") or None
        return replid, cast("str | None", self.redis.get(self.keys.redis_replid()))  # decoded (create_redis)

    def _interrupt(self, report: ReconcileReport, job_id: str, state: JobState, reason: str, message: str) -> None:
        assert self.endings is not None, "a reconciliation pass ends jobs through app/jobs/endings.py"
        try:
            self.endings.interrupt(job_id, [state], reason, message, announce=True, release=False)
        except Conflict:
            return  # it moved on meanwhile (e.g. finished): nothing to repair
        report.interrupted[job_id] = reason

    def _running(self, report: ReconcileReport, judge_liveness: bool = True) -> None:
        now = time.time()
        for job in self.journal.list([JobState.running]):
            machine = job.machine or ""
            heartbeat = self.machines.heartbeat(machine)
            last_progress = self.progress.last_at(job.id)
            if heartbeat is None and not judge_liveness:
                continue  # Redis just lost its data: the worker has not had time to beat again
            if heartbeat is None and not self.redis.exists(self.keys.redis_seen()):
                continue  # Redis lost its data during this pass (after it read the marker): as above
            if heartbeat is None and now - last_progress > self.settings.heartbeat_ttl_s:
                # (a starved heartbeat thread while steps still report is not a lost worker)
                refused = cast("str | None", self.redis.get(self.keys.token_refused(job.id)))
                self._interrupt(
                    report,
                    job.id,
                    JobState.running,
                    "worker_lost" if refused is None else "token_refused",
                    (f"the worker of {machine} has no live heartbeat" if refused is None else f"{refused}, and stopped")
                    + "; the job had started there and is not run again by itself (R19): requeue it if you want "
                    + f"it (`homefleet jobs requeue {job.id}`, POST /v1/jobs/{job.id}/requeue, or the page's Requeue)",
                )
            elif heartbeat is None:
                continue
            elif (
                job.worker_boot_id
                and heartbeat.get("boot_id") != job.worker_boot_id
                and float(heartbeat.get("at", now)) >= _unix_s(job.started_at)
            ):
                # (a heartbeat written before the claim may still be the previous boot's: a worker
                # that just restarted can claim a job before its first heartbeat replaces it)
                self._interrupt(
                    report,
                    job.id,
                    JobState.running,
                    "worker_restarted",
                    f"the worker of {machine} restarted (boot {heartbeat.get('boot_id')}, "
                    f"claimed by boot {job.worker_boot_id})",
                )
            elif self._cancel_overdue(report, job, now):
                continue
            else:
                # No report kept (Redis lost it after the claim): the hung bound counts from the
                # first pass that found none, never from the job's start (a long job's next step
                # may be seconds away).
                last = last_progress or self.progress.watched_since(job.id, now)
                if now - last > self.settings.hung_after_s:
                    self._interrupt(
                        report,
                        job.id,
                        JobState.running,
                        "hung",
                        f"no progress for {now - last:.0f} s (bound hung_after_s={self.settings.hung_after_s})",
                    )
                    self.redis.set(self.keys.restart(machine), job.id, ex=60)

    def _cancel_overdue(self, report: ReconcileReport, job: Job, now: float) -> bool:
        """A running job whose cancel was asked ``cancel_grace_s`` ago and that has not stopped
        between steps (a long native step): end it ``cancelled`` and have its worker kill its
        pool process (the watchdog's restart request). True when it was ended here."""
        requested = self.redis.get(self.keys.cancel(job.id))
        if requested is None or now - float(requested) < self.settings.cancel_grace_s:
            return False
        seen = self.progress.read(job.id)
        steps = f"{seen.step} of {seen.total}" if seen is not None and seen.step is not None else "0"
        if self._pool_runs(job):
            what = (
                f"it did not stop between steps within cancel_grace_s={self.settings.cancel_grace_s:g} s, "
                "so its pool process was killed"
            )
        else:  # its run ended and its result waits in the worker's spool (a failed upload): nothing runs it
            what = (
                f"no pool process of {job.machine} runs it (its run had ended; a result its worker keeps "
                "to upload is dropped when it is brought in)"
            )
        message = f"cancelled by request while running, after {steps} steps; {what}"
        try:
            assert self.endings is not None, "a reconciliation pass ends jobs through app/jobs/endings.py"
            self.endings.cancel_running(job.id, job.machine or "", message, release=False)  # the pass releases
        except Conflict:
            return True  # it moved on meanwhile
        self.redis.set(self.keys.restart(job.machine or ""), job.id, ex=60)
        report.cancelled[job.id] = "cancelled"
        return True

    def _pool_runs(self, job: Job) -> bool:
        """Whether the machine's pool process says it runs ``job``: its running record
        (``Keys.running``, written before the job's claim and removed when its task ends) names
        it, or cannot be read. False when there is none or it names another job: the job's run
        ended without its result stored, which its worker keeps in its spool to upload later."""
        raw = self.redis.get(self.keys.running(job.machine or ""))
        if raw is None:
            return False
        try:
            return bool(json.loads(raw).get("job_id") == job.id)
        except (ValueError, AttributeError):
            return True

    def _queued(self, report: ReconcileReport, fence: Fence) -> None:
        now = time.time()
        fleet = self.machines.fleet
        waiting = {name: set(self.queues.queued_ids(name)) for name in fleet.machines}
        delivered = self.queues.unacked_ids()
        missing_key = self.keys.missing()
        marked = set(self.redis.hkeys(missing_key))  # jobs seen missing at an earlier pass (few)
        found_again: list[str] = []  # marked ones whose message is back: unmarked in one HDEL
        for job_id, machine in self.journal.placements([JobState.queued]):
            if machine is not None and machine not in fleet.machines:
                # No worker will take it: its machine left the fleet config. Its message is taken
                # out of that machine's list, so a worker started under the old name later
                # cannot run it either.
                self._interrupt(
                    report,
                    job_id,
                    JobState.queued,
                    "machine_removed",
                    f"machine {machine!r} is no longer in the fleet config; the job was not run",
                )
                self.queues.remove(machine, job_id)
                continue
            if job_id in waiting.get(machine or "", set()) or job_id in delivered:
                if job_id in marked:  # one round trip per pass, not one per queued job
                    found_again.append(job_id)
                continue
            first_missing = float(self.redis.hget(missing_key, job_id) or now)
            self.redis.hset(missing_key, job_id, first_missing)
            if now - first_missing >= self.settings.lost_grace_s:
                self._gone(report, job_id, machine, fence)
                self.redis.hdel(missing_key, job_id)
        if found_again:
            self.redis.hdel(missing_key, *found_again)

    def _gone(self, report: ReconcileReport, job_id: str, machine: str | None, fence: Fence) -> None:
        """A queued job's message is gone while Redis kept its data: a worker took it and stopped
        before claiming it (``lost``), it was never published (no reservation either: its server
        stopped between journaling and reserving it; published now, :meth:`_publish_unpublished`),
        or it was removed from its queue (``purged``). (A server killed between reserving and
        publishing, two Redis calls apart, leaves the same trace as a purge, and so does a worker
        suspended with its ``BRPOP`` in flight: Redis hands it the message, which then sits in that
        process's socket, in no list and not yet acked; the message says so.)"""
        refused = cast("str | None", self.redis.get(self.keys.token_refused(job_id)))  # decoded (create_redis)
        if refused is not None and machine is not None:
            self._give_back(report, job_id, machine, refused)
            return
        taker = cast("str | None", self.redis.get(self.keys.delivered(job_id)))  # decoded (create_redis)
        if taker is not None:
            self._interrupt(
                report,
                job_id,
                JobState.queued,
                "lost",
                f"its message was delivered to {taker}'s worker, which stopped before claiming it; the job was not "
                f"run: requeue it if you want it (`homefleet jobs requeue {job_id}`, POST /v1/jobs/{job_id}/requeue, "
                "or the page's Requeue)",
            )
            return
        if machine is not None and not self.redis.hexists(self.keys.reservations(machine), job_id):
            self._publish_unpublished(report, job_id, machine, fence)
            return
        assert self.endings is not None, "a reconciliation pass ends jobs through app/jobs/endings.py"
        try:  # announced: Flower shows it REVOKED, not PENDING forever
            self.endings.cancel(
                job_id,
                "purged",
                f"its message was removed from the queue {queue(machine or '')} before any worker "
                "took it (a purge, e.g. `celery purge`; or it was never published: the server stopped while "
                "submitting it; or it was handed to a worker suspended, e.g. asleep, with its "
                "BRPOP in flight: if that worker wakes, its claim is refused); the job was not run",
                announce=True,
                release=False,
                event_detail="purged",
            )
        except Conflict:
            return  # it was claimed or cancelled meanwhile
        report.cancelled[job_id] = "purged"

    def _give_back(self, report: ReconcileReport, job_id: str, machine: str, refused: str) -> None:
        """A queued job whose claim the server refused because the claiming worker's token was
        refused (401: its machine's token was rotated or removed; that worker stops, exit 78): the
        refused claim changed nothing and the job never ran, so its message is published again
        to its machine's queue, its queued backlog put in journal order (R8), for the machine's
        next worker, started with the new token. It runs at most once: the claim that runs it is
        journaled and refuses any other delivery (R19). ``refused``: the worker's own words."""
        job = self.journal.get(job_id)
        self._publish_in_order(job, machine)
        self.redis.delete(self.keys.token_refused(job_id), self.keys.delivered(job_id))
        self.journal.log(
            job.id,
            "requeued",
            f"{refused}; the job was not run: published again to {queue(machine)} by reconciliation, "
            "for the machine's worker started with its current token",
        )
        report.requeued.append(job.id)
        log.warning("job %s: its claim was refused for %s's worker's token; published again", job.id, machine)

    def _publish_in_order(self, job: Job, machine: str) -> None:
        """Publish ``job``'s message to ``machine``'s queue with the machine's queued backlog (its
        ``queued`` jobs not delivered to a worker) put in journal order around it (R8)."""
        delivered = self.queues.unacked_ids()
        backlog = [
            queued.id
            for queued in self.journal.list([JobState.queued])
            if queued.machine == machine and queued.id not in delivered
        ]
        messages = self.queues.messages(machine, [(job.id, job.model_id, job.kind)])
        self.queues.put_in_order(machine, backlog, messages)

    def _publish_unpublished(self, report: ReconcileReport, job_id: str, machine: str, fence: Fence) -> None:
        """Reserve and publish a ``queued`` job its server journaled but never reserved nor
        published (it was killed in between, R19: journal first). Its client may hold a 202 for
        it: with standby servers, a retry with the same Idempotency-Key on the other server is
        answered with this job (R20). Its machine's queued backlog is put in journal order (R8),
        as after a Redis loss; it runs once (its claim is journaled)."""
        job = self.journal.get(job_id)
        request = job_request(job.model_id, "", job.kind, job.target, job.params)
        if not self.machines.reservations.add(
            machine, job.id, job.model_id, job.kind, request.steps, request.size, fence, batch=request.batch
        ):
            return  # the lock expired under this pass: the next pass finds it again
        self._publish_in_order(job, machine)
        self.journal.log(
            job.id,
            "requeued",
            f"its server stopped before publishing it; published to {queue(machine)} by reconciliation",
        )
        report.requeued.append(job.id)
        log.warning("job %s was journaled but never published (its server stopped): published now", job.id)

    def _requeue(self, report: ReconcileReport, fence: Fence) -> None:
        """Redis lost its data: write every live job's reservation again, in journal order (R14),
        and publish again every queued job whose message is gone, so that each machine's worker
        takes its queued jobs in journal order (R8), the republished ones ahead of the jobs
        published since the loss, whatever the worker does meanwhile.

        A machine with a message gone has its whole queued backlog put in journal order in one
        atomic step (``MachineQueues.put_in_order``): a worker blocked in BRPOP takes the oldest
        first, never the first message published (publishing one at a time, newest first, let an
        idle worker take the newest first); a lost message older than one Redis kept goes ahead of
        it. Nothing runs twice: a claim is journaled and refuses a second delivery (R19); a
        delivered-unacked job is left where it is (its worker holds it)."""
        machines = self.machines.fleet.machines
        active = [job for job in self.journal.list(ACTIVE) if job.machine in machines]
        waiting = {name: set(self.queues.queued_ids(name)) for name in machines}
        delivered = self.queues.unacked_ids()
        reservations = self.machines.reservations
        for job in active:  # journal order: their seq numbers follow it again
            machine = job.machine or ""
            request = job_request(job.model_id, "", job.kind, job.target, job.params)
            reservations.add(
                machine, job.id, job.model_id, job.kind, request.steps, request.size, fence, batch=request.batch
            )
            if job.state == JobState.running:
                reservations.start(machine, job.id, _unix_s(job.started_at))
        backlogs: dict[str, list[Job]] = {}
        for job in active:
            if job.state == JobState.queued and job.id not in delivered:
                backlogs.setdefault(job.machine or "", []).append(job)
        gone: list[Job] = []
        for machine, backlog in backlogs.items():
            lost = [job for job in backlog if job.id not in waiting[machine]]
            if not lost:
                continue  # its list holds every one: already in the order they were published
            messages = self.queues.messages(machine, [(job.id, job.model_id, job.kind) for job in lost])
            self.queues.put_in_order(machine, [job.id for job in backlog], messages)
            for job in lost:
                self.redis.hdel(self.keys.missing(), job.id)
                why = "Redis lost its data" if report.redis_lost else "Redis failed over to a replica without it"
                self.journal.log(job.id, "requeued", f"{why}; published again to {queue(machine)}")
            gone.extend(lost)
        created = {job.id: index for index, job in enumerate(active)}
        report.requeued = sorted((job.id for job in gone), key=created.__getitem__)
        if gone:
            log.warning(
                "%s: published %d queued jobs again, in journal order",
                "Redis lost its data" if report.redis_lost else "Redis failed over",
                len(gone),
            )


class ReconcileLoop:
    """Runs :meth:`Reconciler.run_once` at start and every ``reconcile_interval_s`` seconds
    in a daemon thread, until :meth:`stop`. A pass that Redis does not answer (ConnectionError,
    TimeoutError) is said once per outage, with one line when Redis answers again
    (:class:`RedisOutageLog`), not with a traceback at every pass. ``on_refusal`` is told after each pass: the
    configuration error that refused it (the Redis runs with another journal), or None. A pass
    runs only while ``leads()`` (one leader among servers sharing the journal, app/db/leadership.py)."""

    def __init__(
        self,
        reconciler: Reconciler,
        interval_s: float,
        on_refusal: Callable[[HomefleetError | None], None] = lambda _error: None,
        leads: Callable[[], bool] = lambda: True,
    ) -> None:
        self.reconciler = reconciler
        self.outage = RedisOutageLog(
            log, "reconciliation", reconciler.settings.redis_url, "passes are skipped and nothing is judged"
        )
        self.leads = leads
        self.interval_s = interval_s
        self.on_refusal = on_refusal
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="homefleet-reconcile", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self.leads():
                self._stop.wait(self.interval_s)
                continue
            try:
                self.reconciler.run_once()
                self.outage.answered(
                    f"; no worker is judged lost for heartbeat_ttl_s={self.reconciler.settings.heartbeat_ttl_s:g} s"
                )
                self.on_refusal(None)
            except (redis.ConnectionError, redis.TimeoutError) as error:  # an outage: said once, not each pass
                self.outage.failed(error)
            except ConfigError as error:  # a configuration to fix, not a crash: one line, no traceback
                log.error("reconciliation refused (%s): %s", error.reason, error.message)
                self.on_refusal(error)  # the Redis runs with another journal: no placing either
            except Exception:  # logged with its traceback; the next pass tries again
                log.exception("reconciliation pass failed")
            self._stop.wait(self.interval_s)


def _unix_s(moment: datetime | None) -> float:
    """Unix seconds of a journal time (stored naive in UTC by SQLite, aware by PostgreSQL); 0 when unset."""
    if moment is None:
        return 0.0
    return (moment if moment.tzinfo else moment.replace(tzinfo=UTC)).timestamp()
