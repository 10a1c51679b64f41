"""The job kinds, one file each: a diffusers call from params to output bytes. What a kind
accepts (params, defaults, ranges, inputs) is its spec, ``app/core/kinds.py``; a runner reads
its params only through that spec (``KindSpec.args``), so it can never read a param the server
did not check, and absent params get the spec's defaults. The arguments every denoising kind
shares come from :func:`denoising`.

Every runner has the same shape: ``run(pipeline, params, progress, provenance, inputs, family)``.
``params`` are the journaled params (the ``seed`` is always there: given or drawn by the
server at submission); ``inputs`` maps an input field (e.g. ``"image"``) to the bytes the
worker fetched from the server and checked against their digest; ``provenance`` is the
deterministic record embedded in the output file; ``family`` is the model's family
(``app/core/families.py``): a runner reads params through that family's spec and passes the
family's own params under the pipeline's argument names (:func:`family_arguments`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from app.core.families import family as family_rules
from app.core.kinds import BATCH_PARAM, Args, nth_seed

ProgressFn = Callable[..., None]  # (step done, total steps[, text=, tokens=, logprobs=: a text job's so far])


@dataclass(frozen=True)
class Output:
    """A runner's result: the file's bytes and media type, and ``record``: figures for the
    journaled provenance only (not embedded: e.g. a text job's token counts and finish reason);
    ``more``: the files of images 2..n of a job with ``n`` > 1, in order, each of
    ``media_type``."""

    data: bytes
    media_type: str
    record: Mapping[str, Any] = field(default_factory=dict)
    more: tuple[bytes, ...] = ()


def pipeline_sides(width: int, height: int, multiple: int) -> tuple[int, int]:
    """The sides (pixels) a pipeline draws an input of ``width`` x ``height`` at: each rounded to
    the nearest multiple of ``multiple`` (halves up), at least ``multiple``."""
    return (
        max(multiple, (width + multiple // 2) // multiple * multiple),
        max(multiple, (height + multiple // 2) // multiple * multiple),
    )


@dataclass(frozen=True)
class DrawnInput:
    """An input image as its pipeline draws it (docs/api.md, "Input images"): a pipeline's VAE
    packs 8 pixels (16 for Flux, Qwen-Image, Wan: ``Family.multiple_of``) into a latent, and
    diffusers rounds other sides down, so an input whose sides are not multiples is resized
    (Lanczos) to the nearest multiples (:func:`pipeline_sides`) and each output is resized back
    to the input's own size (times the kind's scale), the size the server journaled.

    ``image``: the PIL image given to the pipeline; ``size``: the input's (width, height), pixels."""

    image: Any
    size: tuple[int, int]

    @property
    def resized(self) -> bool:
        return tuple(self.image.size) != self.size

    def restored(self, images: Sequence[Any], scale: int = 1) -> list[Any]:
        """``images`` (PIL) at ``size`` x ``scale``; as they are when the input was not resized."""
        from PIL import Image

        if not self.resized:
            return list(images)
        target = (self.size[0] * scale, self.size[1] * scale)
        return [image.resize(target, Image.Resampling.LANCZOS) for image in images]

    def noted(self, output: Output) -> Output:
        """``output`` with ``pipeline_size`` ([width, height] drawn at) in its journaled record
        when the input was resized."""
        if not self.resized:
            return output
        return replace(output, record={**output.record, "pipeline_size": list(self.image.size)})


def drawn_input(image: Any, family: str) -> DrawnInput:
    """``image`` (PIL) as ``family``'s pipeline draws it: :class:`DrawnInput`."""
    from PIL import Image

    rules = family_rules(family)
    sides = pipeline_sides(image.width, image.height, rules.multiple_of if rules is not None else 8)
    drawn = image if sides == image.size else image.resize(sides, Image.Resampling.LANCZOS)
    return DrawnInput(drawn, (image.width, image.height))


class Kind(Protocol):
    def __call__(
        self,
        pipeline: Any,
        params: Mapping[str, Any],
        progress: ProgressFn,
        provenance: dict[str, Any],
        inputs: Mapping[str, bytes],
        family: str = "",
    ) -> Output: ...


def family_arguments(args: Args, family: str) -> dict[str, Any]:
    """The pipeline arguments of ``family``'s own params (``Family.arguments``: param -> argument
    name, e.g. ``frames`` -> ``num_frames``, ``true_cfg_scale``), for those that have a value."""
    rules = family_rules(family)
    if rules is None:
        return {}
    return {
        argument: args[name]
        for name, argument in rules.arguments.items()
        if name in args.spec.params and args.get(name) is not None
    }


