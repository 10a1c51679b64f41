"""Raw Celery's baseline for ``bench/latency.py``: a no-op task on Homefleet's own Celery
configuration (prefork, concurrency 1, prefetch disabled, early ack, JSON), whose body pushes
its start time (Unix seconds) to a Redis list. The worker runs as
``celery -A bench.celery_noop worker -Q bench.noop`` with ``HOMEFLEET_REDIS_URL`` set.
"""

from __future__ import annotations

import time

import redis

from app.core.celery_app import create_celery
from app.core.config import BrokerSettings

NOOP_TASK = "bench.noop"
NOOP_QUEUE = "bench.noop"
STARTS_KEY = "bench:noop:starts"  # the list the task body pushes ``"<token> <unix_s>"`` to

settings = BrokerSettings()
app = create_celery(settings)
_redis: redis.Redis | None = None


@app.task(name=NOOP_TASK)
def noop(token: str) -> None:
    """Push ``"<token> <start Unix seconds>"`` to :data:`STARTS_KEY`; nothing else."""
    started = time.time()
    global _redis
    if _redis is None:
        _redis = redis.Redis.from_url(settings.redis_url)
    _redis.rpush(STARTS_KEY, f"{token} {started!r}")
