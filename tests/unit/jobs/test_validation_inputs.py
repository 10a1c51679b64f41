"""Uploaded inputs: content-digest ids, size and type limits (R22)."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import pytest
from PIL import Image

from app.core.digest import bytes_digest
from app.core.errors import NotFound, Rejected
from app.core.limits import FamilyLimits
from app.jobs.validation import check_kind_params, model_max_frames, output_size
from app.store.files import InputStore


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
    with pytest.raises(Rejected, match=r"params.image is required for kind 'edit'") as missing:
        check_kind_params("edit", {"prompt": "x"}, store)
    assert missing.value.param == "params.image"  # the refusal names the field (docs/api.md, errors)
    # Sides that are not multiples of 8 are drawn at the nearest ones (tasks/kinds DrawnInput).
    check_kind_params("edit", {"prompt": "x", "image": odd}, store)
    check_kind_params("upscale", {"image": odd}, store)
    assert output_size("upscale", {"image": odd}, store) == {"output_width": 80, "output_height": 64}
    with pytest.raises(Rejected, match=r"params.format must be one of mp4, webp, gif, got 'avi'"):
        check_kind_params("video", {"prompt": "x", "format": "avi"}, store)
    with pytest.raises(Rejected, match=r"params.seed must be an integer from 0 to 9223372036854775807, got '7'"):
        check_kind_params("txt2img", {"prompt": "x", "seed": "7"}, store)


def test_r22_a_job_input_must_fit_its_model_familys_upload_limits(tmp_path: Path) -> None:
    store = InputStore(tmp_path, max_input_bytes=1_000_000)  # POST /v1/files: the global limit only
    jpeg = store.add(image_bytes((16, 16), "JPEG"))
    params = {"prompt": "x", "image": jpeg.id}
    check_kind_params("edit", params, store, FamilyLimits())
    small = FamilyLimits(max_upload_bytes=100)
    with pytest.raises(
        Rejected,
        match=rf"params\.image: `image` must be at most 100 bytes \(max_upload_bytes\), "
        rf"got {jpeg.size_bytes}",
    ) as too_big:
        check_kind_params("edit", params, store, small)
    png_only = FamilyLimits(upload_media_types=["image/png"])
    with pytest.raises(
        Rejected,
        match=r"params\.image: `image` must be one of image/png \(upload_media_types\), "
        r"got 'image/jpeg'",
    ) as wrong_type:
        check_kind_params("upscale", {"image": jpeg.id}, store, png_only)
    for refused in (too_big.value, wrong_type.value):  # as POST /v1/images/edits refuses the same upload
        assert (refused.reason, refused.param) == ("invalid_image", "params.image")


@pytest.mark.parametrize(
    ("data", "reason", "message"),
    [
        (image_bytes((64, 64))[:60], "input_corrupt", "not a complete image/png image"),  # truncated after the header
        (
            b"\x89PNG\r\n\x1a\n" + bytes(200),
            "input_corrupt",
            "not a complete image/png image",
        ),  # magic bytes, then garbage
        (image_bytes((4104, 4096)), "input_too_large", "4104 x 4096 = 16809984 pixels; the limit is 16777216"),
    ],
)
def test_r22_uploads_that_do_not_decode_or_hold_too_many_pixels_store_nothing(
    tmp_path: Path, data: bytes, reason: str, message: str
) -> None:
    store = InputStore(tmp_path, max_input_bytes=50_000_000)
    with pytest.raises(Rejected, match=message) as refused:
        store.add(data)
    assert refused.value.reason == reason
    assert not any(p.is_file() for p in tmp_path.rglob("*"))


def test_r22_an_upload_pillow_refuses_as_a_bomb_names_its_size_and_our_limit_only(tmp_path: Path) -> None:
    """Over 89,478,485 pixels Pillow refuses the file at open, naming its own limit; the client
    sees only the upload's size and the limit Homefleet applies."""
    from PIL import Image

    out = io.BytesIO()
    Image.new("1", (10_000, 10_000)).save(out, format="PNG")  # 100,000,000 pixels in a few kB
    store = InputStore(tmp_path, max_input_bytes=50_000_000)
    with pytest.raises(Rejected) as refused:
        store.add(out.getvalue())
    assert refused.value.reason == "input_too_large"
    assert refused.value.message == "image is 10000 x 10000 = 100000000 pixels; the limit is 16777216 pixels"
    assert not any(p.is_file() for p in tmp_path.rglob("*"))


def test_r22_a_stored_file_that_does_not_read_is_refused_naming_the_field(tmp_path: Path) -> None:
    store = InputStore(tmp_path, max_input_bytes=1_000_000)
    stored = store.add(image_bytes((16, 16)))
    stored.path.write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(50))  # damaged on the server's disk after the upload
    with pytest.raises(Rejected, match=r"params\.image: the uploaded file is not a readable image") as refused:
        check_kind_params("edit", {"prompt": "x", "image": stored.id}, store)
    assert refused.value.reason == "input_corrupt"


@pytest.mark.parametrize(
    ("kind", "params", "message"),
    [
        ("txt2img", {"guidance_scale": "x"}, r"params\.guidance_scale must be a number from 0 to 50, got 'x'"),
        ("txt2img", {"guidance_scale": float("nan")}, r"params\.guidance_scale must be a number from 0 to 50, got nan"),
        ("txt2img", {"guidance_scale": 1e308}, r"params\.guidance_scale must be a number from 0 to 50, got 1e\+308"),
        ("video", {"fps": 0}, r"params\.fps must be a number from 1 to 60, got 0"),
        ("edit", {"image_guidance_scale": "big"}, r"params\.image_guidance_scale must be a number from 0 to 50"),
        ("upscale", {"noise_level": "loud"}, r"params\.noise_level must be an integer from 0 to 350, got 'loud'"),
        ("upscale", {"noise_level": 351}, r"params\.noise_level must be an integer from 0 to 350, got 351"),
    ],
)
def test_r22_number_params_are_finite_and_in_range(tmp_path: Path, kind: str, params: dict, message: str) -> None:
    store = InputStore(tmp_path, max_input_bytes=1_000_000)
    with pytest.raises(Rejected, match=message) as refused:
        check_kind_params(kind, {"prompt": "x", **params}, store)
    assert refused.value.reason == "invalid_params"


def test_r22_a_video_models_frame_limit_is_its_own_config(tmp_path: Path) -> None:
    """The frame limit of a video model is its motion modules' motion_max_seq_length (AnimateDiff's
    MotionAdapter config: 32), not one number for every video model; read again when it changes."""
    video, image = tmp_path / "video", tmp_path / "image"
    (video / "motion_adapter").mkdir(parents=True)
    (image / "unet").mkdir(parents=True)
    config = video / "motion_adapter" / "config.json"
    config.write_text(json.dumps({"_class_name": "MotionAdapter", "motion_max_seq_length": 32}))
    (image / "unet" / "config.json").write_text(json.dumps({"_class_name": "UNet2DConditionModel"}))
    assert model_max_frames(video) == 32
    assert model_max_frames(image) is None  # no motion modules: no such limit
    config.write_text(json.dumps({"_class_name": "MotionAdapter", "motion_max_seq_length": 24}))
    os.utime(config, ns=(1, 1))  # another modification time: read again
    assert model_max_frames(video) == 24
