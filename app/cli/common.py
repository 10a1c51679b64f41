"""What every command module shares: the console and the server's settings."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable

from rich.console import Console

from app.core.config import Settings
from app.core.errors import Rejected

console = Console()
errors = Console(stderr=True)
"""Where a command's ``error (reason): message`` lines go: stderr, so a script reading a
command's stdout (a table, JSON) never parses an error as data; the exit status is 2."""


def configure_console() -> None:
    """Size :data:`console` and :data:`errors` for this command's own stdout and stderr and
    ``COLUMNS``: on a terminal, its width (or ``COLUMNS``); piped with no ``COLUMNS``, 200
    columns, so tables are not cut at rich's default of 80; and piped text is never wrapped
    (soft wrap), so a one-line error or a path stays one line for grep. Run at import and again
    by the entry point at each command's start: a command forked from an interpreter that
    imported this module earlier (app/devtools/forkserver.py) has another stdout and
    environment."""
    columns = os.environ.get("COLUMNS", "")
    for out, stream in ((console, sys.stdout), (errors, sys.stderr)):
        tty = stream.isatty()
        out.width = int(columns) if columns.isdigit() else (None if tty else 200)  # type: ignore[assignment]
        out.soft_wrap = not tty


configure_console()


def server_settings() -> Settings:
    """The server's settings from ``HOMEFLEET_*`` (built here, in the entry point, STYLE #3)."""
    return Settings()


def require_machine(name: str, machines: Iterable[str], where: str = "this fleet") -> None:
    """Raises Rejected (``unknown_machine``, the one-line error every command prints) when
    ``name`` is not among ``machines``, naming them; ``where``: the fleet or its file."""
    known = sorted(machines)
    if name not in known:
        raise Rejected(f"machine {name!r} is not in {where}; machines: {', '.join(known)}", reason="unknown_machine")
