"""What every command module shares: the console and the server's settings."""

from __future__ import annotations

import os
import sys

from rich.console import Console

from app.core.config import Settings

# Piped (no terminal, no COLUMNS): 200 columns, so tables are not cut at rich's default of 80; and
# piped text is never wrapped (soft wrap), so a one-line error or a path stays one line for grep.
console = Console(width=None if sys.stdout.isatty() or "COLUMNS" in os.environ else 200,
                  soft_wrap=not sys.stdout.isatty())


def server_settings() -> Settings:
    """The server's settings from ``HOMEFLEET_*`` (built here, in the entry point, STYLE #3)."""
    return Settings()
