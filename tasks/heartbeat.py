"""The worker's heartbeat in Redis (a key with a TTL) and its verified model set (R4).

At start, and after every sync (``tasks/sync.py`` calls :func:`advertise`), the worker hashes
its local model files against the server's manifest and advertises only the models that
match in full; placement reads that set. A job-time mismatch withdraws a model from it
(R5). The heartbeat record (machine, boot id, device, memory, warm models, verified
models) is rebuilt from Redis at every beat, so what the pool child changes (a sync, a
withdrawal, a load) shows in the next beat.

The same thread is the worker's end of the watchdog (R19): it kills the pool process when,
and only when, that process runs the job the server declared hung (:meth:`Heartbeat.obey_restart`,
reading what :func:`mark_running` recorded). A pool process killed under its job is reported
to the server as an OOM by the parent (:meth:`Heartbeat.report_lost`, R21).
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import platform
import signal
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import psutil
import redis

from app.core.config import WorkerSettings
from app.core.errors import HomefleetError, Unauthorized
from app.core.keys import Keys
from tasks.server_client import ServerClient
from tasks.verify import verified_models

log = logging.getLogger("homefleet.worker")


def advertise(client: redis.Redis, keyspace: Keys, machine: str, models_dir: Path,
              manifests: dict[str, dict[str, Any]]) -> set[str]:
    """Hash every local model against ``manifests`` (every byte, R4) and replace the machine's
    advertised set with the models that match in full. Returns that set.

    The start-up check (heartbeat thread, parent process) and a sync's check (pool child)
    may overlap; an exclusive ``flock`` on ``<models_dir>/.homefleet-verify.lock`` runs them one
    after the other, so the later one hashes the files as they are once the earlier has
    written its set (no stale set can overwrite a fresher one). The kernel releases the
    lock when its process dies, so a killed worker never blocks the next one.
    """
    models_dir.mkdir(parents=True, exist_ok=True)
    with open(models_dir / ".homefleet-verify.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        verified = verified_models(models_dir, manifests)
        key = keyspace.verified(machine)
        with client.pipeline() as pipe:
            pipe.delete(key)
            if verified:
                pipe.sadd(key, *sorted(verified))
            pipe.execute()
    log.info("%s verified %d of %d models: %s", machine, len(verified), len(manifests),
             ", ".join(sorted(verified)) or "none")
    return verified


# KEYS: the lease, the heartbeat, the advertised set, the warm record. ARGV: boot id, heartbeat
# record, its TTL (ms), 1 to rewrite the advertised set, a warm record to restore (or ""), then
# the advertised models. Nothing is written unless the lease holds this boot id.
_BEAT = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
if ARGV[4] == '1' then
  redis.call('DEL', KEYS[3])
  for i = 6, #ARGV do redis.call('SADD', KEYS[3], ARGV[i]) end
end
if ARGV[5] ~= '' then redis.call('SET', KEYS[4], ARGV[5], 'NX') end
redis.call('SET', KEYS[2], ARGV[2], 'PX', ARGV[3])
return 1
"""

# KEYS[1] running record, ARGV: this process's records (waiting, working): remove only our own.
_CLEAR_OWN = """
local current = redis.call('GET', KEYS[1])
if current == ARGV[1] or current == ARGV[2] then return redis.call('DEL', KEYS[1]) end
return 0
"""


def _running_record(job_id: str, working: bool = False) -> str:
    record: dict[str, object] = {"job_id": job_id, "pid": os.getpid()}
    if working:
        record["working"] = True
    return json.dumps(record, sort_keys=True)


def mark_working(client: redis.Redis, keyspace: Keys, machine: str, job_id: str) -> None:
    """Record that this pool process's job now holds the model cache (past the start-up
    preload, R16): from here a death of the process is the job's own (R21, :meth:`Heartbeat.report_lost`)."""
    client.set(keyspace.running(machine), _running_record(job_id, working=True))


def mark_running(client: redis.Redis, keyspace: Keys, machine: str, job_id: str) -> None:
    """Record that this pool process (its pid) now runs ``job_id``, for the watchdog (R19).
    Called in the pool process when a job's task starts."""
    client.set(keyspace.running(machine), _running_record(job_id))


