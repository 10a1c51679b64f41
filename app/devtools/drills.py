"""Fault drills (docs/operations.md, "Fault drills"): real faults against a real local fleet, counted from the outside.

Each drill submits jobs, injects its fault, waits until every job has ended (reconciliation
included) and counts:

- ``jobs``: jobs the journal holds for the drill (acknowledged or journaled before a crash);
- ``runs``: executions, counted from the workers' own logs ("job <id> claimed"), not from
  the journal, so the count does not trust the mechanism under test;
- ``double_runs``: jobs executed more than once (target 0);
- ``lost``: jobs acknowledged to the client or journaled that are missing from the journal
  or never reached an ended state (target 0);
- ``interrupted``: jobs marked ``interrupted`` (may have started; never re-run).

The last line of every drill reads
``drill=NAME jobs=N runs=N double_runs=N lost=N interrupted=N``, followed by the drill's own
figures where it has some (``redis_loss_requeue``: ``restarts``, ``queued_at_loss``, ``republished``,
``ran_once``, ``order_kept``, ``worker_lost``; ``redis_loss_backlogs``: ``repeats``, ``backlogs``,
``order_kept``, ``republished``, ``succeeded``).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import statistics
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, NamedTuple, cast

import httpx
import psutil

from app.client import ApiError, HomefleetClient
from app.context import ServerContext, build_context
from app.core import keys
from app.core.celery_app import RUN_JOB_TASK
from app.core.config import Settings
from app.core.limits import key_id
from app.core.secret_files import write_private
from app.core.states import ENDED, JobState
from app.devtools.localfleet import LocalFleet
from app.devtools.procs import stop_process_group
from app.devtools.redis_server import RedisProcess, free_port, start_redis_server
from app.devtools.sentinel import SentinelSet, start_sentinel_set
from app.fleet.config import Fleet, Machine, WebhookConfig, with_fresh_tokens
from app.fleet.queues import message_id

MODEL = "tiny-sd"
WORKERS = ("m1", "m2")
DRILL_API_KEY = "drill-api-key-0123456789"  # the drill fleet's own API key
DRILL_WEBHOOK_SECRET = "drill-webhook-secret-0123456789"  # signs the webhooks of DRILL_API_KEY's jobs
_CLAIMED = re.compile(r"job ([0-9a-f]{32}) claimed")


@dataclass(frozen=True)
class DrillResult:
    name: str
    jobs: int
    runs: int
    double_runs: int
    lost: int
    interrupted: int
    figures: dict[str, int] = field(default_factory=dict)  # the drill's own figures, in order

    def line(self) -> str:
        own = "".join(f" {name}={value}" for name, value in self.figures.items())
        return (
            f"drill={self.name} jobs={self.jobs} runs={self.runs} double_runs={self.double_runs} "
            f"lost={self.lost} interrupted={self.interrupted}{own}"
        )


POSTGRES_ADMIN_URL = os.environ.get("HOMEFLEET_TEST_POSTGRES", "postgresql://postgres@127.0.0.1:5432/postgres")
"""The PostgreSQL server a standby drill makes its journal's database on (the tests' variable)."""


def postgres_url(database: str) -> str:
    """The SQLAlchemy URL of ``database`` on :data:`POSTGRES_ADMIN_URL`'s server."""
    return POSTGRES_ADMIN_URL.replace("postgresql://", "postgresql+psycopg://").rsplit("/", 1)[0] + f"/{database}"


def create_postgres_database() -> str:
    """Create a database ``hf_drill_<random>``; return its name."""
    import psycopg

    name = f"hf_drill_{secrets.token_hex(6)}"
    with psycopg.connect(POSTGRES_ADMIN_URL, autocommit=True, connect_timeout=5) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    return name


def drop_postgres_database(name: str) -> None:
    import psycopg

    with psycopg.connect(POSTGRES_ADMIN_URL, autocommit=True, connect_timeout=5) as admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def drill_fleet_config(workers: tuple[str, ...] = WORKERS) -> Fleet:
    families = frozenset({"sd1"})
    machines = {
        name: Machine(name=name, backend="cpu", memory_kind="unified", memory_bytes=4_000_000_000, families=families)
        for name in ("server", *workers)
    }
    # webhooks to this host only: the drills' own receiver (:func:`webhook_counter`)
    return with_fresh_tokens(Fleet(machines=machines, webhooks=WebhookConfig(allow_hosts=["127.0.0.1"])))


