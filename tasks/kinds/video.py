"""video: text to a short clip (AnimateDiffPipeline: a 2D UNet plus a MotionAdapter; WanPipeline).

Params (``app/core/kinds.py``, each family's changes in ``app/core/families.py``): ``prompt``
(required), ``negative_prompt``, ``width`` and ``height`` (pixels, multiples of 8; Wan: 16),
``frames`` (AnimateDiff: at most its motion modules' ``motion_max_seq_length``; Wan: 4k+1,
default 33), ``fps`` (frames per second), ``steps``, ``guidance_scale``, ``format`` ("mp4" |
"webp" | "gif"), ``seed``. ``frames`` reaches both pipelines as ``num_frames``. Output: the
clip with exactly ``frames`` frames of width x height pixels.

MP4 is H.264 (libx264, yuv420p) written by the ffmpeg binary that the ``imageio-ffmpeg``
wheel ships; the provenance goes into the container's ``comment`` tag. When that binary is
missing (or ``format`` asks for it) the clip is an animated WebP (lossless, provenance in
XMP) or GIF (provenance in the comment extension). Encoding is made bit-exact (no encoder
version or time stamps), so the same seed on the same machine gives identical bytes.
"""

from __future__ import annotations

import io
import json
import logging
import os
import tempfile
from collections.abc import Mapping
from typing import Any

from app.core.kinds import family_kind_spec as kind_spec
from tasks.kinds import Output, ProgressFn, denoising, family_arguments

log = logging.getLogger("homefleet.worker")

KIND = "video"
MEDIA_TYPES = {"mp4": "video/mp4", "webp": "image/webp", "gif": "image/gif"}


def run(
    pipeline: Any,
    params: Mapping[str, Any],
    progress: ProgressFn,
    provenance: dict[str, Any],
    inputs: Mapping[str, bytes],
    family: str = "",
) -> Output:
    args = kind_spec(family, KIND).args(params)
    result = pipeline(
        prompt=str(args["prompt"]),
        negative_prompt=args.get("negative_prompt"),
        width=int(args["width"]),
        height=int(args["height"]),
        output_type="pil",
        **{"num_frames": int(args["frames"]), **family_arguments(args, family)},
        **denoising(args, progress),
    )
    frames = [frame.convert("RGB") for frame in result.frames[0]]
    fps = float(args["fps"])
    wanted = str(args["format"])
    if wanted == "mp4":
        try:
            return Output(data=mp4_bytes(frames, fps, provenance), media_type=MEDIA_TYPES["mp4"])
        except (ImportError, RuntimeError, OSError) as error:  # no ffmpeg binary, or it failed: fall back
            log.warning("MP4 encoding failed (%s: %s); writing an animated WebP instead", type(error).__name__, error)
            wanted = "webp"
    data = animated_bytes(frames, fps, provenance, wanted)
    return Output(data=data, media_type=MEDIA_TYPES[wanted])


def mp4_bytes(frames: list[Any], fps: float, provenance: dict[str, Any]) -> bytes:
    """Encode RGB PIL frames (all the same size) as H.264 MP4 with ``provenance`` as JSON in the
    ``comment`` tag. Raises ``ImportError`` without imageio-ffmpeg, ``RuntimeError``/``OSError``
    when ffmpeg fails."""
    import imageio_ffmpeg

    width, height = frames[0].size
    comment = json.dumps(provenance, sort_keys=True)
    fd, path = tempfile.mkstemp(suffix=".mp4", prefix="homefleet-")
    os.close(fd)
    try:
        writer = imageio_ffmpeg.write_frames(
            path,
            (width, height),
            fps=fps,
            codec="libx264",
            pix_fmt_out="yuv420p",
            macro_block_size=8,
            quality=None,
            ffmpeg_log_level="error",
            # bit-exact muxing: no encoder version string, no creation time (deterministic bytes)
            output_params=[
                "-crf",
                "18",
                "-metadata",
                f"comment={comment}",
                "-fflags",
                "+bitexact",
                "-flags:v",
                "+bitexact",
                "-movflags",
                "+faststart",
            ],
        )
        writer.send(None)
        for frame in frames:
            writer.send(frame.tobytes())
        writer.close()
        with open(path, "rb") as handle:
            return handle.read()
    finally:
        os.unlink(path)


def animated_bytes(frames: list[Any], fps: float, provenance: dict[str, Any], fmt: str) -> bytes:
    """Encode frames as an animated WebP (lossless, provenance in XMP) or GIF (provenance in
    its comment). Raises ``ValueError`` for another ``fmt``."""
    text = json.dumps(provenance, sort_keys=True)
    duration_ms = max(1, round(1000 / fps))
    buffer = io.BytesIO()
    common = {"save_all": True, "append_images": frames[1:], "duration": duration_ms, "loop": 0}
    if fmt == "webp":
        frames[0].save(buffer, format="WEBP", lossless=True, xmp=text.encode(), **common)
    elif fmt == "gif":
        frames[0].save(buffer, format="GIF", comment=text.encode(), **common)
    else:
        raise ValueError(f"video format must be mp4, webp or gif, got {fmt!r}")
    return buffer.getvalue()
