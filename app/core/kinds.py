"""What each job kind accepts, in one place: one :class:`KindSpec` per kind that the server's
validation (``app/jobs/validation.py``, R22), placement's defaults (:func:`job_request`) and
the worker's runner (``tasks/kinds/<kind>.py``, through :meth:`KindSpec.args`) all read.

A spec names every param its runner reads, their defaults, the numeric ranges checked at
submission, the params that name uploaded input files, whether a prompt is required, how the
output's size follows from the params, and the formats a kind can write.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from routing.placement import JobRequest
from routing.timings import job_size

MAX_SEED = 2**63 - 1
"""torch.Generator.manual_seed takes a 64-bit seed; JSON clients keep 63 bits exact."""

OUTPUT_SIZE_FIELDS: tuple[str, ...] = ("output_width", "output_height")
"""Params the server adds for kinds whose output size follows their input image (pixels);
a client may send them back (params copied from ``GET /v1/jobs/{id}``) and the server
replaces them."""

DENOISING_PARAMS: tuple[str, ...] = ("steps", "guidance_scale", "seed")
"""The params every denoising kind reads (``tasks.kinds.denoising``)."""


@dataclass(frozen=True)
class NumberRange:
    """A number param checked at submission: ``low`` <= value <= ``high``, finite, an integer
    when ``integer``."""

    name: str
    low: float
    high: float
    integer: bool = False


@dataclass(frozen=True)
class KindSpec:
    """One job kind.

    Attributes:
        name: the kind, e.g. ``txt2img``.
        params: every param the runner reads (the server refuses any other key, R22).
        defaults: the value a runner uses when a param is absent (steps, sizes in pixels…).
        numbers: ranges of number params.
        inputs: params that hold the id (``"blake3:<hex>"``) of an uploaded input image.
        prompt_required: a submission without a non-blank ``prompt`` is refused.
        output_scale: None when the output's size comes from ``width``/``height``; otherwise
            the factor from the input image's sides to the output's (1: same size).
        formats: the output formats ``params.format`` may name (first: the default).
    """

    name: str
    params: tuple[str, ...]
    defaults: Mapping[str, Any] = field(default_factory=dict)
    numbers: tuple[NumberRange, ...] = ()
    inputs: tuple[str, ...] = ()
    prompt_required: bool = False
    output_scale: int | None = None
    formats: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "defaults", MappingProxyType(dict(self.defaults)))

    @property
    def accepted(self) -> tuple[str, ...]:
        """Every key ``params`` may hold: :attr:`params`, plus :data:`OUTPUT_SIZE_FIELDS` for
        kinds whose output follows their input (the server sets those)."""
        return self.params + (OUTPUT_SIZE_FIELDS if self.output_scale is not None else ())

    def args(self, params: Mapping[str, Any]) -> Args:
        """``params`` as the runner reads them: a declared param's value, else its default."""
        return Args(self, params)

    def value(self, params: Mapping[str, Any], name: str) -> Any:
        """``params[name]``, else the default (None when there is none)."""
        return params[name] if name in params else self.defaults.get(name)


class Args(Mapping[str, Any]):
    """A job's params as its runner reads them. Reading a param the spec does not declare raises
    ``KeyError`` (so a runner can never read what the server did not check); a declared param
    without a value and without a default is missing (``get`` returns None). ``read`` records
    what was read."""

    def __init__(self, spec: KindSpec, params: Mapping[str, Any]) -> None:
        self.spec = spec
        self._params = params
        self.read: set[str] = set()

    def _declared(self, name: str) -> None:
        if name not in self.spec.params:
            raise KeyError(f"kind {self.spec.name!r} reads {name!r}, which its spec does not list "
                           f"(app/core/kinds.py); it lists {', '.join(self.spec.params)}")
        self.read.add(name)

    def get(self, name: str, default: Any = None) -> Any:
        """The value of a declared param, else its default, else ``default``; an undeclared one raises."""
        self._declared(name)
        return self[name] if name in self._params or name in self.spec.defaults else default

    def __getitem__(self, name: str) -> Any:
        self._declared(name)
        if name in self._params:
            return self._params[name]
        if name in self.spec.defaults:
            return self.spec.defaults[name]
        raise KeyError(name)

    def __iter__(self) -> Iterator[str]:
        return iter(name for name in self.spec.params if name in self._params or name in self.spec.defaults)

    def __len__(self) -> int:
        return sum(1 for _ in self)


