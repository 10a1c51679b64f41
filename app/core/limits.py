"""Validate before the GPU (R22): per-family limits and the one check every submission passes
before any side effect (STYLE.md #8).

:func:`check_submission` reads plain params and a :class:`FamilyLimits` and raises
:class:`~app.core.errors.Rejected` (422) whose message names the field, the value, the limit and
the fix; ``reason`` is ``invalid_<field>`` so that rejections can be counted by reason.
Prompt length is counted in tokens with the model's own tokenizer (:class:`PromptTokenizers`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from app.core.errors import Rejected
from app.core.kinds import check_known_params

DEFAULT_FAMILY = "default"
PROMPT_KINDS = frozenset({"txt2img"})  # kinds that cannot run without a prompt


class FamilyLimits(BaseModel):
    """Limits of one model family. Pixels are width x height of one image or frame. A key that
    is not one of these fields is refused (a misspelt limit would otherwise be ignored)."""

    model_config = ConfigDict(extra="forbid")

    multiple_of: int = Field(8, ge=1)  # width and height (the VAE downsamples by 8; diffusers' check_inputs)
    min_side: int = Field(8, ge=1)  # pixels
    max_pixels: int = Field(1024 * 1024, ge=1)  # width x height
    max_steps: int = Field(150, ge=1)
    max_frames: int = Field(64, ge=1)
    max_batch: int = Field(4, ge=1)  # images per OpenAI request (`n`: one job per image)
    max_prompt_tokens: int = Field(77, ge=1)  # CLIP text encoders: max_position_embeddings = 77
    max_prompt_chars: int = Field(4096, ge=1)  # checked before tokenizing (a huge prompt is cheap to refuse)
    max_upload_bytes: int = Field(16 * 1024 * 1024, ge=1)
    upload_media_types: list[str] = Field(default_factory=lambda: ["image/png", "image/jpeg", "image/webp"])


def default_limits() -> dict[str, FamilyLimits]:
    """The built-in limits: one ``default`` entry (SD 1.x-sized); override per family in settings,
    e.g. ``HOMEFLEET_LIMITS='{"sd1": {"max_pixels": 262144}}'``."""
    return {DEFAULT_FAMILY: FamilyLimits()}


def limits_for(limits: Mapping[str, FamilyLimits], family: str) -> FamilyLimits:
    """The limits of ``family``, else ``default``, else the built-in defaults."""
    return limits.get(family) or limits.get(DEFAULT_FAMILY) or FamilyLimits()


def _integer(params: Mapping[str, Any], name: str, default: int | None) -> int | None:
    value = params.get(name, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer() and abs(value) <= 2**53:  # exactly an integer
            return int(value)
        raise Rejected(f"`{name}` must be an integer, got {value!r}", reason=f"invalid_{name}")
    return value


INTEGER_PARAMS: tuple[str, ...] = ("width", "height", "steps", "frames", "n")
"""Params that :func:`check_submission` takes as integers, also when a JSON client sends an
integer-valued float (``512.0``)."""


def integer_params(params: Mapping[str, Any]) -> dict[str, int]:
    """The :data:`INTEGER_PARAMS` of ``params`` sent as integer-valued floats, as ints: what the
    server stores, prices and sends to the pipeline (``64.0`` frames are 64 frames, not 8)."""
    return {name: int(value) for name in INTEGER_PARAMS
            if isinstance(value := params.get(name), float) and value.is_integer() and abs(value) <= 2**53}


def _bounded(name: str, value: int | None, low: int, high: int, hint: str = "") -> None:
    if value is not None and not low <= value <= high:
        raise Rejected(f"`{name}` must be between {low} and {high}{hint}, got {value}", reason=f"invalid_{name}")


def check_submission(
    params: Mapping[str, Any], limits: FamilyLimits, count_tokens: Callable[[str], int] | None = None,
    kind: str | None = None,
) -> None:
    """Refuse a submission whose params exceed ``limits`` (R22). Pure: no side effect.

    With ``kind``, first refuses keys that kind does not use (:func:`~app.core.kinds.check_known_params`).
    Checks ``width``/``height`` (pixels, multiples of ``multiple_of``, product <= ``max_pixels``),
    ``steps``, ``frames`` (video) and ``n`` (images per OpenAI request), ``prompt``/``negative_prompt`` (tokens, counted with
    ``count_tokens``; strings required when present; ``prompt`` required for ``kind`` txt2img).

    Raises:
        Rejected: reason ``invalid_<field>``; the message names the field, value and limit.
            Reason ``unknown_param`` for a key ``kind`` does not use, naming it and the params
            ``kind`` takes.
    """
    if kind is not None:
        check_known_params(kind, params)
    prompt = params.get("prompt")
    if kind in PROMPT_KINDS and not prompt:
        raise Rejected(f"`prompt` is required for kind {kind}, got {prompt!r}", reason="invalid_prompt")
    if prompt is not None and not isinstance(prompt, str):
        raise Rejected(f"`prompt` must be a string, got {type(prompt).__name__}", reason="invalid_prompt")
    width, height = _integer(params, "width", None), _integer(params, "height", None)
    for name, side in (("width", width), ("height", height)):
        if side is None:
            continue
        if side < limits.min_side or side % limits.multiple_of:
            raise Rejected(
                f"`{name}` must be a multiple of {limits.multiple_of} and at least {limits.min_side} pixels, "
                f"got {side}", reason=f"invalid_{name}",
            )
    if width is not None or height is not None:
        pixels = (width or 64) * (height or 64)
        if pixels > limits.max_pixels:
            raise Rejected(
                f"`width` x `height` must be at most {limits.max_pixels} pixels, got {width} x {height} = {pixels}; "
                "ask for a smaller size", reason="invalid_size",
            )
    _bounded("steps", _integer(params, "steps", None), 1, limits.max_steps)
    _bounded("frames", _integer(params, "frames", None), 1, limits.max_frames)  # the video kind's name
    _bounded("n", _integer(params, "n", None), 1, limits.max_batch, " (max_batch)")
    for name in ("prompt", "negative_prompt"):
        text = params.get(name)
        if text is None:
            continue
        if not isinstance(text, str):
            raise Rejected(f"`{name}` must be a string, got {type(text).__name__}", reason=f"invalid_{name}")
        if len(text) > limits.max_prompt_chars:
            raise Rejected(f"`{name}` must be at most {limits.max_prompt_chars} characters (max_prompt_chars), "
                           f"got {len(text)}; shorten it", reason=f"invalid_{name}")
        if count_tokens is not None:
            tokens = count_tokens(text)
            if tokens > limits.max_prompt_tokens:
                raise Rejected(
                    f"`{name}` must be at most {limits.max_prompt_tokens} tokens (the model's tokenizer, "
                    f"with start and end tokens), got {tokens}; shorten it", reason=f"invalid_{name}",
                )


def check_output_pixels(width: int, height: int, limits: FamilyLimits, field: str = "image") -> None:
    """Refuse a job whose output (from its input image: an edit keeps the size, the x4 upscaler
    multiplies each side by 4) exceeds ``max_pixels``.

    Raises:
        Rejected: reason ``invalid_size``, naming the field, the output size and the limit.
    """
    if width * height > limits.max_pixels:
        raise Rejected(
            f"params.{field}: the output would be {width} x {height} = {width * height} pixels; the limit "
            f"(max_pixels) is {limits.max_pixels}; send a smaller image", reason="invalid_size",
        )


def check_upload(size_bytes: int, media_type: str, limits: FamilyLimits, field: str = "image") -> None:
    """Refuse an uploaded input over ``max_upload_bytes`` or of a media type not allowed.

    Raises:
        Rejected: reason ``invalid_<field>``, naming size or type and the limit.
    """
    if size_bytes > limits.max_upload_bytes:
        raise Rejected(f"`{field}` must be at most {limits.max_upload_bytes} bytes (max_upload_bytes), "
                       f"got {size_bytes}", reason=f"invalid_{field}")
    if media_type not in limits.upload_media_types:
        allowed = ", ".join(limits.upload_media_types)
        raise Rejected(f"`{field}` must be one of {allowed} (upload_media_types), got {media_type!r}",
                       reason=f"invalid_{field}")


class PromptTokenizers:
    """Each model's own tokenizer (``<model folder>/tokenizer``), loaded lazily with
    transformers and cached per model. A model without one counts no tokens (None)."""

    def __init__(self, folder_of: Callable[[str], Path]) -> None:
        self.folder_of = folder_of
        self._cache: dict[str, Any] = {}
        self._lock = threading.Lock()

    def counter(self, model_id: str) -> Callable[[str], int] | None:
        """``text -> number of tokens`` (with start/end tokens, untruncated), or None."""
        with self._lock:
            if model_id not in self._cache:
                self._cache[model_id] = self._load(model_id)
            tokenizer = self._cache[model_id]
        if tokenizer is None:
            return None
        return lambda text: len(tokenizer(text, truncation=False)["input_ids"])

    def _load(self, model_id: str) -> Any:
        folder = self.folder_of(model_id) / "tokenizer"
        if not folder.is_dir():
            return None
        from transformers import AutoTokenizer  # lazy: transformers costs seconds to import

        return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
