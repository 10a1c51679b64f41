"""The job kinds, one file each: a diffusers call from params to output bytes (the arguments
every denoising kind shares come from :func:`denoising`).

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

#: the params :func:`denoising` reads, shared by every kind
DENOISING_PARAMS: tuple[str, ...] = ("steps", "guidance_scale", "seed")


@dataclass(frozen=True)
class Output:
    data: bytes
    media_type: str


class Kind(Protocol):
    def __call__(self, pipeline: Any, params: dict[str, Any], progress: ProgressFn, provenance: dict[str, Any],
                 inputs: Mapping[str, bytes]) -> Output: ...


def denoising(params: dict[str, Any], progress: ProgressFn, guidance_scale: float = 7.5) -> dict[str, Any]:
    """The diffusers call arguments every denoising kind shares: ``num_inference_steps``
    (``steps``, default 4), ``guidance_scale`` (param, else ``guidance_scale``), a CPU
    ``generator`` seeded with ``seed`` (same seed, same machine: same bytes) and a
    ``callback_on_step_end`` that reports (step done, total steps) to ``progress``.

    Raises:
        KeyError: ``params`` has no ``seed`` (the server always draws one at submission).
    """
    import torch

    steps = int(params.get("steps", 4))

    def on_step_end(_pipe: Any, step: int, _timestep: Any, callback_kwargs: dict[str, Any]) -> dict[str, Any]:
        progress(step + 1, steps)
        return callback_kwargs

    return {
        "num_inference_steps": steps,
        "guidance_scale": float(params.get("guidance_scale", guidance_scale)),
        "generator": torch.Generator("cpu").manual_seed(int(params["seed"])),
        "callback_on_step_end": on_step_end,
    }


def kind_params(kind: str) -> tuple[str, ...]:
    """The params the runner of ``kind`` reads (its module's ``PARAMS``): the one list the server
    checks a submission's params against (app/core/kinds.py), so that a key a kind does not
    use is refused at submission instead of being ignored.

    Raises:
        KeyError: ``kind`` is not implemented (the message names the known kinds).
    """
    from tasks.kinds import edit, txt2img, upscale, video

    params = {"txt2img": txt2img.PARAMS, "edit": edit.PARAMS, "upscale": upscale.PARAMS, "video": video.PARAMS}
    if kind not in params:
        raise KeyError(f"kind {kind!r} is not implemented; implemented: {', '.join(params)}")
    return params[kind]


def runner(kind: str) -> Kind:
    """The runner of ``kind``. Raises ``KeyError`` naming the known kinds."""
    from tasks.kinds import edit, txt2img, upscale, video

    kinds: dict[str, Kind] = {"txt2img": txt2img.run, "edit": edit.run, "upscale": upscale.run, "video": video.run}
    if kind not in kinds:
        raise KeyError(f"kind {kind!r} is not implemented; implemented: {', '.join(kinds)}")
    return kinds[kind]
