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
