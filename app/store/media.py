"""What a file is, from its bytes: the one sniffer of media types (magic bytes, never a header or
a file name), and the decoding checks: images through Pillow (inputs and results, one pixel
limit), videos by parsing and decoding their container with the ffmpeg binary of
``imageio-ffmpeg`` (results).

Sources: PNG signature (RFC 2083 §3.1), JPEG SOI marker FF D8 FF, RIFF/WEBP (RFC 9649),
GIF87a/89a, ISO BMFF 'ftyp' box (MP4).
"""

from __future__ import annotations

import io
import re
import warnings
from typing import Any

from app.core.errors import Rejected

EXTENSIONS: dict[str, str] = {
    "image/png": "png",
    "image/jpeg": "jpg",
    "image/webp": "webp",
    "image/gif": "gif",
    "video/mp4": "mp4",
    "text/plain": "txt",
}
"""Media type -> file extension of every type Homefleet stores."""

INPUT_TYPES: tuple[str, ...] = ("image/png", "image/jpeg", "image/webp")
"""What a client may upload as an input image (``POST /v1/files``, ``/v1/images/edits``)."""

RESULT_TYPES: tuple[str, ...] = ("image/png", "image/webp", "image/gif", "video/mp4", "text/plain")
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


EXIF_ORIENTATION = 0x0112
"""The EXIF tag that says how a camera's pixels are turned for display (1-8)."""
SIDEWAYS_ORIENTATIONS = frozenset({5, 6, 7, 8})
"""Orientations that turn the picture a quarter (with or without a mirror): its displayed width
is the stored height (EXIF 2.32, tag 0x0112; ``PIL.ImageOps.exif_transpose`` turns them so)."""


def upright_size(image: Any) -> tuple[int, int]:
    """(width, height) in pixels of an opened PIL image as viewers show it: its stored size, its
    sides swapped when its EXIF orientation turns it a quarter (a phone's portrait photo is
    stored landscape with orientation 6). The header is read; nothing is decoded."""
    width, height = image.size
    try:
        orientation = image.getexif().get(EXIF_ORIENTATION)
    except (OSError, SyntaxError, ValueError):  # an unreadable EXIF block: the pixels as stored
        return width, height
    return (height, width) if orientation in SIDEWAYS_ORIENTATIONS else (width, height)


def declared_size(data: bytes) -> tuple[int, int] | None:
    """(width, height) in pixels that an image file's header declares, read by Pillow's plugin
    for its format without ``Image.open``'s decompression-bomb check (nothing is decoded), or
    None when no plugin reads it."""
    from PIL import Image

    Image.init()
    for factory, accept in Image.OPEN.values():
        if accept is not None and not accept(data[:16]):
            continue
        try:
            with factory(io.BytesIO(data), "") as image:
                return int(image.size[0]), int(image.size[1])
        except (OSError, SyntaxError, ValueError, EOFError, TypeError):
            continue
    return None


def check_decodes(data: bytes, media_type: str, max_pixels: int = MAX_INPUT_PIXELS) -> tuple[int, int]:
    """(width, height) in pixels of an image that decodes completely with Pillow.

    Raises:
        Rejected: more than ``max_pixels`` pixels (reason ``input_too_large``), or the file
            does not decode, e.g. truncated (reason ``input_corrupt``).
    """
    from PIL import Image, ImageSequence

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data)) as image:
                width, height = image.size
                if width * height > max_pixels:
                    raise Rejected(
                        f"image is {width} x {height} = {width * height} pixels; the limit is {max_pixels} pixels",
                        reason="input_too_large",
                    )
                for frame in ImageSequence.Iterator(image):  # every frame of an animated GIF or WebP
                    frame.load()
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as error:  # Pillow refused at open
        # Pillow's message names its own limit (89,478,485 pixels), not ours, and no sides
        sides = declared_size(data)
        if sides is not None:
            size = f"{sides[0]} x {sides[1]} = {sides[0] * sides[1]} pixels"
        else:
            found = re.search(r"Image size \((\d+) pixels\)", str(error))
            size = f"{found.group(1)} pixels" if found else "more pixels than that"
        raise Rejected(f"image is {size}; the limit is {max_pixels} pixels", reason="input_too_large") from error
    except (OSError, SyntaxError, ValueError, EOFError) as error:
        raise Rejected(f"file is not a complete {media_type} image: {error}", reason="input_corrupt") from error
    return width, height


def sniff_result(data: bytes) -> str | None:
    """Media type of a worker's result: :func:`sniff`'s, else ``text/plain`` for bytes that are
    valid UTF-8 (a text job's output; text has no magic bytes), else None."""
    found = sniff(data)
    if found is not None:
        return found
    try:
        data.decode("utf-8", errors="strict")
    except UnicodeDecodeError:
        return None
    return "text/plain"


def check_result(data: bytes, media_type: str, max_pixels: int = MAX_INPUT_PIXELS) -> None:
    """Decode a worker's result of ``media_type`` (sniffed) before it is stored (R2): an image
    completely, every frame, within ``max_pixels`` (the inputs' limit); an MP4 by parsing its
    container and decoding its video stream with ffmpeg (at least one frame).

    Raises:
        Rejected: reason ``result_invalid``, naming what did not decode (a decompression bomb,
            a truncated file, a polyglot whose magic bytes lie).
    """
    if media_type.startswith("image/"):
        try:
            check_decodes(data, media_type, max_pixels)
        except Rejected as error:
            raise Rejected(f"result: {error.message}", reason="result_invalid") from error
        return
    if media_type == "video/mp4":
        check_video(data)
        return
    if media_type == "text/plain":  # sniff_result decoded it as UTF-8 already
        return
    raise Rejected(f"result: no decoder for {media_type}", reason="result_invalid")


VIDEO_CHECK_S = 120.0  # at most this long decoding one result video


def check_video(data: bytes) -> None:
    """Parse an MP4's container and decode its first video stream with the ffmpeg binary of
    imageio-ffmpeg, stopping at the first error (``-xerror``): a truncated file or one whose
    magic bytes lie fails; a complete one decodes silently.

    Raises:
        Rejected: reason ``result_invalid``, with ffmpeg's last error line.
    """
    import subprocess
    import tempfile

    import imageio_ffmpeg

    with tempfile.NamedTemporaryFile(suffix=".mp4") as handle:
        handle.write(data)
        handle.flush()
        command = [
            imageio_ffmpeg.get_ffmpeg_exe(),
            "-nostdin",
            "-v",
            "error",
            "-xerror",
            "-i",
            handle.name,
            "-map",
            "0:v:0",
            "-f",
            "null",
            "-",
        ]
        try:
            done = subprocess.run(command, capture_output=True, timeout=VIDEO_CHECK_S, check=False)
        except (OSError, subprocess.TimeoutExpired) as error:
            raise Rejected(f"result: the MP4 could not be decoded ({error})", reason="result_invalid") from error
    if done.returncode != 0 or done.stderr.strip():
        lines = done.stderr.decode(errors="replace").strip().splitlines()
        raise Rejected(
            f"result: not a complete MP4 video (ffmpeg: {lines[-1][:200] if lines else done.returncode})",
            reason="result_invalid",
        )
