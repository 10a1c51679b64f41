"""Result verification and content-addressed storage (R2)."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from PIL import Image

from app.core.digest import bytes_digest
from app.core.errors import IntegrityFailure
from app.store.files import ResultStore
from app.store.media import sniff
from tests.helpers import png_claiming


def png(color: tuple[int, int, int] = (200, 10, 10)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (8, 8), color).save(buffer, format="PNG")
    return buffer.getvalue()


def stored_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file()] if root.exists() else []


def test_r2_a_verified_result_is_stored_under_its_digest(tmp_path: Path) -> None:
    data = png()
    stored = ResultStore(tmp_path, 1_000_000).store(data, bytes_digest(data))
    assert stored.media_type == "image/png"
    assert stored.path.read_bytes() == data
    assert stored.path.name == f"{bytes_digest(data).split(':')[1]}.png"
    assert stored_files(tmp_path) == [stored.path]


@pytest.mark.parametrize("kind", ["other_digest", "malformed_digest", "not_media", "too_large"])
def test_r2_a_result_that_fails_a_check_stores_nothing(tmp_path: Path, kind: str) -> None:
    data, digest, limit = png(), bytes_digest(png()), 1_000_000
    if kind == "other_digest":
        digest = bytes_digest(png((0, 0, 0)))
    elif kind == "malformed_digest":
        digest = "md5:abc"
    elif kind == "not_media":
        data = b"#!/bin/sh\necho not an image\n"
        digest = bytes_digest(data)
    else:
        limit = len(data) - 1
    with pytest.raises(IntegrityFailure) as refused:
        ResultStore(tmp_path, limit).store(data, digest)
    assert refused.value.reason == "integrity"
    assert stored_files(tmp_path) == []


@pytest.mark.parametrize(
    ("head", "media_type"),
    [
        (b"\x89PNG\r\n\x1a\n" + b"\0" * 8, "image/png"),
        (b"RIFF\0\0\0\0WEBPVP8 ", "image/webp"),
        (b"GIF89a" + b"\0" * 8, "image/gif"),
        (b"\0\0\0\x18ftypisom", "video/mp4"),
        (b"\xff\xd8\xff\xe0\0\x10JFIF", "image/jpeg"),
        (b"<html></html>", None),
    ],
)
def test_media_type_comes_from_magic_bytes(head: bytes, media_type: str | None) -> None:
    assert sniff(head) == media_type


def gif(frames: int = 3) -> bytes:
    images = [Image.new("P", (8, 8), index) for index in range(frames)]
    buffer = io.BytesIO()
    images[0].save(buffer, format="GIF", save_all=True, append_images=images[1:])
    return buffer.getvalue()


@pytest.mark.parametrize("kind", ["bomb", "truncated", "png_html_polyglot", "gif_html_polyglot", "truncated_gif"])
def test_a_result_that_does_not_decode_is_result_invalid_and_stores_nothing(tmp_path: Path, kind: str) -> None:
    """R2: results are decoded as inputs are, with the inputs' pixel limit:
    a 30000 x 30000 PNG header, a PNG cut in half, PNG or GIF magic bytes before HTML, a GIF
    whose last frame is cut off."""
    data = {
        "bomb": png_claiming(30000, 30000),
        "truncated": png()[: len(png()) // 2],
        "png_html_polyglot": b"\x89PNG\r\n\x1a\n<html><script>alert(1)</script></html>",
        "gif_html_polyglot": b"GIF89a<html><script>alert(1)</script></html>",
        "truncated_gif": gif()[:-20],
    }[kind]
    with pytest.raises(IntegrityFailure) as refused:
        ResultStore(tmp_path, 10_000_000).store(data, bytes_digest(data))
    assert refused.value.reason == "result_invalid"
    assert refused.value.message.startswith("result: ")
    if kind == "bomb":
        assert (
            refused.value.message
            == f"result: image is 30000 x 30000 = 900000000 pixels; the limit is {4096 * 4096} pixels"
        )
    assert stored_files(tmp_path) == []


def test_an_animated_gif_result_decodes_and_is_stored(tmp_path: Path) -> None:
    data = gif()
    assert ResultStore(tmp_path, 1_000_000).store(data, bytes_digest(data)).media_type == "image/gif"


def test_a_text_jobs_result_must_be_utf8_text_and_only_a_text_job_may_store_text(tmp_path: Path) -> None:
    """R2: text has no magic bytes; a text job's result is stored as ``text/plain``
    when it is valid UTF-8; invalid UTF-8 is refused, and an image job cannot pass text off."""
    text = "héllo".encode()
    stored = ResultStore(tmp_path, 1000).store(text, bytes_digest(text), text=True)
    assert stored.media_type == "text/plain" and stored.path.suffix == ".txt"
    for data, is_text in ((b"\xff\xfe not utf-8", True), (text, False)):
        with pytest.raises(IntegrityFailure) as refused:
            ResultStore(tmp_path, 1000).store(data, bytes_digest(data), text=is_text)
        assert refused.value.reason == "integrity"
