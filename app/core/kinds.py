"""What each job kind takes besides its prompt, checked at submission before anything is
queued (R22): which keys it accepts at all (its runner's ``PARAMS`` in ``tasks/kinds``), which
params name uploaded input files, the video formats, and the most frames a video model's own
config allows (:func:`model_max_frames`; the submission's ``max_frames`` is the lower of it and
the family's, ``app/jobs/dispatch.py``).

The checks here are per kind; a reference to an input file must name a file that was
uploaded (``POST /v1/files``), so a worker never claims a job whose input does not exist, and
that file must fit its model family's upload limits (``POST /v1/files`` knows no model).
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from app.core.errors import NotFound, Rejected
from app.store.inputs import InputStore, StoredInput
from tasks.kinds import kind_params

if TYPE_CHECKING:
    from app.core.limits import FamilyLimits

#: kind -> params that hold the id ("blake3:<hex>") of an uploaded input file
INPUT_FIELDS: dict[str, tuple[str, ...]] = {"edit": ("image",), "upscale": ("image",)}
VIDEO_FORMATS: tuple[str, ...] = ("mp4", "webp", "gif")
MAX_SEED = 2**63 - 1  # torch.Generator.manual_seed takes a 64-bit seed; JSON clients keep 63 bits exact
#: params the server adds after the checks for kinds whose output size follows their input image
#: (:func:`output_size`, pixels); a client may send them back (params copied from ``GET /v1/jobs/{id}``)
#: and the server replaces them
OUTPUT_SIZE_FIELDS: tuple[str, ...] = ("output_width", "output_height")


#: kind -> (param, low, high, integer?) for the numbers each kind passes to its pipeline
NUMBERS: dict[str, tuple[tuple[str, float, float, bool], ...]] = {
    "txt2img": (("guidance_scale", 0.0, 50.0, False),),
    "video": (("guidance_scale", 0.0, 50.0, False), ("fps", 1.0, 60.0, False)),
    "edit": (("guidance_scale", 0.0, 50.0, False), ("image_guidance_scale", 0.0, 50.0, False)),
    # noise_level: the x4 upscaler's scheduler config, max_noise_level = 350
    "upscale": (("guidance_scale", 0.0, 50.0, False), ("noise_level", 0, 350, True)),
}


def check_numbers(kind: str, params: Mapping[str, Any]) -> None:
    """Refuse a number param of ``kind`` that is not a finite number in its range.

    Raises:
        Rejected: reason ``invalid_params``, naming the field, the value and the range.
    """
    for name, low, high, integer in NUMBERS.get(kind, ()):
        if name not in params:
            continue
        value = params[name]
        kinds_ok = (int,) if integer else (int, float)
        if (not isinstance(value, kinds_ok) or isinstance(value, bool) or not math.isfinite(value)
                or not low <= value <= high):
            wanted = "an integer" if integer else "a number"
            raise Rejected(f"params.{name} must be {wanted} from {low:g} to {high:g}, got {value!r}",
                           reason="invalid_params")


def accepted_params(kind: str) -> tuple[str, ...]:
    """Every key ``params`` of ``kind`` may hold: the params its runner reads
    (``tasks/kinds/<kind>.py``, ``PARAMS``), plus :data:`OUTPUT_SIZE_FIELDS` for kinds whose output
    size follows their input image (the server sets those).

    Raises:
        KeyError: ``kind`` is not implemented (the message names the implemented kinds).
    """
    return kind_params(kind) + (OUTPUT_SIZE_FIELDS if kind in INPUT_FIELDS else ())


def check_known_params(kind: str, params: Mapping[str, Any]) -> None:
    """Refuse keys of ``params`` that ``kind`` does not use, instead of ignoring them (R22):
    ``{"prompt": "x", "stepz": 4}`` would otherwise run with the default steps.

    Raises:
        Rejected: reason ``unknown_param``, naming each unknown key and listing the params
            ``kind`` takes; reason ``kind_not_supported`` when ``kind`` is not implemented.
    """
    try:
        accepted = accepted_params(kind)
    except KeyError as error:
        raise Rejected(str(error.args[0]), reason="kind_not_supported") from error
    unknown = [name for name in params if name not in accepted]
    if unknown:
        named = ", ".join(f"params.{name}" for name in unknown)
        verb = "is not a param" if len(unknown) == 1 else "are not params"
        takes = ", ".join(name for name in accepted if name not in OUTPUT_SIZE_FIELDS)
        raise Rejected(f"{named} {verb} of kind {kind!r}; it takes {takes}", reason="unknown_param",
                       param=f"params.{unknown[0]}")


def input_fields(kind: str) -> tuple[str, ...]:
    """The params of ``kind`` that name uploaded files (empty for txt2img and video)."""
    return INPUT_FIELDS.get(kind, ())


def check_input_upload(field: str, stored: StoredInput, limits: FamilyLimits) -> None:
    """Refuse an uploaded input that a job names in ``params.<field>`` when its model family
    does not take it (R22): more than ``max_upload_bytes`` bytes, or a media type (sniffed at
    upload) not in ``upload_media_types``. ``POST /v1/files`` knows no model and checks only
    the global ``max_input_bytes``; the family's limits apply here, at submission.

    Raises:
        Rejected: reason ``invalid_<field>`` as ``POST /v1/images/edits`` refuses the same
            upload (:func:`app.core.limits.check_upload`), param ``params.<field>``; the message
            names the param, the limit and the value.
    """
    from app.core.limits import check_upload  # app.core.limits imports this module

    try:
        check_upload(stored.size_bytes, stored.media_type, limits, field)
    except Rejected as error:
        raise Rejected(f"params.{field}: {error.message}", reason=error.reason, param=f"params.{field}") from error


def check_kind_params(kind: str, params: Mapping[str, Any], inputs: InputStore,
                      limits: FamilyLimits | None = None) -> None:
    """Refuse params ``kind`` cannot run with, naming the field, the value and the limit.
    With ``limits`` (the model family's), each input file must also fit its upload limits
    (:func:`check_input_upload`).

    Raises:
        Rejected: a missing or unknown input file (reason ``invalid_params``/``unknown_file``),
            an input file over the family's ``max_upload_bytes`` or of a media type not in its
            ``upload_media_types`` (reason ``invalid_<field>``), a prompt missing where one is
            required, a bad video format or frame count, a seed that is not an integer from 0
            to 2**63-1.
    """
    seed = params.get("seed")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed <= MAX_SEED):
        raise Rejected(f"params.seed must be an integer from 0 to {MAX_SEED}, got {seed!r}", reason="invalid_params")
    check_numbers(kind, params)
    for field in input_fields(kind):
        value = params.get(field)
        if not isinstance(value, str) or not value:
            raise Rejected(f"params.{field} is required for kind {kind!r}: the id of a file uploaded with "
                           f"POST /v1/files, got {value!r}", reason="invalid_params")
        try:
            stored = inputs.get(value)
        except (Rejected, NotFound) as error:  # a refusal of the submission, naming the field
            raise Rejected(f"params.{field}: {error.message}", reason=error.reason) from error
        if limits is not None:
            check_input_upload(field, stored, limits)
        if kind in ("edit", "upscale"):  # the pipelines round other sides down: the output would not be as journaled
            width, height = image_size(stored.path)
            if width % 8 or height % 8:
                raise Rejected(f"params.{field}: the image to {kind} must have a width and height that are multiples "
                               f"of 8 pixels, got {width}x{height}", reason="invalid_params")
    if kind in ("txt2img", "edit", "video") and not str(params.get("prompt") or "").strip():
        raise Rejected(f"params.prompt is required for kind {kind!r}", reason="invalid_params")
    if kind == "video":
        fmt = params.get("format", "mp4")
        if fmt not in VIDEO_FORMATS:
            raise Rejected(f"params.format must be one of {', '.join(VIDEO_FORMATS)}, got {fmt!r}",
                           reason="invalid_params")


def model_max_frames(folder: Path) -> int | None:
    """The most frames a video model's motion modules take: ``motion_max_seq_length`` in its
    ``motion_adapter`` (else ``unet``) config.json (AnimateDiff: 32), or None when its config
    names no such limit (or cannot be read: the worker's file check, R5, reports that). Read
    again whenever a config file's size or modification time changes."""
    for component in ("motion_adapter", "unet"):
        path = folder / component / "config.json"
        try:
            stat = path.stat()
        except OSError:
            continue
        limit = _motion_max_seq_length(path, stat.st_mtime_ns, stat.st_size)
        if limit is not None:
            return limit
    return None


@functools.lru_cache(maxsize=256)
def _motion_max_seq_length(path: Path, _mtime_ns: int, _size: int) -> int | None:
    try:
        limit = json.loads(path.read_text()).get("motion_max_seq_length")
    except (OSError, ValueError, AttributeError):
        return None
    return limit if isinstance(limit, int) and limit > 0 else None


UPSCALE_FACTOR = 4  # StableDiffusionUpscalePipeline: 4 x width, 4 x height (tasks/kinds/upscale.py)


def output_size(kind: str, params: Mapping[str, Any], inputs: InputStore) -> dict[str, int]:
    """``{"output_width": W, "output_height": H}`` in pixels for kinds whose output size follows
    their input image (edit: the input's size; upscale: 4x per side), else ``{}``. Placement
    prices a job's run time and memory by its output pixels (routing.timings.job_size).
    Call after :func:`check_kind_params` (the input must exist)."""
    if kind not in INPUT_FIELDS:
        return {}
    width, height = image_size(inputs.get(str(params[INPUT_FIELDS[kind][0]])).path)
    factor = UPSCALE_FACTOR if kind == "upscale" else 1
    return {"output_width": width * factor, "output_height": height * factor}


def image_size(path: Path) -> tuple[int, int]:
    """(width, height) in pixels, read from the image header only.

    Raises:
        Rejected: the stored file is not a readable image (reason ``input_corrupt``; uploads are
            decoded completely since they are checked, app/store/inputs.py).
    """
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as image:
            return image.size
    except (OSError, UnidentifiedImageError, Image.DecompressionBombError) as error:
        raise Rejected(f"params.image: the uploaded file is not a readable image ({error}); upload it again",
                       reason="input_corrupt") from error
