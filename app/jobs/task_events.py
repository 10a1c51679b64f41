"""Celery task events for the jobs the server ends itself, so that Flower's task states agree
with the journal.

Flower knows a task only from Celery's task events (``task-received``, ``task-started``,
``task-succeeded``, ``task-failed``, ``task-revoked``). A worker sends them for what its task
does: ``SUCCESS`` when the job succeeded, ``FAILURE`` when its own report failed it
(``tasks/run_job.py``), ``REVOKED`` when Celery terminated it. The ends the server makes
itself reach no task, so the server sends their event here, under the name of the machine's
worker (``Keys.node``), so Flower counts it on that worker:

=============  =============  =====================================================
journal        event          made by
=============  =============  =====================================================
``cancelled``  task-revoked   ``POST /v1/jobs/{id}/cancel``, a revoke of a queued job
``interrupted``  task-failed  reconciliation (``worker_lost``, ``lost``, ``hung``...),
                              a model the server cannot hand out at claim
``failed``     task-failed    (only when the server fails a job no task reports on)
=============  =============  =====================================================

Best effort: Flower is a view; an event that cannot be sent is logged, the journal stays
the truth.
"""

from __future__ import annotations

import logging
import socket

import redis
from celery import Celery
from kombu.exceptions import KombuError, OperationalError

from app.core.keys import Keys
from app.core.states import JobState
from app.db.tables import Job

log = logging.getLogger(__name__)


class TaskEvents:
    """Sends the task event of a job's end (see the module docstring). ``celery``: the server's
    app (its broker, its event settings); ``client``/``keys``: where the workers record their
    Celery node names."""

    def __init__(self, celery: Celery, client: redis.Redis, keys: Keys) -> None:
        self.celery = celery
        self.redis = client
        self.keys = keys

    def node(self, machine: str) -> str:
        """The Celery node name of ``machine``'s worker (``<machine>@<host>``), as its last
        start recorded it; ``<machine>@<this host>`` when none ever started."""
        try:
            recorded = self.redis.get(self.keys.node(machine))
        except redis.RedisError:
            recorded = None
        return str(recorded) if recorded else f"{machine}@{socket.gethostname()}"

    def ended(self, job: Job) -> None:
        """Send the task event of ``job``'s end: ``task-revoked`` for ``cancelled``,
        ``task-failed`` (with ``<state>: <reason>: <message>`` as its exception) for
        ``interrupted`` and ``failed``; nothing for other states. Never raises for a broker
        error (logged)."""
        fields: dict[str, object]
        if job.state == JobState.cancelled:
            kind, fields = "task-revoked", {"terminated": False, "signum": None, "expired": False}
        elif job.state in (JobState.interrupted, JobState.failed):
            kind, fields = "task-failed", {"exception": f"{job.state}: {job.reason}: {job.message}", "traceback": ""}
        else:
            return
        node = self.node(job.machine or "")
        try:
            with self.celery.events.default_dispatcher(hostname=node) as dispatcher:
                dispatcher.send(kind, uuid=job.id, **fields)
        except (KombuError, OperationalError, OSError, redis.RedisError) as error:
            log.warning("job %s: the %s event for Flower was not sent: %s", job.id, kind, error)
