"""Files that hold secrets (the fleet file's machine tokens, a worker's token file): written
readable by their owner only, and refused at start when others can read them, as ssh refuses
a private key that is group- or world-readable (docs/operations.md, "API keys and machine
tokens")."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from app.core.errors import ConfigError

#: the permission bits that let anyone but the owner read, write or run a file
OTHERS_BITS = 0o077


def write_private(path: Path, text: str) -> Path:
    """Write ``text`` to ``path`` (UTF-8), readable and writable by its owner only (mode 0600),
    also when it existed with a wider mode; the parent folder is created. Returns ``path``.

    The file is created with mode 0600 before any byte is written, so the secret is never
    readable by others, even for a moment.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(descriptor, 0o600)  # an existing file keeps its mode through O_CREAT
        os.write(descriptor, text.encode())
    finally:
        os.close(descriptor)
    return path


def require_private(path: Path, what: str) -> None:
    """Refuse a secret file that others than its owner may read or write.

    ``what``: how the message names the file (e.g. ``"the fleet file"``). A file that does not
    exist is left to whoever reads it (their own message names it). On Windows (no POSIX
    modes) nothing is checked.

    Raises:
        ConfigError: ``mode & 0o077`` is not 0; the message names the file, its mode (octal)
            and the fix (``chmod 600 FILE``).
    """
    if os.name == "nt":
        return
    try:
        mode = stat.S_IMODE(path.expanduser().stat().st_mode)
    except FileNotFoundError:
        return
    if mode & OTHERS_BITS:
        raise ConfigError(
            f"{what} {path} holds secrets but has mode {mode:04o}: others than its owner can "
            f"read it; run `chmod 600 {path}` (as ssh refuses a private key others can read)"
        )
