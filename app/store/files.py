"""The server's content-addressed files (R1, R2): results and uploaded inputs, each stored under
its content digest (``<root>/<hex[:2]>/<hex>.<ext>``) with an atomic rename, only after its
checks pass; nothing is written when one fails.

- Results (:class:`ResultStore`, R2): a worker's upload is accepted only if its bytes hash to
  the digest the worker declared, its media type (sniffed, ``app/store/media.py``) is one the
  kinds produce, it is within ``max_result_bytes``, and it decodes as that type (images
  through Pillow within ``MAX_INPUT_PIXELS``, MP4 through ffmpeg).
- Inputs (:class:`InputStore`): images for edit and upscale jobs. A client uploads an image
  first (``POST /v1/files``); its id is the content digest (``"blake3:<hex>"``), so the same
  bytes always get the same id. A job names that id in its params; the worker fetches the
  bytes from the internal API and checks the digest before using them (never the server's
  folders). At most ``max_input_bytes``; PNG, JPEG or WebP; decoding completely to at most
  ``MAX_INPUT_PIXELS``.
"""

from __future__ import annotations

import errno
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from app.core.digest import bytes_digest, hex_part
from app.core.errors import IntegrityFailure, NotFound, Rejected, StorageFull
from app.store.media import (
    EXTENSIONS,
    INPUT_TYPES,
    RESULT_TYPES,
    check_decodes,
    check_result,
    sniff,
    sniff_result,
)

log = logging.getLogger(__name__)

DISK_FULL = frozenset({errno.ENOSPC, errno.EFBIG, errno.EDQUOT})
"""What a write answers when there is no room: no space, over the process's file-size limit
(``RLIMIT_FSIZE``, ``prlimit --fsize``), over a quota."""


def write_once(path: Path, data: bytes, what: str = "a file") -> None:
    """Content-addressed write: unless ``path`` exists, write ``data`` to a temporary name in
    the same folder, fsync, and rename it into place atomically (no half-file is ever seen).

    Raises:
        StorageFull: no room for it (:data:`DISK_FULL`); the message names ``what``, its size
            and the folder; logged. Nothing is left behind.
    """
    if path.exists():
        return
    tmp: str | None = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".incoming.", dir=path.parent)
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except OSError as error:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        if error.errno not in DISK_FULL:
            raise
        message = f"{what} ({len(data)} bytes) could not be stored in {path.parent}: {error.strerror}; free some space"
        log.error("storage full: %s", message)
        raise StorageFull(message) from error
    except BaseException:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        raise


@dataclass(frozen=True)
class StoredFile:
    """A stored result or input: its digest (an input's id), where it lies, its media type and size."""

    digest: str  # "blake3:<hex>"
    path: Path  # absolute, <root>/<hex[:2]>/<hex>.<ext>
    media_type: str
    size_bytes: int

    @property
    def id(self) -> str:
        """An input's id: its digest."""
        return self.digest


class ContentStore:
    """Files under ``root``, each named by its content digest and media type."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def path(self, digest: str, media_type: str) -> Path:
        hexdigest = hex_part(digest)
        return self.root / hexdigest[:2] / f"{hexdigest}.{EXTENSIONS[media_type]}"

    def put(self, data: bytes, digest: str, media_type: str, what: str = "a file") -> StoredFile:
        """Store ``data`` under its digest. Raises StorageFull (507) when there is no room."""
        path = self.path(digest, media_type)
        write_once(path, data, what)
        return StoredFile(digest=digest, path=path, media_type=media_type, size_bytes=len(data))


class ResultStore(ContentStore):
    """Verified results (R2)."""

    def __init__(self, root: Path, max_result_bytes: int) -> None:
        super().__init__(root)
        self.max_result_bytes = max_result_bytes

    def store(self, data: bytes, declared_digest: str, text: bool = False) -> StoredFile:
        """Verify ``data`` against ``declared_digest`` and store it; return where it lies.
        ``text``: the result of a text job, which must be UTF-8 text (``text/plain``);
        any other result must be one of the image and video types.

        Raises:
            IntegrityFailure: digest mismatch or malformed digest, a media type the kinds do not
                produce, or more than ``max_result_bytes`` (reason ``integrity``); bytes that do
                not decode as their media type, or an image over the inputs' pixel limit (reason
                ``result_invalid``, app/store/media.py ``check_result``). Nothing is written in
                any of these cases.
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
        media_type = sniff_result(data) if text else sniff(data)
        if text and media_type != "text/plain":
            raise IntegrityFailure(
                f"the result of a text job is not UTF-8 text (first bytes {data[:12]!r})", reason="integrity"
            )
        if media_type not in RESULT_TYPES:
            raise IntegrityFailure(
                f"result is not PNG, WebP, GIF or MP4 (first bytes {data[:12]!r})", reason="integrity"
            )
        try:
            check_result(data, media_type)  # decoded as inputs are: a bomb, a truncated file, a polyglot
        except Rejected as error:
            raise IntegrityFailure(error.message, reason=error.reason) from error
        return self.put(data, actual, media_type, f"the result {actual}")


class InputStore(ContentStore):
    """Uploaded input images (``<data_dir>/inputs``)."""

    def __init__(self, root: Path, max_input_bytes: int) -> None:
        super().__init__(root)
        self.max_input_bytes = max_input_bytes

    def add(self, data: bytes, field: str | None = None) -> StoredFile:
        """Check and store ``data``; return it (its ``id`` is its digest). Storing the same bytes
        twice is a no-op. ``field``: the request's field that carried it, which a refusal names
        (OpenAI's ``param``: ``image``, ``file``, ``inputs``).

        Raises:
            Rejected: more than ``max_input_bytes`` or too many pixels (reason
                ``input_too_large``), not PNG/JPEG/WebP (reason ``input_type``), or not
                decoding completely (reason ``input_corrupt``).
        """
        if len(data) > self.max_input_bytes:
            raise Rejected(
                f"file is {len(data)} bytes; the limit (max_input_bytes) is {self.max_input_bytes}",
                reason="input_too_large",
                param=field,
            )
        media_type = sniff(data)
        if media_type not in INPUT_TYPES:
            raise Rejected(
                f"file must be one of {', '.join(INPUT_TYPES)}; its first bytes are {data[:12]!r}",
                reason="input_type",
                param=field,
            )
        try:
            check_decodes(data, media_type)
        except Rejected as error:
            error.param = error.param or field
            raise
        return self.put(data, bytes_digest(data), media_type, "the uploaded input")

    def get(self, file_id: str) -> StoredFile:
        """The stored input with id ``file_id``.

        Raises:
            Rejected: ``file_id`` is not a ``"blake3:<64 hex>"`` digest (reason ``invalid_file_id``).
            NotFound: nothing was uploaded under that id (reason ``unknown_file``).
        """
        try:
            hexdigest = hex_part(file_id)
        except ValueError as error:
            raise Rejected(f"file id: {error}", reason="invalid_file_id") from error
        for media_type in INPUT_TYPES:
            path = self.path(file_id, media_type)
            if path.is_file():
                return StoredFile(digest=file_id, path=path, media_type=media_type, size_bytes=path.stat().st_size)
        raise NotFound(
            f"no uploaded file and no result of yours with id {file_id!r} (hex {hexdigest[:12]}…); upload "
            "it with POST /v1/files, or name the digest of a result of a succeeded job you submitted",
            reason="unknown_file",
        )