class DrillFleet:
    """A private Redis (restartable on its port), the API and workers m1 and m2, with short
    heartbeat, reconciliation and grace periods so that faults are found within seconds.
    ``sentinel``: instead of one Redis, a master, a replica and three Sentinels
    (app/devtools/sentinel.py), every process given the ``sentinel://`` URL; ``workers``: the
    machines that run a worker."""

    def __init__(
        self,
        work_dir: Path,
        tiny_model: Path,
        visibility_timeout_s: int = 3600,
        hung_after_s: float = 120.0,
        broker_key_prefix: str = "",
        forkserver: bool = False,
        sentinel: bool = False,
        workers: tuple[str, ...] = WORKERS,
        standby: bool = False,
    ) -> None:
        self.work_dir = work_dir
        self.standby = standby  # a PostgreSQL journal of its own (POSTGRES_ADMIN_URL), leader election on
        self.database: str | None = None
        self.sentinel = sentinel
        self.sentinels: SentinelSet | None = None
        self.workers = workers
        self.forkserver = forkserver  # LocalFleet's: fork the API and workers from a preloaded interpreter
        self.tiny_model = tiny_model
        self.visibility_timeout_s = visibility_timeout_s
        self.hung_after_s = hung_after_s
        self.broker_key_prefix = broker_key_prefix  # e.g. "drill:", as when one Redis serves several apps
        self.redis_port = free_port()
        self.standby_port = free_port()  # the second ``homefleet serve`` of a standby drill
        self.worker_env: dict[str, str] = {}  # settings every worker of the drill starts with
        self.redis_password = secrets.token_urlsafe(16)  # the drill fleet's Redis runs with requirepass
        self.redis: RedisProcess | None = None
        self.local: LocalFleet | None = None
        self.ctx: ServerContext | None = None
        self.client: HomefleetClient | None = None
        self._earlier: set[str] = set()
        self._held: set[str] = set()  # machines whose pool process :meth:`hold` stopped

    def __enter__(self) -> DrillFleet:
        try:
            self.start()
        except BaseException:  # interrupted or failed while starting: stop what did start, then re-raise
            self.stop()
            raise
        return self

    def __exit__(self, *_: object) -> None:
        self.stop()

    def start(self) -> None:
        if self.sentinel:
            self.sentinels = start_sentinel_set(self.work_dir / "sentinel", password=self.redis_password)
            redis_url, master = self.sentinels.url, self.sentinels.master_name
        else:
            self.redis = start_redis_server(self.work_dir / "redis", port=self.redis_port, password=self.redis_password)
            redis_url, master = self.redis.url, ""
        if self.standby:
            self.database = create_postgres_database()
        fleet = drill_fleet_config(self.workers)
        fleet_file = self.work_dir / "fleet.toml"
        self.work_dir.mkdir(parents=True, exist_ok=True)
        write_private(fleet_file, fleet.to_toml())
        settings = Settings(
            data_dir=self.work_dir / "server",
            redis_url=redis_url,
            redis_sentinel_master=master,
            fleet_file=fleet_file,
            api_port=free_port(),
            visibility_timeout_s=self.visibility_timeout_s,
            broker_key_prefix=self.broker_key_prefix,
            heartbeat_interval_s=0.5,
            heartbeat_ttl_s=8,
            reconcile_interval_s=1,
            lost_grace_s=2,
            hung_after_s=self.hung_after_s,
            api_keys=[DRILL_API_KEY],
            # a drill queues all its jobs at once: backpressure (R23) is not what it measures
            max_queued_per_machine=100_000,
            max_pending_total=100_000,
            database_url=postgres_url(self.database) if self.database else None,
            leader_election=self.standby,
            leader_poll_s=0.5,
            webhook_secrets={key_id({}, DRILL_API_KEY): DRILL_WEBHOOK_SECRET},
            webhook_backoff_s=0.2,
            webhook_poll_s=0.5,
        )
        self.ctx = build_context(settings, fleet, migrate=True)
        self.ctx.registry.add(self.tiny_model, model_id=MODEL)
        self.local = LocalFleet(settings, fleet, fleet_file, forkserver=self.forkserver)
        for machine in self.workers:
            self.local.copy_model(MODEL, machine)
        self.local.start_api()
        # with a standby server (its port chosen now, started by the drill), workers know both
        # servers' URLs (docs/operations.md, "A standby server")
        if self.standby:
            self.worker_env["HOMEFLEET_SERVER_URL"] = f"{self.local.api_url},{self.standby_url}"
        for machine in self.workers:  # a token file, as an operator should: no token in ps or env
            self.local.start_worker(machine, self.worker_env, token_file=True)
        self.local.wait_online(list(self.workers), model_id=MODEL, timeout_s=180)
        self.client = HomefleetClient(self.local.api_url, api_key=DRILL_API_KEY)

    @property
    def standby_url(self) -> str:
        """The standby server's URL (started by :func:`drill_standby_server`)."""
        assert self.local is not None
        return f"http://{self.local.settings.api_host}:{self.standby_port}"

    def stop(self) -> None:
        self.release()  # a stopped pool process would not act on the fleet's SIGTERM
        if self.client is not None:
            self.client.close()
        if self.local is not None:
            self.local.stop()
        if self.ctx is not None:
            self.ctx.close()
        if self.redis is not None:
            self.redis.stop()
        if self.sentinels is not None:
            self.sentinels.stop()
        if self.database is not None:
            drop_postgres_database(self.database)

    # -- faults ---------------------------------------------------------------------------
    def restart_redis(self) -> None:
        """Stop Redis and start an empty one on the same port (no persistence: queues are gone)."""
        assert self.redis is not None
        self.redis.stop()
        self.redis = start_redis_server(self.work_dir / "redis", port=self.redis_port, password=self.redis_password)

    def kill_worker(self, machine: str) -> None:
        assert self.local is not None
        self.local.stop_worker(machine, signal.SIGKILL)
        self.local.start_worker(machine, self.worker_env, token_file=True)

    def freeze_pool_process(self, machine: str) -> int:
        """SIGSTOP the pool process of ``machine``'s worker (the one running its job): a hang."""
        assert self.local is not None
        children = psutil.Process(self.local.processes[f"worker-{machine}"].pid).children()
        for child in children:
            child.send_signal(signal.SIGSTOP)
        return len(children)

    def hold(self, machine: str, job_id: str, timeout_s: float = 120.0) -> None:
        """Keep ``job_id`` running on ``machine`` for as long as the drill needs, at no CPU: once
        the job has reported its first step, stop its worker's pool process (SIGSTOP) until
        :meth:`release`. The worker's parent runs on (it beats and answers control commands, R7),
        so to the fleet the job is in a long step. A job kept busy by its steps alone could end
        before the fault on a fast host, and holds a core throughout on a slow one. The hold must
        stay under the fleet's ``hung_after_s`` once Redis has lost the job's progress (R19):
        the drills wait at most :attr:`hold_bound_s` before releasing it.

        Raises:
            AssertionError: the job reported no step within ``timeout_s`` seconds, or it ended
                before its pool process was stopped (give it more steps: :data:`HELD_STEPS`).
        """
        assert self.ctx is not None
        deadline = time.monotonic() + timeout_s
        while (progress := self.ctx.progress.read(job_id)) is None or not progress.step:
            assert time.monotonic() < deadline, f"job {job_id} on {machine} reported no step within {timeout_s:g} s"
            time.sleep(0.02)
        self.freeze_pool_process(machine)
        self._held.add(machine)
        state = self.ctx.journal.state_of(job_id)
        if state != JobState.running:
            self.release()
            raise AssertionError(f"job {job_id} on {machine} was {state} before it could be held")

    def release(self) -> None:
        """Continue every pool process :meth:`hold` stopped (SIGCONT); their jobs run on."""
        assert self.local is not None or not self._held
        for machine in sorted(self._held):
            worker = self.local.processes.get(f"worker-{machine}") if self.local is not None else None
            if worker is not None and worker.poll() is None:
                for child in psutil.Process(worker.pid).children():
                    child.send_signal(signal.SIGCONT)
        self._held.clear()

    @property
    def hold_bound_s(self) -> float:
        """How long (seconds) a drill waits with a job held once Redis may have lost its progress:
        half the fleet's ``hung_after_s`` (at most 60 s), so that reconciliation never takes the
        held job for a hung one (R19); past it the job is released and the drill's figures tell."""
        return min(60.0, self.hung_after_s / 2)

    def wait_requeued(self, job_ids: set[str], timeout_s: float) -> None:
        """Wait (at most ``timeout_s``) until reconciliation has published each of ``job_ids``
        again (a ``requeued`` event in its journal, R19); the drill's figures tell if it did not."""
        assert self.ctx is not None
        deadline = time.monotonic() + timeout_s
        journal = self.ctx.journal
        while time.monotonic() < deadline:
            if all(any(e.event == "requeued" for e in journal.events(job_id)) for job_id in job_ids):
                return
            time.sleep(0.1)

    def kill_api(self) -> None:
        assert self.local is not None
        stop_process_group(self.local.processes.pop("api"), signal.SIGKILL)
        self.local.start_api()

    def wait_running(self, machine: str, running: bool, timeout_s: float) -> None:
        """Wait (at most ``timeout_s``) until ``machine`` runs a job (``running``) or runs none."""
        assert self.ctx is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            busy = any(j.machine == machine for j in self.ctx.journal.list([JobState.running]))
            if busy == running:
                return
            time.sleep(0.05)

    def wait_claim_logged(self, machine: str, timeout_s: float) -> None:
        """Wait (at most ``timeout_s``) until the job ``machine`` runs has its claim line in the
        worker's log. The journal says running at the claim, the worker logs it a moment later
        (``tasks/run_job.py``): a kill between the two would leave a run that
        :meth:`executions` cannot count."""
        assert self.ctx is not None and self.local is not None
        log = self.local.logs_dir / f"worker-{machine}.log"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            running = [j.id for j in self.ctx.journal.list([JobState.running]) if j.machine == machine]
            found = set(_CLAIMED.findall(log.read_text(errors="replace"))) if log.exists() else set()
            if running and running[0] in found:
                return
            time.sleep(0.05)

    # -- counting -------------------------------------------------------------------------
    def executions(self) -> Counter[str]:
        """How many times each job id was executed, from every worker log of this drill."""
        assert self.local is not None
        counts: Counter[str] = Counter()
        for log in self.local.logs_dir.glob("worker-*.log"):
            counts.update(_CLAIMED.findall(log.read_text(errors="replace")))
        return counts

    def claim_order(self, machine: str) -> list[str]:
        """Job ids in the order ``machine``'s worker claimed them (its log, first claim of each)."""
        assert self.local is not None
        log = self.local.logs_dir / f"worker-{machine}.log"
        found = _CLAIMED.findall(log.read_text(errors="replace")) if log.exists() else []
        return list(dict.fromkeys(found))

    def begin(self) -> None:
        """Mark the start of a drill: jobs journaled before it do not count."""
        assert self.ctx is not None
        self._earlier = {j.id for j in self.ctx.journal.list()}

    def _drill_states(self) -> dict[str, JobState]:
        assert self.ctx is not None
        return {
            j.id: j.state for j in self.ctx.journal.list() if j.id not in self._earlier and j.state != JobState.rejected
        }

    def wait_ended(self, job_ids: set[str], timeout_s: float) -> dict[str, JobState]:
        """Wait until every job of the drill and of ``job_ids`` has ended (or ``timeout_s``);
        return the drill's jobs' states."""
        deadline = time.monotonic() + timeout_s
        while True:
            states = self._drill_states()
            if all(states.get(i) in ENDED for i in set(states) | job_ids) or time.monotonic() > deadline:
                return states
            time.sleep(0.25)

    def result(self, name: str, acknowledged: set[str], timeout_s: float) -> DrillResult:
        """Wait until every job of the drill has ended (or ``timeout_s``), then count."""
        states = self.wait_ended(acknowledged, timeout_s)
        mine = set(states) | acknowledged
        runs = self.executions()
        return DrillResult(
            name=name,
            jobs=len(mine),
            runs=sum(runs[i] for i in mine),
            double_runs=sum(1 for i in mine if runs[i] > 1),
            lost=sum(1 for i in mine if states.get(i) not in ENDED),
            interrupted=sum(1 for i in mine if states.get(i) == JobState.interrupted),
        )


