"""The job kinds, one self-contained file each: a diffusers call from params to output bytes."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

ProgressFn = Callable[[int, int], None]  # (step done, total steps)


@dataclass(frozen=True)
class Output:
    data: bytes
    media_type: str


class Kind(Protocol):
    def __call__(self, pipeline: Any, params: dict[str, Any], progress: ProgressFn, provenance: dict[str, Any]) -> Output: ...


def runner(kind: str) -> Kind:
    """The runner of ``kind``. Raises ``KeyError`` naming the known kinds."""
    from tasks.kinds import txt2img

    kinds: dict[str, Kind] = {"txt2img": txt2img.run}
    if kind not in kinds:
        raise KeyError(f"kind {kind!r} is not implemented; implemented: {', '.join(kinds)}")
    return kinds[kind]
