"""Log handlers held across a fork, so that a forked pool process can always write its log.

The worker's parent forks a new pool process (Celery's prefork pool, R7) while its other threads
(the heartbeat, the failure and revocation reporters) may be writing a log line. The logging
module gives the child new, unlocked handler locks, but not the stream's own: a buffered file
object's internal lock, taken by a write under way in another thread at the instant of the fork,
stays taken in the child, whose first log line then waits for ever (seen: a new pool process
claimed its job and never wrote another line until the watchdog killed it, R19). Holding every
handler's lock across the fork means no thread is inside a handler's write when it happens.
"""

from __future__ import annotations

import logging
import os

_held: list[logging.Handler] = []
_installed = False


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
    for handler in _handlers():
        handler.acquire()
        _held.append(handler)


def _after_fork_in_parent() -> None:
    while _held:
        _held.pop().release()


def _after_fork_in_child() -> None:
    _held.clear()  # the logging module's own fork hook, run before this one, gave each a new lock


def hold_log_handlers_across_fork() -> None:
    """From now on, every ``os.fork`` of this process (each pool process Celery starts) happens
    with every log handler's lock held, so no other thread is mid-write. Idempotent."""
    global _installed
    if not _installed:
        os.register_at_fork(
            before=_before_fork, after_in_parent=_after_fork_in_parent, after_in_child=_after_fork_in_child
        )
        _installed = True
