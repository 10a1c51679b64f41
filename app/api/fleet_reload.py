"""The running server follows its fleet file (docs/operations.md, "Add a machine"): a thread
looks at the file's mtime and size every ``fleet_watch_s`` seconds, and SIGHUP makes it look at
once. A changed file is parsed and checked as ``homefleet serve`` checks it at start (every
machine has a token of 16 characters or more) and then taken whole by
:meth:`app.context.ServerContext.apply_fleet`: machines, tokens, working memory, timing guesses,
webhook hosts. No restart: requests in flight and event streams go on.

A file that cannot be used (not TOML, invalid) or that would strand work (a machine it drops
still has jobs queued or running, :meth:`~app.context.ServerContext.stranded_by`) is refused:
the reason is logged, the old configuration is kept, and the refusal is written to Redis
(``Keys.fleet_loaded``) for ``homefleet machines`` to answer. A refused file is tried again
when it changes again, or on SIGHUP.
"""

from __future__ import annotations

import logging
import signal
import threading
from pathlib import Path

from app.context import ServerContext
from app.core.errors import HomefleetError
from app.fleet import live

log = logging.getLogger(__name__)


class FleetReloader:
    """Watches ``path`` for ``ctx`` (module docstring). :meth:`check` is one look, also usable
    without the thread."""

    def __init__(self, ctx: ServerContext, path: Path, interval_s: float) -> None:
        self.ctx, self.path, self.interval_s = ctx, path, interval_s
        self._seen: tuple[int, int] | None = None  # (mtime_ns, size) last looked at
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._names = list(ctx.fleet.machines)

    def check(self, force: bool = False) -> str | None:
        """Reload the file if it changed since the last look (or ``force``): ``"loaded"``,
        ``"refused"``, or None when nothing changed."""
        try:
            stat = self.path.stat()
        except OSError as error:
            if self._seen is not None or force:
                log.error("fleet file %s cannot be read (%s); the running fleet is kept", self.path, error)
            self._seen = None
            return None
        seen = (stat.st_mtime_ns, stat.st_size)
        if seen == self._seen and not force:
            return None
        self._seen = seen
        text = self.path.read_text()
        digest = live.text_digest(text)
        try:
            fleet = live.parse(text, self.path)
            fleet.require_tokens()
        except HomefleetError as error:  # its message names the file
            return self._refuse(digest, error.message)
        except ValueError as error:
            return self._refuse(digest, f"the fleet file {self.path} is not valid: {error}")
        if fleet == self.ctx.fleet:
            live.report_loaded(self.ctx.redis, self.ctx.keys, digest, "loaded", path=self.path)
            return "loaded"
        reason = self.ctx.stranded_by(fleet)
        if reason is not None:
            return self._refuse(digest, reason)
        try:
            self.ctx.apply_fleet(fleet)
        except HomefleetError as error:  # the fleet lock was busy: look again at the next tick
            self._seen = None
            log.warning("fleet file %s not reloaded yet: %s", self.path, error)
            return None
        added = sorted(set(fleet.machines) - set(self._names))
        removed = sorted(set(self._names) - set(fleet.machines))
        self._names = list(fleet.machines)
        log.info(
            "fleet file %s reloaded: %d machines (added %s, removed %s)",
            self.path,
            len(fleet.machines),
            ", ".join(added) or "none",
            ", ".join(removed) or "none",
        )
        live.report_loaded(self.ctx.redis, self.ctx.keys, digest, "loaded", path=self.path)
        return "loaded"

    def _refuse(self, digest: str, reason: str) -> str:
        log.error("fleet file %s refused, the running fleet is kept: %s", self.path, reason)
        live.report_loaded(self.ctx.redis, self.ctx.keys, digest, "refused", reason, path=self.path)
        return "refused"

    def start(self) -> None:
        """Look now, then every ``interval_s`` seconds and on SIGHUP (installed when called from
        the main thread), in a daemon thread."""
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGHUP, lambda _signum, _frame: self._wake.set())
        self._thread = threading.Thread(target=self._run, name="homefleet-fleet-file", daemon=True)
        self._thread.start()

    def reload_now(self) -> None:
        """What SIGHUP does: look at the file at once, changed or not."""
        self._wake.set()

    def _run(self) -> None:
        force = True
        while not self._stop.is_set():
            try:
                self.check(force=force)
            except Exception:  # a Redis or disk hiccup must not end the watch
                log.exception("fleet file %s: reload failed; trying again", self.path)
            force = self._wake.wait(self.interval_s)
            self._wake.clear()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
