"""The server's composition root: :func:`build_context` wires every server part from
:class:`Settings`, once, in an entry point (``homefleet serve`` and the other commands, the
demo, the drills, the tests). Nothing else builds services; each gets the collaborators it
uses, not this context.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import redis
from celery import Celery
from sqlalchemy.engine import Engine

from app.core.celery_app import create_celery
from app.core.config import Settings
from app.core.connections import create_redis
from app.core.errors import ConfigError
from app.core.keys import Keys
from app.db.engine import check_journal_file, check_revision, create_engine
from app.db.tables import Job
from app.fleet import live
from app.fleet.config import Fleet, load_fleet
from app.fleet.costs import ChangeMark, DemandStore, FleetCosts
from app.fleet.drains import Drains
from app.fleet.lock import FleetLock
from app.fleet.machines import MachineStates
from app.fleet.pairing import Pairing
from app.fleet.queues import MachineQueues
from app.fleet.residency_store import DurableResidencyFacts, ResidencyStore
from app.fleet.status import fleet_status
from app.jobs.calls import CallRecords
from app.jobs.dispatch import Dispatcher
from app.jobs.endings import Changes, Endings
from app.jobs.progress import ProgressStore
from app.jobs.reconcile import Reconciler
from app.jobs.sync import Syncs
from app.jobs.task_events import TaskEvents
from app.jobs.validation import Validator, check_model_defaults
from app.jobs.waiting import Waiting
from app.journal.jobs import Journal
from app.journal.timings import TimingStore
from app.journal.webhooks import WebhookOutbox
from app.metrics import Metrics
from app.store.files import InputStore, ResultStore
from app.store.registry import Registry

if TYPE_CHECKING:  # the webhook loop (and httpx) is loaded by the server only, not by every CLI command
    from app.jobs.webhooks import WebhookLoop


@dataclass
class ServerContext:
    settings: Settings
    fleet: Fleet
    engine: Engine
    redis: redis.Redis
    celery: Celery
    keys: Keys
    journal: Journal
    registry: Registry
    store: ResultStore
    inputs: InputStore
    machines: MachineStates
    queues: MachineQueues
    lock: FleetLock  # the fleet lock (R14), fenced (C04)
    progress: ProgressStore  # running jobs' per-step progress
    residency: DurableResidencyFacts  # commitments (R16) and remembered OOMs (R21): Redis + database
    drains: Drains  # drained machines: Redis + database (app/fleet/drains.py)
    pairing: Pairing  # the journal and its Redis are one pair (R19)
    dispatcher: Dispatcher
    metrics: Metrics
    calls: CallRecords  # the image routes' calls, so a client's retry gets the first call's jobs (C10)
    outbox: WebhookOutbox  # the ended jobs' webhook deliveries
    endings: Endings  # every claim and end of a job (app/jobs/endings.py)
    waiting: Waiting  # waiting for a job's changes without polling (app/jobs/waiting.py)
    # Set by the journal when a transition writes a webhook delivery: the delivery loop wakes up.
    webhook_wakeup: threading.Event = field(default_factory=threading.Event)

    @property
    def timings(self) -> TimingStore:
        """The learned timings in the journal (R13), as placement and the endings use them."""
        return self.endings.timings

    def close(self) -> None:
        self.waiting.close()
        self.redis.close()
        self.engine.dispose()

    def reconciler(self, server: bool = True) -> Reconciler:
        """Reconciliation passes over this server's parts (R19); ``server``: see :class:`Reconciler`."""
        return Reconciler(
            self.settings,
            self.redis,
            self.keys,
            self.journal,
            self.machines,
            self.queues,
            self.residency,
            self.progress,
            self.lock,
            self.pairing,
            server,
            self.endings,
            self.drains,
        )

    def webhook_loop(self, render: Callable[[Job], bytes], leads: Callable[[], bool] = lambda: True) -> WebhookLoop:
        """The webhook delivery loop over this server's journal (app/jobs/webhooks.py);
        ``render``: a job's record as the body's bytes; it delivers only while ``leads()``."""
        from app.jobs.webhooks import WebhookLoop, WebhookSender

        sender = WebhookSender(self.settings, self.journal, self.outbox, render, metrics=self.metrics)
        return WebhookLoop(sender, self.outbox, self.settings, self.webhook_wakeup, leads=leads)

    def status(self) -> list[dict[str, Any]]:
        """``homefleet status``'s rows (app/fleet/status.py)."""
        return fleet_status(self.machines, self.journal, self.dispatcher.costs)

    def stranded_by(self, fleet: Fleet) -> str | None:
        """Why the running server may not take ``fleet`` (a machine it drops still has jobs
        queued or running, which would be stranded), or None when it may."""
        for name in sorted(set(self.fleet.machines) - set(fleet.machines)):
            backlog = self.machines.view(name).backlog
            if backlog:
                return (
                    f"machine {name!r} is removed but has {backlog} jobs queued or running; drain it first "
                    f"(`homefleet machines remove {self.fleet.machines[name].host_name}` waits for them)"
                )
        return None

    def apply_fleet(self, fleet: Fleet) -> None:
        """Make ``fleet`` the running server's fleet (docs/operations.md, "Add a machine"): its
        machines, tokens, working-memory coefficients, timing guesses and webhook hosts, in
        every part that holds them, under the fleet lock so no placement sees half of it.

        Raises:
            PlacementLost: the fleet lock was not free within ``fleet_lock_wait_s``.
        """
        with self.lock.held("reload the fleet file again"):
            self.dispatcher.costs.use_fleet(fleet)
            self.dispatcher.validator.models = fleet.models
            self.dispatcher.speed = {name: machine.speed for name, machine in fleet.machines.items()}
            self.residency.fleet = fleet
            self.machines.fleet = fleet
            self.fleet = fleet

    def syncs(self) -> Syncs:
        """Starting and following syncs (R6) over this server's parts."""
        return Syncs(
            self.settings, self.redis, self.celery, self.fleet, self.journal, self.registry, self.machines, self.lock
        )


