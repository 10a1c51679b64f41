"""The job kinds, one self-contained file each: a diffusers call from params to output bytes.

Every runner has the same shape: ``run(pipeline, params, progress, provenance, inputs)``.
``params`` are the journaled params (the ``seed`` is always there: given or drawn by the
server at submission); ``inputs`` maps an input field (e.g. ``"image"``) to the bytes the
worker fetched from the server and checked against their digest; ``provenance`` is the
deterministic record embedded in the output file.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

ProgressFn = Callable[[int, int], None]  # (step done, total steps)


@dataclass(frozen=True)
class Output:
    data: bytes
    media_type: str


class Kind(Protocol):
    def __call__(self, pipeline: Any, params: dict[str, Any], progress: ProgressFn, provenance: dict[str, Any],
                 inputs: Mapping[str, bytes]) -> Output: ...


def runner(kind: str) -> Kind:
    """The runner of ``kind``. Raises ``KeyError`` naming the known kinds."""
    from tasks.kinds import edit, txt2img, upscale, video

    kinds: dict[str, Kind] = {"txt2img": txt2img.run, "edit": edit.run, "upscale": upscale.run, "video": video.run}
    if kind not in kinds:
        raise KeyError(f"kind {kind!r} is not implemented; implemented: {', '.join(kinds)}")
    return kinds[kind]
