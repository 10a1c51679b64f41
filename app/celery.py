"""The fleet's Celery app for the celery CLI and Flower, built from ``HOMEFLEET_*`` settings
when the CLI asks for it (never at import)::

    celery -A app.celery inspect active
    celery -A app.celery inspect reserved
    celery -A app.celery purge -Q machine.box1
    celery -A app.celery flower
"""

from __future__ import annotations

import functools

from celery import Celery

from app.core.celery_app import create_celery
from app.core.config import BrokerSettings
from app.core.dead_letters import TRANSPORT_ALIAS


@functools.cache
def _fleet_app() -> Celery:
    # The celery CLI and Flower consume no machine queue, so they use kombu's own Redis transport
    # rather than the workers' dead-lettering one (app/core/dead_letters.py): its URL scheme
    # (redis://, redis+socket://) is one Flower knows for its queue lengths; `hfredis` it answers
    # with 404 "broker is not supported". Same Redis, same transport options (the broker key prefix).
    app = create_celery(BrokerSettings())
    app.conf.broker_transport = None
    app.conf.broker_url = str(app.conf.broker_url).replace(f"{TRANSPORT_ALIAS}+socket://", "redis+socket://", 1)
    return app


def __getattr__(name: str) -> Celery:
    # Celery's CLI looks for ``app`` then ``celery`` in the module given to -A.
    if name in ("app", "celery"):
        return _fleet_app()
    raise AttributeError(name)
