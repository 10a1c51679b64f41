"""Result storage on the server (R2): verify, then store content-addressed with an atomic rename.

A result is accepted only if its bytes hash to the digest the worker declared, its media
type (sniffed from magic bytes, never from a header) is one Homefleet produces, and it is
within ``max_result_bytes``. Otherwise nothing is written.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from app.core.digest import bytes_digest, hex_part
from app.core.errors import IntegrityFailure

# media type -> file extension
MEDIA_TYPES: dict[str, str] = {"image/png": "png", "image/webp": "webp", "image/gif": "gif", "video/mp4": "mp4"}


def sniff_media_type(data: bytes) -> str | None:
    """Media type from magic bytes (PNG, WebP, GIF, MP4), or None when it is none of them.

    Sources: PNG signature (RFC 2083 §3.1), RIFF/WEBP (RFC 9649), GIF87a/89a, ISO BMFF 'ftyp' box.
    """
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return "image/png"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "image/webp"
    if data[:6] in (b"GIF87a", b"GIF89a"):
        return "image/gif"
    if data[4:8] == b"ftyp":
        return "video/mp4"
    return None


def write_once(path: Path, data: bytes) -> None:
    """Content-addressed write: unless ``path`` exists, write ``data`` to a temporary name in
    the same folder, fsync, and rename it into place atomically (no half-file is ever seen)."""
    if path.exists():
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".incoming.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@dataclass(frozen=True)
class StoredResult:
    digest: str  # "blake3:<hex>"
    path: Path  # absolute, <results_dir>/<hex[:2]>/<hex>.<ext>
    media_type: str
    size_bytes: int


class ResultStore:
    """Content-addressed storage of verified results under ``root``."""

    def __init__(self, root: Path, max_result_bytes: int) -> None:
        self.root = root
        self.max_result_bytes = max_result_bytes

    def store(self, data: bytes, declared_digest: str) -> StoredResult:
        """Verify ``data`` against ``declared_digest`` and store it; return where it lies.

        Raises:
            IntegrityFailure: digest mismatch or malformed digest, unknown media type, or more
                than ``max_result_bytes``. Nothing is written in any of these cases.
        """
        if len(data) > self.max_result_bytes:
            raise IntegrityFailure(
                f"result is {len(data)} bytes; the limit (max_result_bytes) is {self.max_result_bytes}",
                reason="integrity",
            )
        try:
            hex_part(declared_digest)
        except ValueError as error:
            raise IntegrityFailure(f"declared digest: {error}", reason="integrity") from error
        actual = bytes_digest(data)
        if actual != declared_digest:
            raise IntegrityFailure(
                f"result digest mismatch: declared {declared_digest}, received bytes hash to {actual}",
                reason="integrity",
            )
        media_type = sniff_media_type(data)
        if media_type is None:
            raise IntegrityFailure(
                f"result is not PNG, WebP, GIF or MP4 (first bytes {data[:12]!r})", reason="integrity"
            )
        hexdigest = hex_part(actual)
        path = self.root / hexdigest[:2] / f"{hexdigest}.{MEDIA_TYPES[media_type]}"
        write_once(path, data)
        return StoredResult(digest=actual, path=path, media_type=media_type, size_bytes=len(data))
