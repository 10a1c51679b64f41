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


@functools.cache
def _fleet_app() -> Celery:
    return create_celery(BrokerSettings())


def __getattr__(name: str) -> Celery:
    # Celery's CLI looks for ``app`` then ``celery`` in the module given to -A.
    if name in ("app", "celery"):
        return _fleet_app()
    raise AttributeError(name)