_GUIDANCE = NumberRange("guidance_scale", 0.0, 50.0)
_DENOISING_DEFAULTS = {"steps": 4, "guidance_scale": 7.5}

KINDS: dict[str, KindSpec] = {spec.name: spec for spec in (
    KindSpec(
        "txt2img", params=("prompt", "negative_prompt", "width", "height", *DENOISING_PARAMS),
        defaults={**_DENOISING_DEFAULTS, "width": 64, "height": 64}, numbers=(_GUIDANCE,), prompt_required=True,
    ),
    KindSpec(
        "edit", params=("image", "prompt", "negative_prompt", "image_guidance_scale", *DENOISING_PARAMS),
        defaults={**_DENOISING_DEFAULTS, "image_guidance_scale": 1.5},
        numbers=(_GUIDANCE, NumberRange("image_guidance_scale", 0.0, 50.0)),
        inputs=("image",), prompt_required=True, output_scale=1,
    ),
    KindSpec(
        # noise_level: the x4 upscaler's scheduler config, max_noise_level = 350
        "upscale", params=("image", "prompt", "negative_prompt", "noise_level", *DENOISING_PARAMS),
        defaults={**_DENOISING_DEFAULTS, "prompt": "", "guidance_scale": 9.0, "noise_level": 20},
        numbers=(_GUIDANCE, NumberRange("noise_level", 0, 350, integer=True)),
        inputs=("image",), output_scale=4,  # StableDiffusionUpscalePipeline: 4 x width, 4 x height
    ),
    KindSpec(
        "video", params=("prompt", "negative_prompt", "width", "height", "frames", "fps", "format", *DENOISING_PARAMS),
        defaults={**_DENOISING_DEFAULTS, "width": 64, "height": 64, "frames": 8, "fps": 8, "format": "mp4"},
        numbers=(_GUIDANCE, NumberRange("fps", 1.0, 60.0)), prompt_required=True, formats=("mp4", "webp", "gif"),
    ),
)}


def spec(kind: str) -> KindSpec:
    """The spec of ``kind``.

    Raises:
        KeyError: ``kind`` is not implemented (the message names the implemented kinds).
    """
    if kind not in KINDS:
        raise KeyError(f"kind {kind!r} is not implemented; implemented: {', '.join(KINDS)}")
    return KINDS[kind]


def _number(params: Mapping[str, Any], name: str, default: int) -> int:
    value = params.get(name, default)
    return int(value) if isinstance(value, int | float | str) and str(value).lstrip("-").isdigit() else default


def job_request(model_id: str, family: str, kind: str, target: str, params: Mapping[str, Any]) -> JobRequest:
    """The placement request of a job: its steps, and its size (pixels x frames x batch,
    ``routing.timings.job_size``) from ``output_width`` x ``output_height`` (set by the server
    for kinds whose output follows an input image), else ``width`` x ``height``, and
    ``frames``; each absent one at the family's default for the kind (``app/core/families.py``;
    an unknown kind: txt2img's)."""
    from app.core.families import kind_spec as family_spec  # families builds on this module

    kind_spec = family_spec(family, kind) if kind in KINDS else KINDS["txt2img"]
    width = _number(params, "output_width", _number(params, "width", kind_spec.defaults.get("width", 64)))
    height = _number(params, "output_height", _number(params, "height", kind_spec.defaults.get("height", 64)))
    frames = _number(params, "frames", kind_spec.defaults.get("frames", 1))
    steps = _number(params, "steps", kind_spec.defaults.get("steps", 4))
    return JobRequest(model_id, family, kind, target, steps=steps, size=job_size(width * height, frames))
