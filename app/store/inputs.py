"""Uploaded inputs on the server (R1, R2): images for edit and upscale jobs.

A client uploads an image first (``POST /v1/files``); its id is the content digest
(``"blake3:<hex>"``), so the same bytes always get the same id. A job names that id in its
params (``"image": "blake3:…"``); the worker fetches the bytes from the server's internal
API and checks the digest before using them. A worker never reads the server's folders.

Limits: at most ``max_input_bytes`` bytes; PNG, JPEG or WebP only (sniffed from the magic
bytes, never from a header or a file name), decoding completely (no truncated file) to at most
``MAX_INPUT_PIXELS``. Nothing is written when a check fails.
"""

from __future__ import annotations

import io
import warnings
from dataclasses import dataclass
from pathlib import Path

from app.core.digest import bytes_digest, hex_part
from app.core.errors import NotFound, Rejected
from app.store.files import write_once

MAX_INPUT_PIXELS = 4096 * 4096
"""Largest input image (width x height) the server decodes; larger ones are refused before
their pixels are decoded (a small file can hold a huge image: a decompression bomb)."""

# media type -> file extension, for the input types Homefleet accepts
INPUT_MEDIA_TYPES: dict[str, str] = {"image/png": "png", "image/jpeg": "jpg", "image/webp": "webp"}


def sniff_image_type(data: bytes) -> str | None:
    """Media type of ``data`` from its magic bytes (PNG, JPEG, WebP), or None.

    Sources: PNG signature (RFC 2083 §3.1), JPEG SOI marker FF D8 FF, RIFF/WEBP (RFC 9649).
    """
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return "image/png"
    if data.startswith(b"\xff\xd8\xff"):
        return "image/jpeg"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "image/webp"
    return None


def check_decodes(data: bytes, media_type: str) -> tuple[int, int]:
    """(width, height) in pixels of an image that decodes completely with Pillow.

    Raises:
        Rejected: more than ``MAX_INPUT_PIXELS`` pixels (reason ``input_too_large``), or the
            file does not decode, e.g. truncated (reason ``input_corrupt``).
    """
    from PIL import Image

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data)) as image:
                width, height = image.size
                if width * height > MAX_INPUT_PIXELS:
                    raise Rejected(f"image is {width} x {height} = {width * height} pixels; the limit is "
                                   f"{MAX_INPUT_PIXELS} pixels", reason="input_too_large")
                image.load()
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError, Image.DecompressionBombWarning) as error:
        raise Rejected(f"file is not a complete {media_type} image: {error}", reason="input_corrupt") from error
    return width, height


@dataclass(frozen=True)
class StoredInput:
    id: str  # "blake3:<hex>": the content digest
    path: Path  # <root>/<hex[:2]>/<hex>.<ext>
    media_type: str
    size_bytes: int


class InputStore:
    """Content-addressed input files under ``root`` (``<data_dir>/inputs``)."""

    def __init__(self, root: Path, max_input_bytes: int) -> None:
        self.root = root
        self.max_input_bytes = max_input_bytes

    def add(self, data: bytes) -> StoredInput:
        """Check and store ``data``; return its id. Storing the same bytes twice is a no-op.

        Raises:
            Rejected: empty, more than ``max_input_bytes`` (reason ``input_too_large``), or
                not PNG/JPEG/WebP (reason ``input_type``).
        """
        if len(data) > self.max_input_bytes:
            raise Rejected(
                f"file is {len(data)} bytes; the limit (max_input_bytes) is {self.max_input_bytes}",
                reason="input_too_large",
            )
        media_type = sniff_image_type(data)
        if media_type is None:
            accepted = ", ".join(INPUT_MEDIA_TYPES)
            raise Rejected(f"file must be one of {accepted}; its first bytes are {data[:12]!r}", reason="input_type")
        check_decodes(data, media_type)
        file_id = bytes_digest(data)
        path = self._path(file_id, media_type)
        write_once(path, data)
        return StoredInput(id=file_id, path=path, media_type=media_type, size_bytes=len(data))

    def get(self, file_id: str) -> StoredInput:
        """The stored input with id ``file_id``.

        Raises:
            Rejected: ``file_id`` is not a ``"blake3:<64 hex>"`` digest (reason ``invalid_file_id``).
            NotFound: nothing was uploaded under that id (reason ``unknown_file``).
        """
        try:
            hexdigest = hex_part(file_id)
        except ValueError as error:
            raise Rejected(f"file id: {error}", reason="invalid_file_id") from error
        for media_type in INPUT_MEDIA_TYPES:
            path = self._path(file_id, media_type)
            if path.is_file():
                return StoredInput(id=file_id, path=path, media_type=media_type, size_bytes=path.stat().st_size)
        raise NotFound(f"no uploaded file with id {file_id!r} (hex {hexdigest[:12]}…); upload it with POST /v1/files",
                       reason="unknown_file")

    def _path(self, file_id: str, media_type: str) -> Path:
        hexdigest = hex_part(file_id)
        return self.root / hexdigest[:2] / f"{hexdigest}.{INPUT_MEDIA_TYPES[media_type]}"
