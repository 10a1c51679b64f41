"""Which of several ``homefleet serve`` processes on one PostgreSQL journal leads
(docs/operations.md, "A standby server"): the one holding PostgreSQL's session-level advisory
lock :data:`LEADER_LOCK`. Every server answers the API; only the leader runs reconciliation
(R19) and delivers webhooks. The lock is PostgreSQL's: it is released when the holder's session
ends, so a killed leader's lock is free as soon as PostgreSQL sees its connection closed, and a
standby takes it at its next try (every ``leader_poll_s``).

Fencing: a leader whose connection to PostgreSQL fails stops leading at once (its lock may be
gone). Between that failure and its next check (at most ``leader_poll_s``), a pass that had
started still runs; it cannot overlap another leader's: a reconciliation pass holds the fleet
lock (app/fleet/lock.py, fenced) and a webhook delivery its lease in the journal
(app/jobs/webhooks.py).
"""

from __future__ import annotations

import logging
import threading

from sqlalchemy import text
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import SQLAlchemyError

log = logging.getLogger(__name__)

LEADER_LOCK = 0x686F6D65666C6565  # pg_advisory_lock's bigint key: "homeflee" in ASCII
MIGRATION_LOCK = LEADER_LOCK + 1  # pg_advisory_xact_lock's, held while migrating (app/db/migrations)


class Leadership:
    """``leads()`` is True in the one server holding :data:`LEADER_LOCK`; with ``enabled``
    False (one server: the default) it is always True and nothing connects. A daemon thread from
    :meth:`start` to :meth:`stop` tries the lock, or checks its session, every ``poll_s`` seconds."""

    def __init__(self, engine: Engine, poll_s: float, enabled: bool) -> None:
        self.engine = engine
        self.poll_s = poll_s
        self.enabled = enabled
        self._leading = not enabled
        self._connection: Connection | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="homefleet-leadership", daemon=True)

    def leads(self) -> bool:
        """True while this server leads (holds the lock, its session checked within ``poll_s``)."""
        return self._leading

    def start(self) -> None:
        if self.enabled:
            if not self.try_once():  # a server that can lead at once does so before it answers
                log.warning("this server stands by: another leads; it takes the lead when that one's session ends")
            self._thread.start()

    def stop(self) -> None:
        """Stop trying; release the lock (ending the session) so that a standby takes it at once."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self.poll_s + 10)
        self._drop()

    def try_once(self) -> bool:
        """Take the lock, or check that the session holding it lives; return :meth:`leads`."""
        try:
            if self._connection is None:
                self._connection = self.engine.connect().execution_options(isolation_level="AUTOCOMMIT")
            if self._leading:
                self._connection.execute(text("SELECT 1"))  # the session lives: the lock is still ours
            elif self._connection.execute(text("SELECT pg_try_advisory_lock(:key)"), {"key": LEADER_LOCK}).scalar():
                self._leading = True
                log.warning("this server leads: reconciliation and webhooks run here")
        except SQLAlchemyError as error:
            if self._leading:
                log.error("this server no longer leads: its journal session failed (%s)", error)
            self._drop()
        return self._leading

    def _drop(self) -> None:
        self._leading = False
        connection, self._connection = self._connection, None
        if connection is not None:
            try:
                connection.close()
            except SQLAlchemyError:
                connection.invalidate()

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            self.try_once()
