"""Waiting for a job without polling the journal: :meth:`Waiting.until_ended` (a request that
answers once its job has ended: the image and text routes, a prompt's expansion) and
:meth:`Waiting.follow` (its changes as they happen: the event stream, a streamed completion).

Every claim and end of a job is published on ``Keys.job_changes`` (app/jobs/endings.py), and
every progress report too (app/jobs/progress.py), by whichever process made it. One listener
thread per server process subscribes to that channel (one Redis connection, whatever the number
of waiters) and wakes the waiters of the job named, each in its own event loop. A waiter reads
the journal when woken, and otherwise only every :data:`RECHECK_S` seconds: a safety re-read
for a message missed (Redis restarted, the listener reconnecting, a change published by an
older process).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field

import redis
from anyio import to_thread

from app.core.config import BrokerSettings
from app.core.connections import RedisOutageLog, create_redis
from app.core.errors import ServerStopping
from app.core.keys import Keys
from app.core.states import ENDED
from app.db.tables import Job
from app.jobs.progress import Progress, ProgressStore
from app.journal.jobs import Journal

log = logging.getLogger(__name__)

RECHECK_S = 3.0  # the safety re-read of the journal while nothing was heard (seconds)
READY_S = 5.0  # how long a first waiter waits for the listener's subscription before relying on re-reads
LISTEN_S = 1.0  # the listener's read timeout: how soon it sees close()


@dataclass(eq=False)
class _Watch:
    """One waiter: its loop and event; ``progress``: woken by progress reports too."""

    loop: asyncio.AbstractEventLoop
    progress: bool
    event: asyncio.Event = field(default_factory=asyncio.Event)

    def wake(self) -> None:
        with contextlib.suppress(RuntimeError):  # its loop has closed: nobody waits any more
            self.loop.call_soon_threadsafe(self.event.set)


class Waiting:
    """Waiters of jobs' changes (module docstring). ``recheck_s``: the safety re-read's period;
    ``retry_after_s``: the ``Retry-After`` of :class:`~app.core.errors.ServerStopping`."""

    def __init__(
        self,
        settings: BrokerSettings,
        keys: Keys,
        journal: Journal,
        progress: ProgressStore,
        recheck_s: float = RECHECK_S,
        retry_after_s: int = 5,
    ) -> None:
        self.settings = settings
        self.retry_after_s = retry_after_s  # a stopping server's answer's Retry-After (seconds)
        self.channel = keys.job_changes()
        self.journal = journal
        self.progress = progress
        self.recheck_s = recheck_s
        self._watches: dict[str, set[_Watch]] = {}
        self._mutex = threading.Lock()
        self._ready = threading.Event()  # the listener is subscribed
        self._stop = threading.Event()
        self._stopping = threading.Event()  # the server was told to stop: waiters answer now (stop_waiters)
        self._thread: threading.Thread | None = None

    # -- the listener -----------------------------------------------------------------------
    def _start(self) -> None:
        with self._mutex:
            if self._thread is None or not self._thread.is_alive():
                self._stop.clear()
                self._thread = threading.Thread(target=self._listen, name="homefleet-waiting", daemon=True)
                self._thread.start()
        self._ready.wait(READY_S)

    def _listen(self) -> None:
        outage = RedisOutageLog(
            log, "job changes", self.settings.redis_url, f"waiters re-read the journal every {self.recheck_s:g} s"
        )
        while not self._stop.is_set():
            client = create_redis(self.settings)
            pubsub = client.pubsub(ignore_subscribe_messages=True)
            try:
                pubsub.subscribe(self.channel)
                pubsub.get_message(timeout=LISTEN_S)  # the subscription's confirmation (ignored)
                # what was published while it was not subscribed: read again. Before ready is
                # set: a waiter let through by it has cleared its wake-up before its first read,
                # so that read is not repeated
                self._wake_all()
                self._ready.set()
                outage.answered()
                while not self._stop.is_set():
                    message = pubsub.get_message(timeout=LISTEN_S)
                    if message is not None:
                        self._heard(message.get("data"))
            except (redis.ConnectionError, redis.TimeoutError, OSError) as error:  # said once per outage
                self._ready.clear()
                outage.failed(error)
                self._stop.wait(LISTEN_S)
            except redis.RedisError as error:  # answered, but refused (e.g. an ACL without SUBSCRIBE)
                self._ready.clear()
                log.warning(
                    "job changes: Redis refused the listener (%s); waiters re-read the journal every %g s meanwhile",
                    error,
                    self.recheck_s,
                )
                self._stop.wait(LISTEN_S)
            finally:
                pubsub.close()
                client.close()

    def _heard(self, data: object) -> None:
        try:
            change = json.loads(str(data))
            job_id, is_progress = str(change["job"]), bool(change.get("progress"))
        except (ValueError, KeyError, TypeError):
            log.warning("job changes: ignored a message that is not a change: %r", data)
            return
        with self._mutex:
            watches = list(self._watches.get(job_id, ()))
        for watch in watches:
            if watch.progress or not is_progress:
                watch.wake()

    def _wake_all(self) -> None:
        with self._mutex:
            watches = [watch for group in self._watches.values() for watch in group]
        for watch in watches:
            watch.wake()

    def stop_waiters(self) -> None:
        """The server was told to stop (SIGTERM): every :meth:`until_ended` waiting, and any
        called from now on, raises :class:`~app.core.errors.ServerStopping` at once for a job that
        has not ended, so its request is answered (503, resendable) before the shutdown's grace
        cuts it. Safe from a signal handler or another thread."""
        self._stopping.set()
        self._wake_all()

    def close(self) -> None:
        """Stop the listener thread (within about :data:`LISTEN_S` seconds)."""
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=LISTEN_S * 3)

    @contextmanager
    def _watching(self, job_id: str, progress: bool) -> Iterator[_Watch]:
        watch = _Watch(asyncio.get_running_loop(), progress)
        with self._mutex:
            self._watches.setdefault(job_id, set()).add(watch)
        try:
            yield watch
        finally:
            with self._mutex:
                group = self._watches.get(job_id)
                if group is not None:
                    group.discard(watch)
                    if not group:
                        del self._watches[job_id]

    async def _subscribed(self) -> None:
        if not self._ready.is_set() or self._thread is None or not self._thread.is_alive():
            await to_thread.run_sync(self._start)

    async def _woken(self, watch: _Watch, timeout_s: float) -> None:
        with suppress(TimeoutError):
            await asyncio.wait_for(watch.event.wait(), timeout=max(0.0, timeout_s))

    # -- the waiters --------------------------------------------------------------------------
    async def until_ended(self, job_id: str, timeout_s: float) -> Job:
        """The job once it has ended, or as it is after ``timeout_s`` seconds (not ended: the
        caller answers that it keeps running). Reads the journal at once, on each change of the
        job's state published, and every ``recheck_s`` seconds otherwise.

        Raises:
            NotFound: no such job.
            ServerStopping: the server is stopping (:meth:`stop_waiters`) and the job has not
                ended; ``retry_after_s`` is the settings' ``retry_after_s``.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(0.0, timeout_s)
        with self._watching(job_id, progress=False) as watch:
            await self._subscribed()  # before the first read: a change after it is heard
            while True:
                watch.event.clear()
                job = await to_thread.run_sync(self.journal.get, job_id)
                left = deadline - loop.time()
                if job.state in ENDED or left <= 0:
                    return job
                if self._stopping.is_set():
                    raise ServerStopping(job_id, retry_after_s=self.retry_after_s)
                await self._woken(watch, min(left, self.recheck_s))

    async def follow(self, job_id: str, past_progress: bool = True) -> AsyncIterator[Progress | Job]:
        """A job as it goes: the job (its journal row) first and on each change of state, each
        new progress report (a new step, or a text job's new text) while it is not queued, and
        the ended job last; then the iteration ends. The last progress reports are read before
        the ended job. A client that disconnects stops the iteration.

        ``past_progress``: whether a job that had already ended at the first read still yields
        its last progress report before it (a streamed completion takes its text from it).
        False: such a job yields only itself, its report being history, not progress (the event
        stream of an ended job is its ``state`` and ``end``, docs/api.md "Events"); a job
        followed while queued or running yields its reports as ever.

        Raises:
            NotFound: no such job.
        """
        last_state = None
        seen: tuple[object, ...] | None = None
        with self._watching(job_id, progress=True) as watch:
            await self._subscribed()
            while True:
                watch.event.clear()
                job = await to_thread.run_sync(self.journal.get, job_id)
                ended = job.state in ENDED
                ended_before = ended and last_state is None  # ended before this follower's first read
                if job.state != last_state and not ended:
                    yield job
                last_state = job.state
                if job.state != "queued" and (past_progress or not ended_before):
                    # the last steps may land just before the job ends: read them first
                    progress = await to_thread.run_sync(self.progress.read, job_id)
                    if progress is not None and (progress.step, progress.text) != seen:
                        seen = (progress.step, progress.text)
                        yield progress
                if ended:
                    yield job
                    return
                await self._woken(watch, self.recheck_s)
