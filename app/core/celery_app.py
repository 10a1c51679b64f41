"""The Celery app, configured for strict per-machine FIFO and at-most-once.

Every setting below is one that held up in docs/design.md, "Devices and queues": prefork with
concurrency 1, prefetch disabled (the worker holds only the job it runs; the rest stay in
the Redis list, in order), early ack, JSON only, no priorities/ETA/retries, a default
queue that no worker reads, and the same visibility timeout and broker key prefix (kombu's
``global_keyprefix``) in every process. The transport is kombu's Redis transport with
undecodable messages moved aside (app/core/dead_letters.py).
"""

from __future__ import annotations

from typing import Any

from celery import Celery

from app.core.config import BrokerSettings
from app.core.connections import SOCKET_TIMEOUT_S, broker_url, is_sentinel_url, sentinel_options
from app.core.dead_letters import SENTINEL_TRANSPORT_ALIAS, TRANSPORT_ALIAS
from app.core.keys import Keys

RUN_JOB_TASK = "homefleet.run_job"
SYNC_TASK = "homefleet.sync"  # R6: published to machine.<name>, so it waits its turn like a job (app/jobs/sync.py)
UNROUTED_QUEUE = "homefleet.unrouted"  # no worker reads it: a message without a machine goes nowhere


def create_celery(settings: BrokerSettings, consumer: bool = False) -> Celery:
    """A Celery app bound to ``settings.redis_url``. Connects lazily, on first publish.

    ``consumer``: the app of a worker, which pops messages from its queue: on kombu's Redis
    transport with undecodable messages moved aside (app/core/dead_letters.py). Every other
    process (the server, the CLI, Flower: Flower's queue lengths know kombu's own transport
    names only) publishes, inspects or listens to events on kombu's own Redis transport, with
    the same keys."""
    transport_name = TRANSPORT_ALIAS if consumer else "redis"
    app = Celery("homefleet", broker=broker_url(settings.redis_url, transport_name), set_as_current=False)
    transport: dict[str, Any] = {
        "dead_letter_key": Keys(settings.key_prefix).dead_letters(),  # undecodable messages
        "visibility_timeout": settings.visibility_timeout_s,
        "socket_timeout": SOCKET_TIMEOUT_S,
        "socket_connect_timeout": SOCKET_TIMEOUT_S,
        # Every broker key under settings.broker_key_prefix: publishers, workers, the celery CLI and
        # Flower (which reads broker_transport_options for its queue lengths) all see the same keys.
        "global_keyprefix": settings.broker_key_prefix,
    }
    sentinel = is_sentinel_url(settings.redis_url)
    if sentinel:
        # kombu's Sentinel transport: the master by name, and the Sentinels' own socket timeouts, which
        # kombu does not take from the options above (celery#7997). No result backend to configure
        # alike: every task ignores its result (task_ignore_result below).
        transport |= {"master_name": settings.redis_sentinel_master, "sentinel_kwargs": sentinel_options()}
    if consumer and sentinel:
        consumer_transport: str | None = SENTINEL_TRANSPORT_ALIAS
    elif consumer and settings.redis_url.startswith("redis://"):
        consumer_transport = TRANSPORT_ALIAS
    else:
        consumer_transport = None
    app.conf.update(
        task_acks_late=False,
        task_ignore_result=True,
        worker_prefetch_multiplier=1,
        worker_disable_prefetch=True,
        worker_concurrency=1,
        worker_pool="prefork",
        worker_send_task_events=True,
        task_send_sent_event=True,
        task_create_missing_queues=True,
        task_default_queue=UNROUTED_QUEUE,
        accept_content=["json"],
        task_serializer="json",
        result_accept_content=["json"],
        result_serializer="json",
        event_serializer="json",
        broker_transport_options=transport,
        # A worker: kombu's Redis transport, moving undecodable messages aside (app/core/dead_letters.py);
        # a unix-socket URL names it itself (hfredis+socket://), rediss:// keeps kombu's own TLS setup
        broker_transport=consumer_transport,
        broker_connection_retry_on_startup=True,
        # a worker whose broker went away (a master lost before Sentinel promotes its replica: celery#6348)
        # reconnects for as long as it takes, never exits: None is "retry for ever"
        broker_connection_retry=True,
        broker_connection_max_retries=None,
        worker_hijack_root_logger=False,
        task_publish_retry=True,
        task_publish_retry_policy={"max_retries": 3, "interval_start": 0.2, "interval_step": 0.5, "interval_max": 2},
        enable_utc=True,
    )
    return app