def clear_running(client: redis.Redis, keyspace: Keys, machine: str, job_id: str) -> None:
    """Remove this process's record of ``job_id`` when its task ends, however it ends; a record
    written by another process (the pool's next one) is left alone. A process that dies under a
    job leaves its record behind, naming a pid that is no longer a pool process."""
    client.eval(_CLEAR_OWN, 1, keyspace.running(machine), _running_record(job_id), _running_record(job_id, working=True))


class Heartbeat:
    """A daemon thread that verifies the model folder once, then writes the heartbeat every
    ``heartbeat_interval_s`` with a TTL of ``heartbeat_ttl_s``."""

    def __init__(self, settings: WorkerSettings, client: redis.Redis, boot_id: str, device: str) -> None:
        self.settings = settings
        self.redis = client
        self.keys = Keys(settings.key_prefix)
        self.boot_id = boot_id
        self.device = device
        self.verified: set[str] | None = None
        self._redis_run_id: str | None = None
        self._stop = threading.Event()
        self.refused = False  # the server refused the token at start: the worker stops (exit 78)
        self.killed: set[str] = set()  # jobs whose pool process the watchdog killed (not OOMs, R21)
        self.abandoned = False  # another worker of this machine runs it now (abandon)
        self._warm: str | None = None  # the pool process's warm models as last read (JSON), to restore
        self.manifests: dict[str, dict[str, Any]] = {}  # the server's manifests as last verified against
        self._registry_mark: str | None = None  # the registry's change mark when they were read
        self._following: threading.Thread | None = None  # follow_registry's thread
        self._thread = threading.Thread(target=self._run, name="homefleet-heartbeat", daemon=True)

    def start(self) -> None:
        # A new boot: nothing is warm yet (a pool child records its loads, tasks/runtime.py).
        self.redis.delete(self.keys.warm(self.settings.machine))
        self._thread.start()

    def stop(self) -> None:
        """Stop beating and take the machine offline at once (delete the heartbeat key), unless
        :meth:`abandon` was called: then the key is another worker's."""
        self._stop.set()
        self._thread.join(timeout=5)
        if not self.abandoned:
            self.redis.delete(self.keys.heartbeat(self.settings.machine))

    def abandon(self) -> None:
        """Stop writing this machine's heartbeat and verified set, leaving both as they are:
        another worker of this machine took the worker lease (tasks/worker.py, WorkerLease)."""
        self.abandoned = True
        self._stop.set()

    def _manifests(self) -> dict[str, dict[str, Any]]:
        server = ServerClient(self.settings.server_url, self.settings.worker_token, self.settings.http_timeout_s,
                              machine=self.settings.machine)
        try:
            return server.manifest()
        finally:
            server.close()

    def verify(self) -> set[str]:
        """Hash the local copies against the manifest; replace the advertised set (R4)."""
        self._registry_mark = self.redis.get(self.keys.registry_changed())  # before the manifests: a later change is seen
        manifests = self._manifests()
        verified = advertise(self.redis, self.keys, self.settings.machine, self.settings.models_dir, manifests)
        self.manifests = manifests
        self._redis_run_id = self.redis.info("server").get("run_id")
        return verified

    def follow_registry(self) -> None:
        """When the server's registry changed (its change mark, app/fleet/costs.py ChangeMark), bring the
        advertised set up to date (R4) in a thread of its own, so that beats go on meanwhile:

        - a model registered since, or whose manifest changed (``homefleet models verify``
          recorded new digests), is hashed, alone: advertised if its local copy matches the
          new manifest (the server's own worker shares the folder ``models add`` copies into),
          withdrawn otherwise (a worker's copy of the old content);
        - a model no longer registered is withdrawn.

        Models whose manifest is unchanged are not hashed again."""
        mark = self.redis.get(self.keys.registry_changed())
        if mark == self._registry_mark or (self._following is not None and self._following.is_alive()):
            return

        def follow() -> None:
            machine, key = self.settings.machine, self.keys.verified(self.settings.machine)
            try:
                manifests = self._manifests()
                changed = {m: manifest for m, manifest in manifests.items() if self.manifests.get(m) != manifest}
                gone = [m for m in self.manifests if m not in manifests]
                with open(self.settings.models_dir / ".homefleet-verify.lock", "a") as lock:
                    fcntl.flock(lock, fcntl.LOCK_EX)  # one check at a time (advertise)
                    matching = verified_models(self.settings.models_dir, changed)
                    if gone or set(changed) - matching:
                        self.redis.srem(key, *gone, *(set(changed) - matching))
                    if matching:
                        self.redis.sadd(key, *sorted(matching))
                if changed or gone:
                    log.info("%s: the registry changed; verified here: %s; not: %s", machine,
                             ", ".join(sorted(matching)) or "none", ", ".join(sorted(set(changed) - matching)) or "none")
                self.manifests, self._registry_mark = manifests, mark
            except (HomefleetError, httpx.HTTPError, redis.RedisError, OSError) as error:
                log.warning("%s: the registry's change could not be followed (%s); trying again", machine, error)

        self._following = threading.Thread(target=follow, name="homefleet-registry", daemon=True)
        self._following.start()

    def beat(self) -> None:
        """Write the heartbeat record, in one step with a check that this worker still holds its
        machine's lease (tasks/worker.py, WorkerLease): a worker that lost it to another writes
        nothing of that machine's any more. In the same step, restore what Redis lost:

        - the advertised set, when Redis restarted without persistence (its run id changed), so
          the machine stays placeable; otherwise the set is remembered as Redis holds it (syncs
          add to it, the job-time check withdraws from it, R4/R5);
        - the pool process's warm models (written by it at its start and after each load), when
          their record is gone, unless the pool process wrote a newer one meanwhile.
        """
        machine = self.settings.machine
        run_id = self.redis.info("server").get("run_id")
        restarted = run_id != self._redis_run_id
        if not restarted:
            self.verified = set(self.redis.smembers(self.keys.verified(machine)))
        warm = self.redis.get(self.keys.warm(machine))
        restore = self._warm if warm is None and self._warm is not None else None
        warm = warm if restore is None else restore
        memory = psutil.virtual_memory()
        verified = sorted(self.verified or ())
        record = {
            "machine": machine, "boot_id": self.boot_id, "pid": os.getpid(), "host": platform.node(),
            "device": self.device, "memory_total_bytes": memory.total, "memory_available_bytes": memory.available,
            "warm_models": json.loads(warm) if warm else [], "verified_models": verified, "at": time.time(),
        }
        written = self.redis.eval(
            _BEAT, 4, self.keys.worker_lease(machine), self.keys.heartbeat(machine), self.keys.verified(machine),
            self.keys.warm(machine), self.boot_id, json.dumps(record), int(self.settings.heartbeat_ttl_s * 1000),
            int(restarted), restore or "", *verified,
        )
        if not written:
            log.warning("%s: this worker does not hold the machine's lease now; heartbeat not written", machine)
            return
        self._redis_run_id = run_id
        self._warm = warm

    def obey_restart(self) -> None:
        """Watchdog (R19): when the server marked this machine's running job ``hung``, kill the
        pool process that runs it; the prefork pool starts a fresh one. The job is not re-run:
        its message was acked at start, and the journal already says ``interrupted``.

        The kill happens only when the running record (:func:`mark_running`) names that job and
        a live pool process of this worker. A job can stay ``running`` in the journal with
        nobody running it (its process was killed, or its claim's answer was lost): killing
        the pool then would cut the next, innocent job. Such a request is dropped, with a log
        line."""
        machine = self.settings.machine
        job_id = self.redis.getdel(self.keys.restart(machine))
        if job_id is None:
            return
        raw = self.redis.get(self.keys.running(machine))
        running = json.loads(raw) if raw else {}
        children = {child.pid: child for child in psutil.Process().children()}
        pid = running.get("pid")
        if running.get("job_id") != job_id or pid not in children:
            log.warning("%s: job %s was declared hung, but no pool process runs it (running: %s in pid %s); "
                        "restart request dropped, nothing killed", machine, job_id, running.get("job_id") or "none",
                        pid if pid in children else "none")
            return
        log.warning("%s: job %s was declared hung; killing its pool process %d (the pool starts a fresh one)",
                    machine, job_id, pid)
        self.killed.add(job_id)
        still = self.redis.get(self.keys.running(machine))  # again, at the last moment: the job may just have ended
        if still is None or json.loads(still).get("job_id") != job_id:
            log.warning("%s: job %s ended before its pool process was killed; nothing killed", machine, job_id)
            self.killed.discard(job_id)
            return
        try:
            children[pid].kill()
        except psutil.NoSuchProcess:
            log.info("%s: pool process %d of job %s had already ended", machine, pid, job_id)

    def report_lost(self, job_id: str, error: BaseException) -> None:
        """R21: the pool process running ``job_id`` died before the job reported back (Celery's
        ``WorkerLostError``, raised in this, the parent process). Killed by SIGKILL, what the
        kernel's OOM killer sends, the job is reported failed with reason ``oom``, so the server
        remembers its size. Not reported: a process the watchdog killed (the server already
        marked that job ``interrupted``) and any other death (reconciliation marks the job
        ``interrupted``, R19). Sent from a short daemon thread, so Celery's main loop never waits
        on the server; a report the server refuses (the job had ended, or was never claimed) is
        logged and dropped."""
        machine = self.settings.machine
        if job_id in self.killed:
            self.killed.discard(job_id)
            return
        if f"signal {int(signal.SIGKILL)} " not in str(error):
            log.error("%s: job %s lost its pool process (%s); left to reconciliation", machine, job_id, error)
            return
        raw = self.redis.get(self.keys.running(machine))
        running = json.loads(raw) if raw else {}
        if running.get("job_id") == job_id and not running.get("working"):
            # Killed while the job waited for the start-up preload: the preload's load, not this job.
            log.error("%s: job %s lost its pool process to SIGKILL while the preload loaded committed models; "
                      "reported as an error, no OOM remembered", machine, job_id)
            reason = "error"
            message = f"its pool process was killed while the start-up preload loaded committed models: {error}"
        else:
            log.error("%s: job %s lost its pool process to SIGKILL (%s); reporting it as oom (R21)", machine, job_id,
                      error)
            reason = "oom"
            message = f"its pool process was killed (SIGKILL, as the kernel's OOM killer does): {error}"

        def send() -> None:
            server = ServerClient(self.settings.server_url, self.settings.worker_token, self.settings.http_timeout_s,
                                  self.boot_id, self.settings.server_retry_s, machine=machine)
            try:
                server.fail(job_id, reason, message)
            except (HomefleetError, httpx.HTTPError) as refusal:
                log.warning("%s: job %s not reported as oom: %s", machine, job_id, refusal)
            finally:
                server.close()

        threading.Thread(target=send, name="homefleet-report-lost", daemon=True).start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                if self.verified is None:
                    self.verified = self.verify()
                self.beat()
                self.obey_restart()
                self.follow_registry()
            except Unauthorized as error:
                if self.verified is not None:  # the fleet config changed under a running worker: keep trying
                    log.error("%s heartbeat: %s (retrying in %.1f s)", self.settings.machine, error,
                              self.settings.heartbeat_interval_s)
                else:  # a wrong token never becomes right: stop instead of retrying forever
                    log.critical("%s: the server refused this worker's token (%s); set HOMEFLEET_WORKER_TOKEN "
                                 "(or --token) to the token of machine %r in the server's fleet config; stopping",
                                 self.settings.machine, error, self.settings.machine)
                    self.refused = True
                    os.kill(os.getpid(), signal.SIGTERM)  # Celery's warm shutdown; start_worker exits 78
                    return
            except (HomefleetError, httpx.HTTPError, redis.RedisError, OSError) as error:
                log.warning("%s heartbeat: %s (retrying in %.1f s)", self.settings.machine, error,
                            self.settings.heartbeat_interval_s)
            self._stop.wait(self.settings.heartbeat_interval_s)