#: the side (pixels) of a drill's long jobs, which keep a machine busy while a fault strikes: a
#: step of the tiny model costs ~0.145 CPU-s there, ~0.04 at its default 64x64 (one torch thread)
LONG_SIDE = 112
#: the steps of a drill's held job (:meth:`DrillFleet.hold`, at the model's default size): enough
#: that it is still running when its pool process is stopped after its first step
HELD_STEPS = 20


def _submit(fleet: DrillFleet, index: int, steps: int, target: str | None = None, side: int | None = None) -> str:
    """Submit drill job ``index`` (``steps`` steps; ``side`` x ``side`` pixels, default the
    model's) to ``target`` (default: the drill's workers in turn); its id."""
    assert fleet.client is not None
    target = target or WORKERS[index % len(WORKERS)]
    params: dict[str, object] = {"prompt": f"drill {index}", "steps": steps}
    if side is not None:
        params |= {"width": side, "height": side}
    return str(fleet.client.submit(MODEL, "txt2img", params, target=target)["id"])


def drill_duplicate(fleet: DrillFleet, count: int) -> DrillResult:
    """Every job's message is delivered twice (a second publish with the same task id)."""
    fleet.begin()
    assert fleet.ctx is not None
    acknowledged = set()
    for i in range(count):
        job_id = _submit(fleet, i, steps=1)
        machine = WORKERS[i % len(WORKERS)]
        fleet.ctx.celery.send_task(RUN_JOB_TASK, args=[job_id], task_id=job_id, queue=keys.queue(machine))
        acknowledged.add(job_id)
    return fleet.result("duplicate", acknowledged, timeout_s=60 + 10 * count)