def build_context(settings: Settings, fleet: Fleet | None = None, *, migrate: bool = False) -> ServerContext:
    """Wire the server's parts. ``fleet`` defaults to ``settings.fleet_file`` (or the embedded fleet).

    ``migrate``: bring the journal's schema to the newest revision first (``homefleet serve``,
    ``homefleet db upgrade``, the demo and the drills, which run a server of their own);
    otherwise the journal must already be at it.

    Raises:
        ConfigError: without ``migrate``, a journal not at the newest revision (reason
            ``journal_outdated``, naming ``homefleet db upgrade``).
    """
    fleet = fleet or load_fleet(settings.fleet_file)
    if not migrate:
        check_journal_file(settings)  # creates nothing where no journal is
    engine = create_engine(settings)
    try:
        if migrate:
            from app.db.migrations import upgrade

            upgrade(engine)
        else:
            check_revision(engine)
    except BaseException:
        engine.dispose()
        raise
    client = create_redis(settings)
    keyspace = Keys(settings.key_prefix, settings.broker_key_prefix)
    wakeup = threading.Event()
    journal = Journal(engine, on_delivery=wakeup.set)
    registry = Registry(
        engine,
        settings.models_dir,  # each registration tells every process's FleetCosts
        on_change=ChangeMark(client, keyspace.registry_changed()).touch,
        check_defaults_limits=functools.partial(check_model_defaults, settings.limits),
        change_mark=functools.partial(client.get, keyspace.registry_changed()),
    )
    inputs = InputStore(settings.inputs_dir, settings.max_input_bytes)
    residency = DurableResidencyFacts(client, keyspace, ResidencyStore(engine), fleet)
    machines = MachineStates(client, keyspace, fleet, journal, residency)
    metrics = Metrics()
    lock = FleetLock(
        client,
        keyspace,
        settings.fleet_lock_ttl_s,
        settings.fleet_lock_wait_s,
        observe=metrics.fleet_lock_hold_s.observe,
    )
    timings_mark = ChangeMark(client, keyspace.timings_changed())
    timings = TimingStore(engine, on_change=timings_mark.touch)
    validator = Validator(registry, inputs, settings.limits, fleet.models)
    costs = FleetCosts(
        fleet,
        registry,
        timings,
        ChangeMark(client, keyspace.registry_changed()),
        timings_mark,
        max_total_tokens=lambda model_id: validator.token_limits(model_id).max_total_tokens,
    )
    metrics.watch_fleet(machines, registry)
    celery = create_celery(settings)
    queues = MachineQueues(client, keyspace, celery)
    progress = ProgressStore(client, keyspace)
    store = ResultStore(settings.results_dir, settings.max_result_bytes)
    endings = Endings(
        journal,
        machines.reservations,
        timings,
        costs.estimator,
        metrics,
        TaskEvents(celery, client, keyspace),
        Changes(client, keyspace),
        progress,
        store,
    )
    dispatcher = Dispatcher(
        settings,
        celery,
        journal,
        machines,
        queues,
        validator,
        costs,
        timings,
        DemandStore(client, keyspace),
        lock,
        metrics,
        events=endings.events,
        endings=endings,
    )
    return ServerContext(
        settings=settings,
        fleet=fleet,
        engine=engine,
        redis=client,
        celery=celery,
        keys=keyspace,
        journal=journal,
        registry=registry,
        store=store,
        inputs=inputs,
        machines=machines,
        queues=queues,
        lock=lock,
        progress=progress,
        residency=residency,
        drains=Drains(client, keyspace, engine),
        pairing=Pairing(client, keyspace, engine, settings),
        dispatcher=dispatcher,
        metrics=metrics,
        calls=CallRecords(client, keyspace, settings.sdk_retry_window_s, settings.idempotency_ttl_s),
        outbox=WebhookOutbox(engine),
        webhook_wakeup=wakeup,
        endings=endings,
        waiting=Waiting(settings, keyspace, journal, progress, retry_after_s=settings.retry_after_s),
    )