def denoising(args: Args, progress: ProgressFn, total: int | None = None) -> dict[str, Any]:
    """The diffusers call arguments every denoising kind shares, from its spec's ``args``:
    ``num_inference_steps`` (``steps``), ``guidance_scale`` (when the family's spec has one: not
    Qwen-Image-Edit, whose transformer has no guidance embedding), a CPU ``generator`` seeded with
    ``seed`` (same seed, same machine: same bytes) and a ``callback_on_step_end`` that reports
    (step done, total steps) to ``progress``; ``total``: the steps the pipeline really runs
    when fewer than ``steps`` (img2img, inpaint: ``int(steps * strength)``).

    Raises:
        KeyError: no ``seed`` (the server always draws one at submission).
    """
    import torch

    steps = int(args["steps"])
    reported = steps if total is None else total

    def on_step_end(_pipe: Any, step: int, _timestep: Any, callback_kwargs: dict[str, Any]) -> dict[str, Any]:
        progress(step + 1, reported)
        return callback_kwargs

    seed = int(args["seed"])
    call: dict[str, Any] = {
        "num_inference_steps": steps,
        "generator": torch.Generator("cpu").manual_seed(seed),
        "callback_on_step_end": on_step_end,
    }
    count = images_of(args)
    if count > 1:  # one call, one generator per image: image i is seeded seed + i
        call["num_images_per_prompt"] = count
        call["generator"] = [torch.Generator("cpu").manual_seed(nth_seed(seed, i)) for i in range(count)]
    if "guidance_scale" in args.spec.params:
        call["guidance_scale"] = float(args["guidance_scale"])
    return call


_DERIVED: weakref.WeakKeyDictionary[Any, dict[str, Any]] = weakref.WeakKeyDictionary()


def kind_pipeline(pipeline: Any, family: str, kind: str) -> Any:
    """The pipeline that runs ``kind`` on the resident ``pipeline``'s components: the family's
    class for that kind (``Family.pipelines``, app/core/families.py, e.g.
    ``StableDiffusionImg2ImgPipeline``) built with diffusers' ``from_pipe`` (the same modules, no
    second load), kept while the resident pipeline lives; ``pipeline`` itself when it already
    is that class.

    Raises:
        KeyError: the family does not run ``kind`` (the message names the kinds it runs).
    """
    rules = family_rules(family)
    if rules is None:
        raise KeyError(f"family {family!r} is unknown (app/core/families.py); it runs no {kind!r}")
    class_name = rules.pipeline_class_of(kind)
    if type(pipeline).__name__ == class_name:
        return pipeline
    derived = _DERIVED.setdefault(pipeline, {})
    if class_name not in derived:
        import diffusers

        built = getattr(diffusers, class_name).from_pipe(pipeline)
        built.set_progress_bar_config(disable=True)
        derived[class_name] = built
    return derived[class_name]


def images_of(args: Args) -> int:
    """The images a job makes: ``n`` where its kind takes it (:data:`app.core.kinds.BATCH_PARAM`), else 1."""
    return int(args[BATCH_PARAM]) if BATCH_PARAM in args.spec.params else 1


def image_output(
    images: list[Any],
    args: Args,
    provenance: dict[str, Any],
    encode: Callable[..., bytes],
    flagged: Sequence[bool] | None = None,
) -> Output:
    """The PNG output of a denoising call's ``images`` (PIL, in order). Image ``i`` of a job
    with ``n`` > 1 embeds its own provenance: ``seed`` + i as its ``seed`` and ``index`` i, so
    each file says how to make it alone; one image embeds ``provenance`` as it is.

    ``flagged``: the pipeline's ``nsfw_content_detected`` (one bool per image; a pipeline whose
    model folder loads a safety checker, as Stable Diffusion 1.5's does, blacks out an image it
    flags). When any is flagged the journaled record keeps the list, so a black image is
    explained, not mistaken for a fault."""
    count = images_of(args)
    record: dict[str, Any] = {}
    if flagged is not None and any(flagged):
        record["nsfw_content_detected"] = [bool(f) for f in flagged]
    if count == 1:
        return Output(data=encode(images[0], provenance), media_type="image/png", record=record)
    if len(images) != count:
        raise RuntimeError(f"the pipeline made {len(images)} images for n={count}")
    seed = int(args["seed"])
    files = [encode(image, {**provenance, "seed": nth_seed(seed, i), "index": i}) for i, image in enumerate(images)]
    return Output(
        data=files[0],
        media_type="image/png",
        more=tuple(files[1:]),
        record={"seeds": [nth_seed(seed, i) for i in range(count)], **record},
    )


def runner(kind: str) -> Kind:
    """The runner of ``kind``. Raises ``KeyError`` naming the known kinds."""
    from tasks.kinds import edit, img2img, inpaint, text, txt2img, upscale, video

    kinds: dict[str, Kind] = {
        "txt2img": txt2img.run,
        "img2img": img2img.run,
        "inpaint": inpaint.run,
        "edit": edit.run,
        "upscale": upscale.run,
        "video": video.run,
        "text": text.run,
    }
    if kind not in kinds:
        raise KeyError(f"kind {kind!r} is not implemented; implemented: {', '.join(kinds)}")
    return kinds[kind]
