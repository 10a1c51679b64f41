"""One ``homefleet serve`` per data folder: an ``flock`` on ``<data_dir>/.serve.lock`` held for
the server's life.

A second server on the same folder would write the same results (and SQLite journal), and
reconcile (R19) and deliver webhooks beside the first. It is refused at start, before it opens
the journal, naming the folder and the running server's pid. The kernel releases the lock when
its process ends, however it ends (SIGKILL included): no stale pid file blocks the next start.

Standby servers (``HOMEFLEET_LEADER_ELECTION``, docs/operations.md "A standby server") share one
data folder on purpose: each holds the lock shared, so they start beside one another; a server
without leader election beside them (or one with it beside a server without) is refused.

The file records the pids of its holders, one a line (the exclusive holder rewrites it, a
shared holder appends its own): read only to name them in the refusal.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from app.core.errors import ConfigError

LOCK_FILE = ".serve.lock"
PID_WAIT_S = 1.0  # seconds a refused server waits for the holder to write its pid (it locks, then writes)


@contextlib.contextmanager
def holding_data_dir(data_dir: Path, *, shared: bool = False) -> Iterator[Path]:
    """Hold ``<data_dir>/.serve.lock`` (created, with ``data_dir``, if missing) while the block
    runs; yields the lock file's path. ``shared``: a standby server's lock (leader election), which
    other standby servers share; otherwise exclusive.

    Raises:
        ConfigError: reason ``data_dir_in_use`` when another process holds a lock that conflicts
            (naming the folder and its holders' pids), or ``data_dir_unlockable`` when the file
            system refuses locks (e.g. an NFS mount without them).
    """
    data_dir.mkdir(parents=True, exist_ok=True)
    path = data_dir / LOCK_FILE
    with open(path, "a+") as lock:  # append: a shared holder adds its pid without erasing the others'
        try:
            fcntl.flock(lock, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
        except BlockingIOError:
            raise _in_use(data_dir, path, shared, standby=not shared and _shared_holders(lock)) from None
        except OSError as error:
            raise ConfigError(
                f"the data folder {data_dir} cannot be locked ({error.strerror or error}): one `homefleet serve` "
                "per data folder is checked with a lock on its .serve.lock; put HOMEFLEET_DATA_DIR on a file "
                "system that supports flock",
                reason="data_dir_unlockable",
            ) from error
        if not shared:
            lock.truncate(0)  # the pids of holders that are gone (no one else holds it now)
        lock.write(f"{os.getpid()}\n")
        lock.flush()
        yield path


def _shared_holders(lock: IO[str]) -> bool:
    """Whether the lock that refused an exclusive hold is held shared (standby servers): a shared
    hold is granted then (and dropped at once)."""
    try:
        fcntl.flock(lock, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return False
    fcntl.flock(lock, fcntl.LOCK_UN)
    return True


def _in_use(data_dir: Path, path: Path, shared: bool, standby: bool = False) -> ConfigError:
    pids = _holders(path)
    named = f"pid {pids[0]}" if len(pids) == 1 else f"pids {', '.join(map(str, pids))}" if pids else "pid unknown"
    if shared:  # an exclusive holder: a server without leader election
        why = (
            f"another `homefleet serve` without HOMEFLEET_LEADER_ELECTION ({named}) is running on it; "
            "standby servers share a data folder only when each has HOMEFLEET_LEADER_ELECTION=true"
        )
    elif standby:  # standby servers hold it: this one forgot the setting they share
        return ConfigError(
            f"the data folder {data_dir} is in use by standby servers ({named}, HOMEFLEET_LEADER_ELECTION=true); "
            "set HOMEFLEET_LEADER_ELECTION=true to join them as a standby "
            '(docs/operations.md, "A standby server"), or give this server another HOMEFLEET_DATA_DIR',
            reason="data_dir_in_use",
        )
    else:
        why = f"another `homefleet serve` ({named}) is running on it"
    return ConfigError(
        f"the data folder {data_dir} is in use: {why}; stop it first, or give this server another HOMEFLEET_DATA_DIR",
        reason="data_dir_in_use",
    )


def _holders(path: Path) -> list[int]:
    """The pids recorded in the lock file that are still running (all recorded ones if none is:
    a holder in another pid namespace), waiting up to :data:`PID_WAIT_S` seconds for a holder
    that has locked but not yet written its pid."""
    deadline = time.monotonic() + PID_WAIT_S
    while True:
        try:
            recorded = [int(line) for line in path.read_text().split() if line.isdigit()]
        except OSError:
            recorded = []
        if recorded or time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    running = [pid for pid in recorded if _running(pid)]
    return sorted(set(running or recorded))


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except PermissionError:  # another user's process
        return True
    except OSError:
        return False
    return True
