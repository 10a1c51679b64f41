"""Full-content digests: a file's identity is its content (R4, R5).

Digests are strings ``"<algorithm>:<hex>"`` so a manifest says how it was made.
BLAKE3 (the ``blake3`` package) reads every byte of the file, in 1 MiB chunks.
"""

from __future__ import annotations

from pathlib import Path

import blake3

ALGORITHM = "blake3"
CHUNK_BYTES = 1024 * 1024


def bytes_digest(data: bytes) -> str:
    """Digest of ``data``: ``"blake3:<64 hex>"``."""
    return f"{ALGORITHM}:{blake3.blake3(data).hexdigest()}"


def file_digest(path: Path) -> str:
    """Digest of every byte of the file at ``path``. Raises ``OSError`` if it cannot be read."""
    hasher = blake3.blake3()
    with open(path, "rb") as handle:
        while chunk := handle.read(CHUNK_BYTES):
            hasher.update(chunk)
    return f"{ALGORITHM}:{hasher.hexdigest()}"


def hex_part(digest: str) -> str:
    """The hex part of ``"<algorithm>:<hex>"``. Raises ``ValueError`` on another form."""
    algorithm, _, hexdigest = digest.partition(":")
    if algorithm != ALGORITHM or len(hexdigest) != 64 or not all(c in "0123456789abcdef" for c in hexdigest):
        raise ValueError(f"digest must be '{ALGORITHM}:' followed by 64 lowercase hex digits, got {digest!r}")
    return hexdigest
