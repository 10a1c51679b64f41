"""Uploaded inputs: content-digest ids, size and type limits (issue 7, R22)."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from PIL import Image

from app.digest import bytes_digest
from app.errors import NotFound, Rejected
from app.inputs import InputStore
from app.kind_params import check_kind_params


def image_bytes(size: tuple[int, int], fmt: str = "PNG") -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, (10, 200, 30)).save(buffer, format=fmt)
    return buffer.getvalue()


def test_an_upload_is_stored_under_its_content_digest_once(tmp_path: Path) -> None:
    store = InputStore(tmp_path, max_input_bytes=1_000_000)
    data = image_bytes((16, 16), "JPEG")
    first, second = store.add(data), store.add(data)
    assert first == second and first.id == bytes_digest(data) and first.media_type == "image/jpeg"
    assert first.path.read_bytes() == data and store.get(first.id) == first


def test_r22_uploads_over_the_limit_or_of_another_type_store_nothing(tmp_path: Path) -> None:
    store = InputStore(tmp_path, max_input_bytes=100)
    with pytest.raises(Rejected, match=r"the limit \(max_input_bytes\) is 100") as too_big:
        store.add(image_bytes((64, 64)) + bytes(100))
    assert too_big.value.reason == "input_too_large"
    with pytest.raises(Rejected, match="must be one of image/png, image/jpeg, image/webp") as wrong:
        store.add(b"GIF89a....")
    assert wrong.value.reason == "input_type"
    assert not any(p.is_file() for p in tmp_path.rglob("*"))


def test_unknown_or_malformed_file_ids_are_refused(tmp_path: Path) -> None:
    store = InputStore(tmp_path, max_input_bytes=1000)
    with pytest.raises(NotFound, match="POST /v1/files"):
        store.get(bytes_digest(b"nothing"))
    with pytest.raises(Rejected, match="64 lowercase hex"):
        store.get("sha256:abc")


def test_r22_kind_params_name_the_field_and_the_limit(tmp_path: Path) -> None:
    store = InputStore(tmp_path, max_input_bytes=1_000_000)
    odd = store.add(image_bytes((20, 16))).id
    with pytest.raises(Rejected, match=r"params.image is required for kind 'edit'"):
        check_kind_params("edit", {"prompt": "x"}, store)
    with pytest.raises(Rejected, match=r"params.image: .*multiples of 8 pixels, got 20x16"):
        check_kind_params("edit", {"prompt": "x", "image": odd}, store)
    check_kind_params("upscale", {"image": odd}, store)  # the upscaler takes any size
    with pytest.raises(Rejected, match=r"params.frames must be an integer from 1 to 32, got 33"):
        check_kind_params("video", {"prompt": "x", "frames": 33}, store)
    with pytest.raises(Rejected, match=r"params.format must be one of mp4, webp, gif, got 'avi'"):
        check_kind_params("video", {"prompt": "x", "format": "avi"}, store)
    with pytest.raises(Rejected, match=r"params.seed must be an integer from 0 to 9223372036854775807, got '7'"):
        check_kind_params("txt2img", {"prompt": "x", "seed": "7"}, store)