def drill_worker_kill(fleet: DrillFleet, count: int) -> DrillResult:
    """kill -9 of worker m1 while it runs a job, ``max(1, count // 25)`` times."""
    fleet.begin()
    assert fleet.ctx is not None
    acknowledged = {_submit(fleet, i, steps=3, side=LONG_SIDE) for i in range(count)}
    for _ in range(max(1, count // 25)):
        fleet.wait_running("m1", True, timeout_s=120)
        fleet.wait_claim_logged("m1", timeout_s=60)
        fleet.kill_worker("m1")
        assert fleet.local is not None
        fleet.local.wait_online(["m1"], model_id=MODEL, timeout_s=120)
    return fleet.result("worker_kill", acknowledged, timeout_s=120 + 10 * count)


def drill_server_kill(fleet: DrillFleet, count: int) -> DrillResult:
    """kill -9 of the API in the middle of a burst of submissions from 4 threads. A client
    whose request failed retries deliberately with the same Idempotency-Key (R20)."""
    fleet.begin()
    assert fleet.local is not None
    acknowledged: set[str] = set()
    guard = threading.Lock()
    url = fleet.local.api_url

    def submitter(worker_index: int) -> None:
        with HomefleetClient(url, timeout_s=10, api_key=DRILL_API_KEY) as client:
            for i in range(worker_index, count, 4):
                key = f"drill-server-kill-{time.time_ns()}-{i}"
                body = {"prompt": f"burst {i}", "steps": 1}
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline:
                    try:
                        job = client.submit(MODEL, "txt2img", body, target=WORKERS[i % 2], idempotency_key=key)
                    except (httpx.HTTPError, ApiError) as error:
                        if isinstance(error, ApiError) and error.status_code != 503:
                            raise
                        time.sleep(0.2)  # the server is down or busy: retry with the SAME key
                        continue
                    with guard:
                        acknowledged.add(job["id"])
                    break

    threads = [threading.Thread(target=submitter, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    while len(acknowledged) < count // 2 and any(t.is_alive() for t in threads):
        time.sleep(0.01)
    fleet.kill_api()
    for thread in threads:
        thread.join()
    return fleet.result("server_kill", acknowledged, timeout_s=60 + 10 * count)


def drill_redis_restart(fleet: DrillFleet, count: int) -> DrillResult:
    """Redis restarted (no persistence) while jobs wait in m1's queue behind a long job: they are
    published again by reconciliation and run once each."""
    fleet.begin()
    assert fleet.ctx is not None
    long_job = _submit(fleet, 0, steps=HELD_STEPS, target="m1")
    acknowledged = {long_job} | {_submit(fleet, i, steps=1, target="m1") for i in range(1, count)}
    fleet.hold("m1", long_job)
    try:
        fleet.restart_redis()
    finally:
        fleet.release()
    return fleet.result("redis_restart", acknowledged, timeout_s=90 + 10 * count)


def drill_redis_loss_requeue(fleet: DrillFleet, count: int) -> DrillResult:
    """Redis loses its data (restarted without persistence) while m1 runs a long job
    and jobs wait behind it; then newer jobs are submitted (retried while m1 is not yet online
    again). Reconciliation publishes the waiting ones again, in journal order, ahead of the
    newer ones; each runs once; the long job, whose worker stays alive, is never judged
    ``worker_lost``. ``max(1, count // 25)`` rounds (restarts), each of ``count // rounds``
    jobs: one long, the rest waiting, and a quarter as many newer ones.

    Figures: ``restarts``, ``queued_at_loss`` (jobs waiting when Redis lost its data),
    ``republished`` (of them, published again: their journal event ``requeued``), ``ran_once``
    (of them, executed exactly once), ``order_kept`` (1 when m1 claimed every job of the drill,
    old and new, in journal order), ``worker_lost`` (jobs marked so; target 0)."""
    fleet.begin()
    assert fleet.ctx is not None and fleet.client is not None
    rounds = max(1, count // 25)
    per_round = max(2, count // rounds)
    mine: set[str] = set()
    waiting: list[str] = []
    for round_index in range(rounds):
        base = round_index * per_round * 2
        running = _submit(fleet, base, steps=HELD_STEPS, target="m1")
        fleet.hold("m1", running)
        try:  # m1 stays busy until the waiting jobs are published again, ahead of the newer ones
            queued = [_submit(fleet, base + i, steps=1, target="m1") for i in range(1, per_round)]
            fleet.restart_redis()
            newer = [_submit_retrying(fleet, base + per_round + i) for i in range(max(1, per_round // 4))]
            fleet.wait_requeued(set(queued), timeout_s=fleet.hold_bound_s)
        finally:
            fleet.release()
        mine |= {running, *queued, *newer}
        waiting += queued
        fleet.wait_ended(mine, timeout_s=120 + 10 * per_round)
    result = fleet.result("redis_loss_requeue", mine, timeout_s=60)
    runs = fleet.executions()
    journal = fleet.ctx.journal
    republished = sum(1 for job_id in waiting if any(e.event == "requeued" for e in journal.events(job_id)))
    in_journal_order = [job.id for job in journal.list(machine="m1") if job.id in mine]
    claimed = [job_id for job_id in fleet.claim_order("m1") if job_id in mine]
    worker_lost = sum(1 for job in journal.list() if job.id in mine and job.reason == "worker_lost")
    return replace(
        result,
        figures={
            "restarts": rounds,
            "queued_at_loss": len(waiting),
            "republished": republished,
            "ran_once": sum(1 for job_id in waiting if runs[job_id] == 1),
            "order_kept": int(claimed == in_journal_order),
            "worker_lost": worker_lost,
        },
    )


#: jobs waiting in each machine's backlog in one repeat of :func:`drill_redis_loss_backlogs`
BACKLOG = 6
#: jobs in one repeat: m1's long job, then a backlog on m1 (busy) and one on m2 (idle)
JOBS_PER_REPEAT = 1 + 2 * BACKLOG


def drill_redis_loss_backlogs(fleet: DrillFleet, count: int) -> DrillResult:
    """R8 and R19 over repeats: ``max(1, count // JOBS_PER_REPEAT)`` times, backlogs of
    :data:`BACKLOG` one-step jobs fill two machines, m1 busy (behind a job it runs, held until
    that backlog is published again) and m2 idle (its first job starts at once, the rest wait),
    and Redis loses its data: ``FLUSHALL`` on even repeats, a restart without persistence on odd
    ones. Reconciliation publishes the queued jobs again (MachineQueues.put_in_order); the drill
    waits until all have ended, then reads from each worker's own log the order it claimed that
    backlog's jobs.

    Figures: ``repeats``, ``backlogs`` (machines x repeats), ``order_kept`` (backlogs claimed in
    submission order, the long job first on m1), ``republished`` (jobs whose journal has a
    ``requeued`` event), ``succeeded``; with the common ``lost`` and ``double_runs`` (target 0)."""
    fleet.begin()
    assert fleet.ctx is not None and fleet.client is not None
    repeats = max(1, count // JOBS_PER_REPEAT)
    mine: set[str] = set()
    backlogs: list[tuple[str, list[str]]] = []  # (machine, its jobs in submission order), per repeat
    for repeat in range(repeats):
        base = repeat * JOBS_PER_REPEAT
        busy = [_submit(fleet, base, steps=HELD_STEPS, target="m1")]
        fleet.hold("m1", busy[0])
        try:  # m1 stays busy until its backlog is published again
            busy += [_submit(fleet, base + 1 + i, steps=1, target="m1") for i in range(BACKLOG)]
            idle = [_submit(fleet, base + 1 + BACKLOG + i, steps=1, target="m2") for i in range(BACKLOG)]
            if repeat % 2 == 0:
                fleet.ctx.redis.flushall()
            else:
                fleet.restart_redis()
            fleet.wait_requeued(set(busy[1:]), timeout_s=fleet.hold_bound_s)
        finally:
            fleet.release()
        backlogs += [("m1", busy), ("m2", idle)]
        mine |= {*busy, *idle}
        fleet.wait_ended(mine, timeout_s=120 + 10 * JOBS_PER_REPEAT)
        assert fleet.local is not None  # the workers report their verified models again after the loss
        fleet.local.wait_online(list(WORKERS), model_id=MODEL, timeout_s=120)
    result = fleet.result("redis_loss_backlogs", mine, timeout_s=60)
    journal = fleet.ctx.journal
    claimed = {machine: fleet.claim_order(machine) for machine in WORKERS}
    kept = sum(1 for machine, jobs in backlogs if [j for j in claimed[machine] if j in set(jobs)] == jobs)
    return replace(
        result,
        figures={
            "repeats": repeats,
            "backlogs": len(backlogs),
            "order_kept": kept,
            "republished": sum(1 for job_id in mine if any(e.event == "requeued" for e in journal.events(job_id))),
            "succeeded": sum(1 for job in journal.list() if job.id in mine and job.state == JobState.succeeded),
        },
    )


def _submit_retrying(fleet: DrillFleet, index: int, timeout_s: float = 60.0) -> str:
    """:func:`_submit` to m1, retried while it answers 503 (m1's worker has not beaten again yet)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return _submit(fleet, index, steps=1, target="m1")
        except ApiError as error:
            if error.status_code != 503 or time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def drill_visibility(fleet: DrillFleet, count: int, steps: int = 30) -> DrillResult:
    """C01: jobs that run longer than the broker's visibility timeout (the fleet must be
    started with a short ``visibility_timeout_s``, e.g. 2 s; ``steps`` long enough for that)."""
    fleet.begin()
    acknowledged = {_submit(fleet, i, steps=steps, side=LONG_SIDE) for i in range(count)}
    return fleet.result("visibility", acknowledged, timeout_s=120 + 18 * count)


def drill_hang(fleet: DrillFleet, count: int) -> DrillResult:
    """Watchdog: m1's pool process freezes (SIGSTOP) mid-job, ``max(1, count // 25)`` times.
    The fleet must be started with a short ``hung_after_s`` (e.g. 20 s): the job becomes
    ``interrupted`` (``hung``), the worker replaces its pool process, and the rest run."""
    fleet.begin()
    assert fleet.ctx is not None
    acknowledged = {_submit(fleet, i, steps=3, side=LONG_SIDE) for i in range(count)}
    for _ in range(max(1, count // 25)):
        fleet.wait_running("m1", True, timeout_s=120)
        fleet.freeze_pool_process("m1")
        fleet.wait_running("m1", False, timeout_s=fleet.hung_after_s + 60)
    return fleet.result("hang", acknowledged, timeout_s=120 + 10 * count)


SENTINEL_WORKERS = ("m1", "m2", "m3")  # the sentinel_failover drill's machines: queued work on three
SENTINEL_ROUND_JOBS = 10  # ``count`` per failover round of sentinel_failover
LOST_WRITES = 2  # messages per round the promoted replica lacks (the master's last writes)


class _Answer(NamedTuple):
    """One answer to a submission during a switch: when its request was sent and answered
    (``time.monotonic()`` seconds), its HTTP code (0: no answer) and whether a 503 said Retry-After."""

    sent_s: float
    answered_s: float
    code: int
    retry_after: bool


@dataclass
class _SwitchSubmitter:
    """Submits one job after another while the master is lost and replaced, each retried with
    its own ``Idempotency-Key`` until accepted (R20), and records every answer's time and code."""

    fleet: DrillFleet
    first_index: int
    answers: list[_Answer] = field(default_factory=list)
    accepted: set[str] = field(default_factory=set)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        assert self.fleet.local is not None
        index = self.first_index
        with HomefleetClient(self.fleet.local.api_url, timeout_s=30, api_key=DRILL_API_KEY) as client:
            while not self.stop.is_set():
                key = f"drill-sentinel-{time.time_ns()}-{index}"
                target = SENTINEL_WORKERS[index % len(SENTINEL_WORKERS)]
                body = {"prompt": f"switch {index}", "steps": 1}
                while True:  # the same key until accepted: never two jobs for one submission
                    sent_s = time.monotonic()
                    try:
                        job = client.submit(MODEL, "txt2img", body, target=target, idempotency_key=key)
                    except ApiError as error:
                        retry_after = error.retry_after_s is not None
                        self.answers.append(_Answer(sent_s, time.monotonic(), error.status_code, retry_after))
                        if error.status_code not in (429, 503):
                            return  # a 4xx or 500: counted, the drill fails on it
                        time.sleep(0.2)
                        continue
                    except httpx.HTTPError:
                        self.answers.append(_Answer(sent_s, time.monotonic(), 0, False))
                        time.sleep(0.2)
                        continue
                    self.answers.append(_Answer(sent_s, time.monotonic(), 202, False))
                    self.accepted.add(str(job["id"]))
                    break
                index += 1
                time.sleep(0.1)


def _accepted_since(answers: list[_Answer], since_s: float) -> list[float]:
    """When each 202 came, of the submissions sent at or after ``since_s`` (monotonic seconds)."""
    return [a.answered_s for a in answers if a.code == 202 and a.sent_s >= since_s]


def drill_sentinel_failover(fleet: DrillFleet, count: int) -> DrillResult:
    """The Redis master is SIGKILLed and Sentinel promotes its replica (docs/operations.md,
    "Redis Sentinel"), ``max(1, count // 10)`` times. The fleet must be started with
    ``sentinel=True`` and ``workers=SENTINEL_WORKERS``. Each round: a long job runs on each of
    m1, m2 and m3 with 3 short ones queued behind it, a client submits without pause (each
    submission retried with its own Idempotency-Key on 503), the newest :data:`LOST_WRITES`
    messages of m1's queue are taken off the master (the writes an asynchronous replica may
    lack) and the master is killed; afterwards the killed node comes back as the new replica.
    The long jobs are held (:meth:`DrillFleet.hold`) until the lost writes are published again.
    Messages the promoted replica lacks are published again from the journal by reconciliation (R19).

    Figures: ``failovers``; ``accept_again_ms`` (the longest, over rounds, from the master's death
    to the first 202 of a submission sent after it: one sent before may still be accepted by
    it); ``refused_503`` (answers 503 during the switches),
    ``no_retry_after`` (of them, without ``Retry-After``; target 0), ``errors_500`` (other 5xx and
    4xx answers; target 0); ``writes_lost`` (messages the promoted replica lacked);
    ``republished`` (jobs published again by reconciliation; at least ``writes_lost``);
    ``order_kept`` (1 when every machine claimed the drill's jobs in journal order);
    ``worker_restarts`` (worker processes replaced; target 0: they reconnect by themselves)."""
    fleet.begin()
    assert fleet.ctx is not None and fleet.local is not None and fleet.sentinels is not None
    sentinels = fleet.sentinels
    rounds = max(1, count // SENTINEL_ROUND_JOBS)
    pids = {m: fleet.local.processes[f"worker-{m}"].pid for m in fleet.workers}
    mine: set[str] = set()
    answers: list[_Answer] = []
    accept_again_s = 0.0
    dropped = 0
    for round_index in range(rounds):
        base = round_index * 1000
        long_jobs = {m: _submit(fleet, base + i, steps=HELD_STEPS, target=m) for i, m in enumerate(fleet.workers)}
        mine |= set(long_jobs.values())
        for machine, job_id in long_jobs.items():
            fleet.hold(machine, job_id)
        mine |= {
            _submit(fleet, base + 10 + j * 3 + i, steps=1, target=m)
            for j in range(3)
            for i, m in enumerate(fleet.workers)
        }
        # What asynchronous replication may lose: the master's last writes. The newest messages on
        # m1's queue are popped from the master just before it is killed (replicated: the replica
        # lacks them too); reconciliation must publish them again from the journal (R19).
        lost = cast("list[str]", fleet.ctx.redis.lpop(fleet.ctx.keys.queue_list("m1"), LOST_WRITES) or [])
        dropped += len(lost)
        submitter = _SwitchSubmitter(fleet, base + 100)
        thread = threading.Thread(target=submitter.run)
        thread.start()
        old = sentinels.kill_master()
        # From the master's death: a submission sent before it may still be answered 202 by it.
        killed_at = time.monotonic()
        new = sentinels.wait_promoted(old, timeout_s=60)
        deadline = time.monotonic() + 120

        while not _accepted_since(submitter.answers, killed_at):
            if time.monotonic() > deadline or not thread.is_alive():
                break
            time.sleep(0.05)
        again = _accepted_since(submitter.answers, killed_at)
        accept_again_s = max(accept_again_s, (again[0] - killed_at) if again else float("inf"))
        submitter.stop.set()
        thread.join(timeout=120)
        # the machines stay busy until the lost writes are published again, in journal order
        fleet.wait_requeued({i for i in map(message_id, lost) if i is not None}, timeout_s=fleet.hold_bound_s)
        fleet.release()
        mine |= submitter.accepted
        answers += submitter.answers
        fleet.wait_ended(mine, timeout_s=120 + 10 * len(mine))
        sentinels.restart_as_replica(old, new)
    result = fleet.result("sentinel_failover", mine, timeout_s=60)
    journal = fleet.ctx.journal
    order_kept = True
    runs = fleet.executions()
    for machine in fleet.workers:
        in_journal_order = [job.id for job in journal.list(machine=machine) if job.id in mine and runs[job.id]]
        claimed = [job_id for job_id in fleet.claim_order(machine) if job_id in mine]
        order_kept = order_kept and claimed == in_journal_order
    return replace(
        result,
        figures={
            "failovers": rounds,
            "accept_again_ms": int(accept_again_s * 1000) if accept_again_s != float("inf") else -1,
            "refused_503": sum(1 for a in answers if a.code == 503),
            "no_retry_after": sum(1 for a in answers if a.code == 503 and not a.retry_after),
            "errors_500": sum(1 for a in answers if a.code not in (0, 202, 429, 503)),
            "writes_lost": dropped,
            "republished": sum(1 for job_id in mine if any(e.event == "requeued" for e in journal.events(job_id))),
            "order_kept": int(order_kept),
            "worker_restarts": sum(1 for m, pid in pids.items() if fleet.local.processes[f"worker-{m}"].pid != pid),
        },
    )


LEADS = "this server leads"  # app/db/leadership.py's line when a server takes the lead


def _leads_since(log: Path, offset: int) -> bool:
    """True when ``log`` says, after byte ``offset``, that its server took the lead."""
    if not log.exists():
        return False
    with log.open("rb") as handle:
        handle.seek(offset)
        return LEADS.encode() in handle.read()


@dataclass
class WebhookCounter:
    """Webhook POSTs received, by the ``id`` of the job record each carries."""

    url: str
    received: Counter[str] = field(default_factory=Counter)
    guard: threading.Lock = field(default_factory=threading.Lock)

    def counts(self) -> Counter[str]:
        with self.guard:
            return Counter(self.received)


@contextmanager
def webhook_counter() -> Iterator[WebhookCounter]:
    """An ``http.server`` in a thread on a free port of 127.0.0.1 (the drill fleet's webhook
    allowlist) that answers 200 to every POST and counts them by job id, until the block ends."""
    counter: WebhookCounter

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
            try:
                job_id = str(json.loads(body).get("id"))
            except (ValueError, AttributeError):
                job_id = "?"
            with counter.guard:
                counter.received[job_id] += 1
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *_args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    counter = WebhookCounter(f"http://127.0.0.1:{server.server_address[1]}/hook")
    thread = threading.Thread(target=server.serve_forever, name="drill-webhooks", daemon=True)
    thread.start()
    try:
        yield counter
    finally:
        server.shutdown()
        server.server_close()


STANDBY_REPEATS = 10  # leader kills of ``homefleet drill standby_server`` (docs/operations.md, "Fault drills")


def drill_standby_server(fleet: DrillFleet, count: int, repeats: int = STANDBY_REPEATS) -> DrillResult:
    """Two ``homefleet serve`` on one PostgreSQL journal and one Redis (docs/operations.md, "A
    standby server"; the fleet must be started with ``standby=True``): ``count`` submissions, each
    with a webhook, from 4 threads over both servers, each retried with its own Idempotency-Key on
    the other server when one fails (R20), while the CURRENT leader (whichever server leads) is
    SIGKILLed and started again, ``repeats`` times. The burst is cut in ``repeats + 1`` slices:
    slice ``r`` is released at kill ``r``, and kill ``r + 1`` comes when half of slice ``r`` is
    accepted (and the killed server is back), so every kill lands amid submissions.

    Figures: ``accepted`` (202s), ``duplicates`` (Idempotency-Keys with more than one job; target
    0), ``repeats``, ``handover_ms`` and ``handover_median_ms`` (max and median over the repeats,
    from the kill until the other server leads; bound: ``leader_poll_s`` plus the moments
    PostgreSQL takes to end the killed session; -1 when one never did), ``leaders`` (servers that
    lead at the end; target 1), ``errors_500`` (5xx other than 503; target 0), ``refused_4xx``,
    ``webhooks_twice`` (jobs whose webhook was received more than once; target 0),
    ``webhooks_missing`` (jobs ended without a webhook received after a grace; target 0)."""
    fleet.begin()
    assert fleet.local is not None
    local = fleet.local
    ports = {"api": local.settings.api_port, "api-b": fleet.standby_port}
    logs = {name: local.logs_dir / f"{name}.log" for name in ports}
    since = {"api": 0, "api-b": logs["api-b"].stat().st_size if logs["api-b"].exists() else 0}
    local.start_api(name="api-b", port=ports["api-b"])
    urls = [f"http://{local.settings.api_host}:{port}" for port in ports.values()]
    deadline = time.monotonic() + 30
    while not _leads_since(logs["api"], 0) and time.monotonic() < deadline:
        time.sleep(0.1)  # the first server leads (it started first)
    jobs_by_key: dict[str, set[str]] = {}
    errors: list[int] = []
    guard = threading.Lock()
    slices = repeats + 1
    released = [threading.Event() for _ in range(slices)]
    released[0].set()
    stop = threading.Event()

    def slice_of(i: int) -> int:
        return i * slices // count

    with webhook_counter() as hooks:

        def submitter(worker_index: int) -> None:
            clients = [HomefleetClient(url, timeout_s=10, api_key=DRILL_API_KEY) for url in urls]
            try:
                for i in range(worker_index, count, 4):
                    while not released[slice_of(i)].wait(0.2):
                        if stop.is_set():
                            return
                    key = f"drill-standby-{time.time_ns()}-{i}"
                    body = {"prompt": f"standby {i}", "steps": 1}
                    attempt = i  # alternate servers; a failed attempt goes to the other one with the same key
                    give_up = time.monotonic() + 120
                    while time.monotonic() < give_up:
                        try:
                            job = clients[attempt % 2].submit(
                                MODEL,
                                "txt2img",
                                body,
                                target=WORKERS[i % 2],
                                idempotency_key=key,
                                webhook_url=hooks.url,
                            )
                        except (httpx.HTTPError, ApiError) as error:
                            if isinstance(error, ApiError) and error.status_code not in (429, 503):
                                with guard:
                                    errors.append(error.status_code)
                                return
                            attempt += 1
                            time.sleep(0.1)
                            continue
                        with guard:
                            jobs_by_key.setdefault(key, set()).add(str(job["id"]))
                        break
            finally:
                for client in clients:
                    client.close()

        def accepted_in(slice_index: int) -> int:
            with guard:
                return sum(1 for key in jobs_by_key if slice_of(int(key.rsplit("-", 1)[1])) == slice_index)

        threads = [threading.Thread(target=submitter, args=(n,)) for n in range(4)]
        for thread in threads:
            thread.start()
        handovers: list[float] = []
        try:
            for repeat in range(repeats):
                size = sum(1 for i in range(count) if slice_of(i) == repeat)
                while accepted_in(repeat) < (size + 1) // 2 and any(t.is_alive() for t in threads):
                    time.sleep(0.01)
                leader = next((n for n in ports if _leads_since(logs[n], since[n])), "api")
                other = "api-b" if leader == "api" else "api"
                stop_process_group(local.processes.pop(leader), signal.SIGKILL)
                killed_at = time.monotonic()
                released[repeat + 1].set()  # the next slice goes out while the leader is down
                handover_s = float("inf")
                while time.monotonic() - killed_at < 60:
                    if _leads_since(logs[other], since[other]):
                        handover_s = time.monotonic() - killed_at
                        break
                    time.sleep(0.02)
                handovers.append(handover_s)
                since[leader] = logs[leader].stat().st_size
                local.start_api(name=leader, port=ports[leader])  # the old leader comes back: as a standby
        finally:
            for event in released:
                event.set()
            stop.set()
            for thread in threads:
                thread.join()
        acknowledged = set().union(*jobs_by_key.values()) if jobs_by_key else set()
        result = fleet.result("standby_server", acknowledged, timeout_s=60 + 10 * count)
        grace = time.monotonic() + 30  # the webhook loop polls every webhook_poll_s; a retry pauses 0.2 s
        while time.monotonic() < grace and any(hooks.counts()[i] == 0 for i in acknowledged):
            time.sleep(0.25)
        time.sleep(2)  # several of the restarted server's polls: it must not lead; a second POST would show
        received = hooks.counts()
    leaders = sum(int(_leads_since(logs[name], since[name])) for name in ports)
    finite = [h for h in handovers if h != float("inf")]
    return replace(
        result,
        figures={
            "accepted": len(acknowledged),
            "duplicates": sum(1 for ids in jobs_by_key.values() if len(ids) > 1),
            "repeats": repeats,
            "handover_ms": int(max(handovers) * 1000) if handovers and len(finite) == len(handovers) else -1,
            "handover_median_ms": int(statistics.median(finite) * 1000) if finite else -1,
            "leaders": leaders,
            "errors_500": sum(1 for code in errors if code >= 500),
            "refused_4xx": sum(1 for code in errors if code < 500),
            "webhooks_twice": sum(1 for i in acknowledged if received[i] > 1),
            "webhooks_missing": sum(1 for i in acknowledged if received[i] == 0),
        },
    )


DRILLS: dict[str, Callable[[DrillFleet, int], DrillResult]] = {
    "duplicate": drill_duplicate,
    "worker_kill": drill_worker_kill,
    "server_kill": drill_server_kill,
    "redis_restart": drill_redis_restart,
    "redis_loss_requeue": drill_redis_loss_requeue,
    "redis_loss_backlogs": drill_redis_loss_backlogs,
    "visibility": drill_visibility,
    "hang": drill_hang,
    "sentinel_failover": drill_sentinel_failover,
    "standby_server": drill_standby_server,
}

# Drills that need a fleet with other settings than the defaults.
FLEET_OPTIONS: dict[str, dict[str, Any]] = {
    "visibility": {"visibility_timeout_s": 2},
    "hang": {"hung_after_s": 20},
    "sentinel_failover": {"sentinel": True, "workers": SENTINEL_WORKERS},
    "standby_server": {"standby": True},
}


UNDECODABLE: tuple[bytes, ...] = (
    b"not json {",  # celery/celery#4308: kombu's loads of the popped item raises
    json.dumps(
        {
            "body": "!!! not base64",
            "content-encoding": "utf-8",
            "content-type": "application/json",
            "headers": {},
            "properties": {
                "body_encoding": "base64",
                "delivery_tag": "dead-letter-drill",
                "delivery_info": {"exchange": "", "routing_key": ""},
                "priority": 0,
            },
        }
    ).encode(),  # celery/kombu#2421: the body does not decode
    b"[1, 2, 3]",  # JSON, but no kombu message
    b'{"properties": {}}',  # a message without a delivery tag
    b"\xff\xfe not UTF-8 \x80",
)
"""What ``dead_letter_drill`` pushes onto a machine's queue ahead of a real job."""


@dataclass(frozen=True)
class DeadLetterDrill:
    """The dead-letter drill's figures: messages pushed, dead letters found, the real job's end."""

    machine: str
    pushed: tuple[bytes, ...]
    dead_letters: int
    job_id: str
    job_state: str
    seconds: float

    def line(self) -> str:
        return (
            f"drill=dead_letter machine={self.machine} pushed={len(self.pushed)} "
            f"dead_letters={self.dead_letters} job={self.job_state} seconds={self.seconds:.1f}"
        )


def dead_letter_drill(
    ctx: ServerContext, client: HomefleetClient, machine: str, model: str = MODEL, timeout_s: float = 180.0
) -> DeadLetterDrill:
    """Push :data:`UNDECODABLE` onto ``machine``'s queue (``LPUSH``, as an attacker with Redis
    access would), then submit a real txt2img job there and wait for it to end.
    A worker that survives moves each message to the dead-letter list and runs the job."""
    start_s = time.monotonic()
    before = int(ctx.redis.llen(ctx.keys.dead_letters()))
    for raw in UNDECODABLE:
        ctx.redis.lpush(ctx.keys.queue_list(machine), raw)
    job_id = client.submit(
        model, "txt2img", {"prompt": "dead letters", "steps": 2, "width": 64, "height": 64}, target=machine
    )["id"]
    job = client.wait(job_id, timeout_s=timeout_s)
    return DeadLetterDrill(
        machine=machine,
        pushed=UNDECODABLE,
        dead_letters=int(ctx.redis.llen(ctx.keys.dead_letters())) - before,
        job_id=job_id,
        job_state=str(job["state"]),
        seconds=time.monotonic() - start_s,
    )
