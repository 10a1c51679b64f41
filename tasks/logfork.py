"""Log handlers held across a fork, so that a forked pool process can always write its log.

The worker's parent forks a new pool process (Celery's prefork pool, R7) while its other threads
(the heartbeat, the failure and revocation reporters) may be writing a log line. The logging
module gives the child new, unlocked handler locks, but not the stream's own: a buffered file
object's internal lock, taken by a write under way in another thread at the instant of the fork,
stays taken in the child, whose first log line then waits for ever (seen: a new pool process
claimed its job and never wrote another line until the watchdog killed it, R19). Holding every
handler's lock across the fork means no thread is inside a handler's write when it happens.

The same holds for native libraries that keep locks of their own (pydantic-core, ssl): a pool
process forked while the thread reporting its killed predecessor (R21) was inside the server
client's call claimed its next job and hung in its first ``model_dump`` (the watchdog's stack
dump, R19). Those calls run under :func:`no_fork_meanwhile`, a gate each fork takes first: the
fork waits until the call under way has ended, and no call starts while it forks.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_held: list[logging.Handler] = []
_installed = False
#: taken by each fork of a process whose hooks are installed, and by :func:`no_fork_meanwhile`;
#: re-entrant, so a gated call may make another
_gate = threading.RLock()


@contextmanager
def no_fork_meanwhile() -> Iterator[None]:
    """Run the block with no fork of this process under way, nor starting until it ends (when
    :func:`hold_locks_across_fork` was called; elsewhere an uncontended lock). For a short call
    into a native library that keeps its own locks (the server client's serialization and HTTP
    request): hold it for one attempt, never across a retry's pause, since a fork waits for it."""
    with _gate:
        yield


def _handlers() -> list[logging.Handler]:
    """Every handler of every logger, each once (the root's first)."""
    loggers = [logging.getLogger()]
    loggers += [lg for lg in logging.Logger.manager.loggerDict.values() if isinstance(lg, logging.Logger)]
    found: dict[int, logging.Handler] = {}
    for logger in loggers:
        for handler in logger.handlers:
            found.setdefault(id(handler), handler)
    return list(found.values())


def _before_fork() -> None:
    _gate.acquire()
    for handler in _handlers():
        handler.acquire()
        _held.append(handler)


def _after_fork_in_parent() -> None:
    while _held:
        _held.pop().release()
    _gate.release()


def _after_fork_in_child() -> None:
    _held.clear()  # the logging module's own fork hook, run before this one, gave each a new lock
    _gate.release()  # the child's copy, held by this thread (the one that forked)


def hold_locks_across_fork() -> None:
    """From now on, every ``os.fork`` of this process (each pool process Celery starts) happens
    with :func:`no_fork_meanwhile`'s gate and every log handler's lock held, so no other thread is
    mid-write or mid-call. Idempotent."""
    global _installed
    if not _installed:
        os.register_at_fork(
            before=_before_fork, after_in_parent=_after_fork_in_parent, after_in_child=_after_fork_in_child
        )
        _installed = True
