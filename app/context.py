"""The server's parts, wired once from :class:`Settings` in an entry point."""

from __future__ import annotations

from dataclasses import dataclass

import redis
from celery import Celery
from sqlalchemy.engine import Engine

from app.core.celery_app import create_celery
from app.core.config import Settings
from app.core.connections import create_engine, create_redis
from app.fleet.costs import ChangeMark
from app.jobs.dispatch import Dispatcher
from app.fleet.config import Fleet, load_fleet
from app.store.inputs import InputStore
from app.journal.jobs import Journal
from app.core.keys import Keys
from app.fleet.machines import MachineStates
from app.metrics import Metrics
from app.fleet.queues import MachineQueues
from app.store.registry import Registry
from app.fleet.residency_store import DurableResidencyFacts, ResidencyStore
from app.store.files import ResultStore


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
    machines: MachineStates
    queues: MachineQueues
    dispatcher: Dispatcher
    metrics: Metrics
    inputs: InputStore
    residency: DurableResidencyFacts  # commitments (R16) and remembered OOMs (R21): Redis + database

    def close(self) -> None:
        self.redis.close()
        self.engine.dispose()


def build_context(settings: Settings, fleet: Fleet | None = None) -> ServerContext:
    """Wire the server's parts. ``fleet`` defaults to ``settings.fleet_file`` (or the embedded fleet)."""
    fleet = fleet or load_fleet(settings.fleet_file)
    engine = create_engine(settings)
    client = create_redis(settings)
    celery = create_celery(settings)
    keyspace = Keys(settings.key_prefix)
    journal = Journal(engine)
    registry = Registry(engine, settings.models_dir,  # each registration tells every process's FleetCosts
                        on_change=ChangeMark(client, keyspace.registry_changed()).touch)
    store = ResultStore(settings.results_dir, settings.max_result_bytes)
    residency = DurableResidencyFacts(client, keyspace, ResidencyStore(engine), fleet)
    machines = MachineStates(client, keyspace, fleet, journal, residency)
    queues = MachineQueues(client)
    inputs = InputStore(settings.inputs_dir, settings.max_input_bytes)
    dispatcher = Dispatcher(settings, client, celery, journal, registry, machines, queues, inputs)
    metrics = Metrics()
    metrics.watch_fleet(machines, registry)
    dispatcher.metrics = metrics
    return ServerContext(settings, fleet, engine, client, celery, keyspace, journal, registry, store, machines, queues,
                         dispatcher, metrics, inputs, residency)


def build_checked_context(settings: Settings) -> ServerContext:
    """:func:`build_context` for a CLI command that reads or changes the fleet: first checks
    that the Redis runs with this journal, without recording it (app/fleet/pairing.py), when Redis
    answers.

    Raises:
        ConfigError: the Redis runs with another journal (``journal_mismatch``).
    """
    from app.fleet.pairing import check_pairing  # app.fleet.pairing imports app.core.connections only

    ctx = build_context(settings)
    try:
        check_pairing(ctx, record=False)
    except redis.ConnectionError:
        pass  # nothing to check against; a command that needs Redis says so when it uses it
    except BaseException:
        ctx.close()
        raise
    return ctx
