"""What every command module shares: the console and the server's settings."""

from __future__ import annotations

import io
import os
import sys
from collections.abc import Iterable

from rich.cells import cell_len
from rich.console import Console
from rich.table import Table
from rich.text import Text

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


def shows_every_word_whole(table: Table, width: int) -> bool:
    """Whether ``table`` printed ``width`` columns wide keeps each word of its headers and cells
    whole on one line (rich squeezes a table too wide by folding cells and cutting headers
    short, ``runni…``, and no measure of its own says when it will)."""
    buffer = io.StringIO()
    Console(width=width, file=buffer, color_system=None).print(table)
    shown = buffer.getvalue()
    words = {
        word
        for column in table.columns
        for text in (column.header, *column.cells)
        for word in Text.from_markup(str(text)).plain.split()
    }
    return all(cell_len(line) <= width for line in shown.splitlines()) and all(word in shown for word in words)


def print_table(table: Table, out: Console | None = None) -> None:
    """Print ``table`` where the console's width keeps every word of it whole
    (:func:`shows_every_word_whole`); on a narrower one, one record per row instead: its first
    cell, then ``header: value`` for each other non-empty cell (a cell's lines joined by
    commas), indented, so that no id, class name or figure is folded mid-word or cut, as rich
    would to squeeze the table (an 80-column terminal)."""
    out = out or console
    if shows_every_word_whole(table, out.width):
        out.print(table)
        return
    columns = table.columns
    for index in range(table.row_count):
        cells = [str(list(column.cells)[index]) for column in columns]
        out.print(cells[0])
        for column, cell in zip(columns[1:], cells[1:], strict=True):
            if cell.strip():
                out.print(f"  {column.header}: {', '.join(cell.splitlines())}")


def server_settings() -> Settings:
    """The server's settings from ``HOMEFLEET_*`` (built here, in the entry point, STYLE #3)."""
    return Settings()


def require_machine(name: str, machines: Iterable[str], where: str = "this fleet") -> None:
    """Raises Rejected (``unknown_machine``, the one-line error every command prints) when
    ``name`` is not among ``machines``, naming them; ``where``: the fleet or its file."""
    known = sorted(machines)
    if name not in known:
        raise Rejected(f"machine {name!r} is not in {where}; machines: {', '.join(known)}", reason="unknown_machine")
