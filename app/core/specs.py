"""The shapes of a job kind's spec (:class:`KindSpec`, :class:`NumberRange`, :class:`Args`),
shared by the kinds (``app/core/kinds.py``) and the families that adjust them
(``app/core/families.py``)."""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

OUTPUT_SIZE_FIELDS: tuple[str, ...] = ("output_width", "output_height")
"""Params the server adds for kinds whose output size follows their input image (pixels);
a client may send them back (params copied from ``GET /v1/jobs/{id}``) and the server
replaces them."""


@dataclass(frozen=True)
class NumberRange:
    """A number param checked at submission: ``low`` <= value <= ``high``, finite, an integer
    when ``integer``."""

    name: str
    low: float
    high: float
    integer: bool = False

    def refusal(self, value: Any) -> str | None:
        """Why ``value`` is refused (``"must be a number from 0 to 50, got 500"``), or None when
        it is a finite number in range (an integer when :attr:`integer`; never a bool)."""
        kinds_ok = (int,) if self.integer else (int, float)
        # an int is compared as it is: math.isfinite(int) converts to float and overflows past 1e308
        if (
            not isinstance(value, kinds_ok)
            or isinstance(value, bool)
            or (isinstance(value, float) and not math.isfinite(value))
            or not self.low <= value <= self.high
        ):
            wanted = "an integer" if self.integer else "a number"
            return f"must be {wanted} from {bound(self.low)} to {bound(self.high)}, got {shown(value)}"
        return None


def bound(number: float) -> str:
    """A range's end as a message shows it: a whole number in full (``1000000``, never
    ``1e+06``), any other in ``:g`` form (``0.5``, ``1e-05``)."""
    if float(number).is_integer() and abs(number) < 1e16:
        return str(int(number))
    return f"{number:g}"


def shown(value: Any, most: int = 40) -> str:
    """``repr(value)`` for an error message; a longer one (a 400-digit integer) is cut to its
    first ``most`` characters and says its length: ``999…99… (400 digits)``."""
    text = repr(value)
    if len(text) <= most:
        return text
    what = "digits" if isinstance(value, int) else "characters"
    return f"{text[:most]}… ({len(text.lstrip('-'))} {what})"


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
        server_params: params the server acts on and journals, which the runner never reads
            (txt2img's ``expand_prompt`` and ``expanded_by``: the prompt's expansion;
            ``adapters``: LoRA adapters the worker applies around the runner).
    """

    name: str
    params: tuple[str, ...]
    defaults: Mapping[str, Any] = field(default_factory=dict)
    numbers: tuple[NumberRange, ...] = ()
    inputs: tuple[str, ...] = ()
    prompt_required: bool = False
    output_scale: int | None = None
    formats: tuple[str, ...] = ()
    server_params: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "defaults", MappingProxyType(dict(self.defaults)))

    @property
    def accepted(self) -> tuple[str, ...]:
        """Every key ``params`` may hold: :attr:`params`, plus :data:`OUTPUT_SIZE_FIELDS` for
        kinds whose output follows their input (the server sets those), plus :attr:`server_params`."""
        return self.params + (OUTPUT_SIZE_FIELDS if self.output_scale is not None else ()) + self.server_params

    def args(self, params: Mapping[str, Any]) -> Args:
        """``params`` as the runner reads them: a declared param's value, else its default."""
        return Args(self, params)

    def value(self, params: Mapping[str, Any], name: str) -> Any:
        """``params[name]``, else (absent or null) the default (None when there is none)."""
        return params[name] if params.get(name) is not None else self.defaults.get(name)


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
            raise KeyError(
                f"kind {self.spec.name!r} reads {name!r}, which its spec does not list "
                f"(app/core/kinds.py); it lists {', '.join(self.spec.params)}"
            )
        self.read.add(name)

    def get(self, name: str, default: Any = None) -> Any:
        """The value of a declared param, else its default, else ``default``; an undeclared one raises."""
        self._declared(name)
        return self[name] if name in self._params or name in self.spec.defaults else default

    def __getitem__(self, name: str) -> Any:
        self._declared(name)
        if name in self._params and (self._params[name] is not None or name not in self.spec.defaults):
            return self._params[name]
        if name in self.spec.defaults:  # absent, or null: the server reads null as absent (R22)
            return self.spec.defaults[name]
        raise KeyError(name)

    def __iter__(self) -> Iterator[str]:
        return iter(name for name in self.spec.params if name in self._params or name in self.spec.defaults)

    def __len__(self) -> int:
        return sum(1 for _ in self)