def build_checked_context(settings: Settings) -> ServerContext:
    """:func:`build_context` for a CLI command that reads or changes the fleet: the journal must
    be at the newest revision, and the Redis must run with this journal (checked without
    recording it, app/fleet/pairing.py), when Redis answers.

    Raises:
        ConfigError: the journal is not at the newest revision (``journal_outdated``), the
            Redis runs with another journal (``journal_mismatch``), or the fleet file is not
            valid (``invalid_config``, saying what the running server did with it,
            :func:`app.fleet.live.running_fleet_note`), or ``HOMEFLEET_FLEET_FILE`` is not set
            while the server on this Redis runs a fleet file (``fleet_file_not_set``,
            :func:`app.fleet.live.fleet_file_refusal`).
    """
    try:
        fleet = load_fleet(settings.fleet_file)
    except (ConfigError, ValueError) as error:  # the running server may have refused this very file
        if settings.fleet_file is None:
            raise
        client = create_redis(settings)
        note = live.running_fleet_note(client, Keys(settings.key_prefix), settings.fleet_file)
        client.close()
        if isinstance(error, ConfigError):
            raise ConfigError(error.message + note, reason=error.reason) from error
        if note:  # pydantic's error, which the CLI words itself: the note rides along
            error.add_note(note.removeprefix("; "))
        raise
    ctx = build_context(settings, fleet)
    try:
        refusal = None if settings.fleet_file is not None else live.fleet_file_refusal(ctx.redis, ctx.keys)
        if refusal is not None:
            raise ConfigError(refusal, reason="fleet_file_not_set")
        ctx.pairing.check(record=False)
    except redis.ConnectionError:
        pass  # nothing to check against; a command that needs Redis says so when it uses it
    except BaseException:
        ctx.close()
        raise
    return ctx
