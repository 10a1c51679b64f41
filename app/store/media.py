"""What a file is, from its bytes: the one sniffer of media types (magic bytes, never a header or
a file name), and the decoding check of images.

Sources: PNG signature (RFC 2083 §3.1), JPEG SOI marker FF D8 FF, RIFF/WEBP (RFC 9649),
GIF87a/89a, ISO BMFF 'ftyp' box (MP4).
"""

from __future__ import annotations

import io
import warnings

from app.core.errors import Rejected

EXTENSIONS: dict[str, str] = {"image/png": "png", "image/jpeg": "jpg", "image/webp": "webp", "image/gif": "gif",
                              "video/mp4": "mp4"}
"""Media type -> file extension of every type Homefleet stores."""

INPUT_TYPES: tuple[str, ...] = ("image/png", "image/jpeg", "image/webp")
"""What a client may upload as an input image (``POST /v1/files``, ``/v1/images/edits``)."""

RESULT_TYPES: tuple[str, ...] = ("image/png", "image/webp", "image/gif", "video/mp4")
"""What a worker may upload as a result: what the kinds produce (R2)."""

MAX_INPUT_PIXELS = 4096 * 4096
"""Largest input image (width x height) the server decodes; larger ones are refused before
their pixels are decoded (a small file can hold a huge image: a decompression bomb)."""


def sniff(data: bytes) -> str | None:
    """Media type of ``data`` from its first bytes (PNG, JPEG, WebP, GIF, MP4), or None."""
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return "image/png"
    if data.startswith(b"\xff\xd8\xff"):
        return "image/jpeg"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "image/webp"
    if data[:6] in (b"GIF87a", b"GIF89a"):
        return "image/gif"
    if data[4:8] == b"ftyp":
        return "video/mp4"
    return None


def check_decodes(data: bytes, media_type: str, max_pixels: int = MAX_INPUT_PIXELS) -> tuple[int, int]:
    """(width, height) in pixels of an image that decodes completely with Pillow.

    Raises:
        Rejected: more than ``max_pixels`` pixels (reason ``input_too_large``), or the file
            does not decode, e.g. truncated (reason ``input_corrupt``).
    """
    from PIL import Image

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data)) as image:
                width, height = image.size
                if width * height > max_pixels:
                    raise Rejected(f"image is {width} x {height} = {width * height} pixels; the limit is "
                                   f"{max_pixels} pixels", reason="input_too_large")
                image.load()
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError, Image.DecompressionBombWarning) as error:
        raise Rejected(f"file is not a complete {media_type} image: {error}", reason="input_corrupt") from error
    return width, height
