"""What each job kind accepts, in one place: one :class:`KindSpec` per kind that the server's
validation (``app/jobs/validation.py``, R22), placement's defaults (:func:`job_request`) and
the worker's runner (``tasks/kinds/<kind>.py``, through :meth:`KindSpec.args`) all read.

A spec names every param its runner reads, their defaults, the numeric ranges checked at
submission, the params that name uploaded input files, whether a prompt is required, how the
output's size follows from the params, and the formats a kind can write.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

from app.core.families import FAMILIES
from app.core.specs import OUTPUT_SIZE_FIELDS, Args, KindSpec, NumberRange
from routing.placement import JobRequest
from routing.timings import job_size

__all__ = [
    "ADAPTERS_PARAM",
    "BATCH_PARAM",
    "DENOISING_PARAMS",
    "GREEDY_TEMPERATURE",
    "KINDS",
    "MAX_NEW_TOKENS",
    "MAX_SEED",
    "OUTPUT_SIZE_FIELDS",
    "Args",
    "KindSpec",
    "NumberRange",
    "adapter_ids",
    "denoised_steps",
    "family_kind_spec",
    "greedy",
    "job_request",
    "nth_seed",
    "spec",
]

MAX_SEED = 2**63 - 1
"""torch.Generator.manual_seed takes a 64-bit seed; JSON clients keep 63 bits exact."""


def nth_seed(seed: int, index: int) -> int:
    """The seed of the ``index``-th of several images or jobs asked for with ``seed``: ``seed +
    index``, wrapping past :data:`MAX_SEED` to 0, so that every one is a valid seed."""
    return (seed + index) % (MAX_SEED + 1)


DENOISING_PARAMS: tuple[str, ...] = ("steps", "guidance_scale", "seed")
"""The params every denoising kind reads (``tasks.kinds.denoising``)."""

MAX_NEW_TOKENS = 1_000_000
"""A text job's ``max_new_tokens`` at most (tokens): the kind's range, and the OpenAI and TGI
routes' ``max_tokens`` / ``max_new_tokens`` limit, so a 400-digit integer is refused naming the
client's field."""

GREEDY_TEMPERATURE = 1e-5
"""A text job's ``temperature`` below this (5e-324 included) decodes greedily, as 0 does (OpenAI's
rule: 0 is greedy; TGI's routes refuse only <= 0): logits divided by it overflow float32 to inf and
sampling would fail; at it, sampling is already greedy up to logit differences of 1e-4."""

BATCH_PARAM = "n"
"""Images per job (OpenAI's ``n``): one pipeline call with ``num_images_per_prompt``
and one generator per image, seeded ``seed``, ``seed + 1``, …; at most the family's
``max_batch`` (``app/core/limits.py``). The kinds whose spec lists it take it."""


ADAPTERS_PARAM = "adapters"
"""LoRA adapters applied to the model for one job: ``[{"id": adapter id, "scale":
weight}]``, checked by ``app.jobs.validation.check_adapters`` (at most the family's
``max_adapters``), loaded onto the warm pipeline by the worker (``tasks/adapters.py``) and
unloaded after the job. The image kinds whose spec lists it in ``server_params`` take it (the
runner never reads it: the worker applies the adapters around the runner)."""

CHAT_SHOWN_PARAM = "user_message"
"""A chat job's last user message (text kind, with ``chat``), what the fleet page shows as its
prompt: set by the chat routes and prompt expansion; a client's on ``POST /v1/jobs`` is refused
(:data:`SERVER_SET_PARAMS`)."""

SERVER_SET_PARAMS = ("expanded_by", CHAT_SHOWN_PARAM)
"""Params the server sets itself: a client's is refused, and the OpenAPI document leaves them out."""

_GUIDANCE = NumberRange("guidance_scale", 0.0, 50.0)
_DENOISING_DEFAULTS = {"steps": 4, "guidance_scale": 7.5}
_STRENGTH = NumberRange("strength", 0.0, 1.0)  # diffusers: how much noise is added to the input (1: all)

KINDS: dict[str, KindSpec] = {
    spec.name: spec
    for spec in (
        KindSpec(
            "txt2img",
            params=("prompt", "negative_prompt", "width", "height", *DENOISING_PARAMS, BATCH_PARAM),
            # a text model writes the prompt first (app/jobs/expansion.py); expanded_by: its job
            server_params=("expand_prompt", "expanded_by", ADAPTERS_PARAM),
            defaults={**_DENOISING_DEFAULTS, "width": 64, "height": 64, BATCH_PARAM: 1},
            numbers=(_GUIDANCE,),
            prompt_required=True,
        ),
        KindSpec(
            "edit",
            params=("image", "prompt", "negative_prompt", "image_guidance_scale", *DENOISING_PARAMS),
            defaults={**_DENOISING_DEFAULTS, "image_guidance_scale": 1.5},
            numbers=(_GUIDANCE, NumberRange("image_guidance_scale", 0.0, 50.0)),
            inputs=("image",),
            prompt_required=True,
            output_scale=1,
            server_params=(ADAPTERS_PARAM,),
        ),
        KindSpec(
            # the input image noised by `strength`, then denoised int(steps * strength) steps
            "img2img",
            params=("image", "prompt", "negative_prompt", "strength", *DENOISING_PARAMS, BATCH_PARAM),
            defaults={**_DENOISING_DEFAULTS, "strength": 0.8, BATCH_PARAM: 1},
            numbers=(_GUIDANCE, _STRENGTH),
            inputs=("image",),
            prompt_required=True,
            output_scale=1,
            server_params=(ADAPTERS_PARAM,),
        ),
        KindSpec(
            # `mask` (white: repaint, black: keep) has the image's size; pixels outside it are the input's
            "inpaint",
            params=("image", "mask", "prompt", "negative_prompt", "strength", *DENOISING_PARAMS, BATCH_PARAM),
            defaults={**_DENOISING_DEFAULTS, "strength": 1.0, BATCH_PARAM: 1},
            numbers=(_GUIDANCE, _STRENGTH),
            inputs=("image", "mask"),
            prompt_required=True,
            output_scale=1,
            server_params=(ADAPTERS_PARAM,),
        ),
        KindSpec(
            # noise_level: the x4 upscaler's scheduler config, max_noise_level = 350
            "upscale",
            params=("image", "prompt", "negative_prompt", "noise_level", *DENOISING_PARAMS),
            defaults={**_DENOISING_DEFAULTS, "prompt": "", "guidance_scale": 9.0, "noise_level": 20},
            numbers=(_GUIDANCE, NumberRange("noise_level", 0, 350, integer=True)),
            inputs=("image",),
            output_scale=4,  # StableDiffusionUpscalePipeline: 4 x width, 4 x height
        ),
        KindSpec(
            "video",
            params=("prompt", "negative_prompt", "width", "height", "frames", "fps", "format", *DENOISING_PARAMS),
            defaults={**_DENOISING_DEFAULTS, "width": 64, "height": 64, "frames": 8, "fps": 8, "format": "mp4"},
            numbers=(_GUIDANCE, NumberRange("fps", 1.0, 60.0)),
            prompt_required=True,
            formats=("mp4", "webp", "gif"),
        ),
        KindSpec(
            # causal LMs. `prompt` is the text fed to the model (a chat request's messages
            # are chat-templated by the server, `chat` true); `temperature` 0 (any below GREEDY_TEMPERATURE) is greedy;
            # `grammar` constrains the output (app/core/constraints.py: a JSON schema or a regex).
            # `stop`: sequences that end the text, cut before the first (app/core/textgen.py stop_sequences).
            # `user_message`: a chat's last user message, what the fleet page shows as its prompt (the
            # OpenAI and Hugging Face chat routes set it; the runner reads the templated `prompt` only).
            "text",
            params=("prompt", "chat", "max_new_tokens", "temperature", "top_p", "seed", "grammar", "stop"),
            server_params=(CHAT_SHOWN_PARAM,),
            defaults={
                "chat": False,
                "max_new_tokens": 16,
                "temperature": 0.0,
                "top_p": 1.0,
                "grammar": None,
                "stop": None,
            },
            numbers=(
                NumberRange("max_new_tokens", 1, MAX_NEW_TOKENS, integer=True),
                NumberRange("temperature", 0.0, 2.0),
                NumberRange("top_p", 0.001, 1.0),
            ),
            prompt_required=True,
        ),
    )
}


@functools.cache
def family_kind_spec(family_name: str, kind: str) -> KindSpec:
    """What a job of ``kind`` accepts on a model of ``family_name``: the kind's spec with the
    family's params dropped and added, its defaults and its ranges. A family this table does
    not know, or that runs another kind, gets the kind's own spec.

    Raises:
        KeyError: ``kind`` is not implemented.
    """
    base = KINDS[kind]
    rules = FAMILIES.get(family_name)  # app/core/families.py
    if rules is None or kind not in rules.kinds:
        return base
    params = tuple(name for name in base.params if name not in rules.drop) + rules.add
    defaults = {name: value for name, value in base.defaults.items() if name in params} | dict(rules.defaults)
    replaced = {number.name for number in rules.numbers}
    numbers = tuple(n for n in base.numbers if n.name in params and n.name not in replaced) + rules.numbers
    return KindSpec(
        base.name,
        params=params,
        defaults=defaults,
        numbers=numbers,
        inputs=base.inputs,
        prompt_required=base.prompt_required,
        output_scale=base.output_scale,
        formats=base.formats,
        server_params=base.server_params,
    )


def denoised_steps(steps: int, strength: float) -> int:
    """The denoising steps a kind with ``strength`` runs: ``min(int(steps * strength), steps)``,
    diffusers' own ``get_timesteps`` (img2img, inpaint). Below 1 the pipeline cannot run
    (refused at submission)."""
    return min(int(steps * strength), steps)


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


def job_request(
    model_id: str, family: str, kind: str, target: str, params: Mapping[str, Any], prompt_tokens: int = 0
) -> JobRequest:
    """The placement request of a job: its steps, and its size (pixels x frames x batch,
    ``routing.timings.job_size``) from ``output_width`` x ``output_height`` (set by the server
    for kinds whose output follows an input image), else ``width`` x ``height``, ``frames``
    and ``n`` (images per job, the batch); each absent one at the family's default for the kind
    (``app/core/families.py``; an unknown kind: txt2img's). A text job's steps are its
    ``max_new_tokens`` and its size ``prompt_tokens`` (counted by the server's tokenizer; 0
    where not counted). ``adapters``: the ids of ``params.adapters``, checked just
    before (``app.jobs.validation.check_adapters``; malformed entries are skipped here)."""
    kind_spec = family_kind_spec(family, kind) if kind in KINDS else KINDS["txt2img"]
    width = _number(params, "output_width", _number(params, "width", kind_spec.defaults.get("width", 64)))
    height = _number(params, "output_height", _number(params, "height", kind_spec.defaults.get("height", 64)))
    frames = _number(params, "frames", kind_spec.defaults.get("frames", 1))
    steps = _number(params, "steps", kind_spec.defaults.get("steps", 4))
    strength = kind_spec.value(params, "strength") if "strength" in kind_spec.params else None
    if isinstance(strength, int | float) and not isinstance(strength, bool):  # the steps it runs (img2img, inpaint)
        steps = max(1, denoised_steps(steps, float(strength)))
    if kind == "text":  # steps: new tokens; size: prompt tokens (routing.timings prices text per token)
        return JobRequest(
            model_id, family, kind, target, steps=_number(params, "max_new_tokens", 16), size=prompt_tokens
        )
    batch = _number(params, BATCH_PARAM, 1) if BATCH_PARAM in kind_spec.params else 1
    return JobRequest(
        model_id,
        family,
        kind,
        target,
        steps=steps,
        size=job_size(width * height, frames, batch),
        adapters=adapter_ids(params),
        batch=max(1, batch),
    )


def adapter_ids(params: Mapping[str, Any]) -> tuple[str, ...]:
    """The adapter ids of ``params.adapters`` in order; entries without a string
    ``id`` are skipped (validation refuses them)."""
    entries = params.get(ADAPTERS_PARAM)
    if not isinstance(entries, list):
        return ()
    return tuple(e["id"] for e in entries if isinstance(e, dict) and isinstance(e.get("id"), str))


def greedy(temperature: float) -> bool:
    """Whether a text job with ``temperature`` decodes greedily: below :data:`GREEDY_TEMPERATURE`."""
    return temperature < GREEDY_TEMPERATURE


MODEL_DEFAULT_EXCLUDED = (
    "prompt",
    "seed",
    "image",
    "mask",
    ADAPTERS_PARAM,
    "expand_prompt",
    "expanded_by",
    "grammar",
    "chat",
    CHAT_SHOWN_PARAM,
)
"""Params a model or adapter cannot default (``models add --default``): what a job asks for
(its prompt, inputs, adapters, grammar) and its seed (drawn per job so that the journal
records it, R9)."""


class DefaultRefused(ValueError):
    """A model default that cannot be registered; ``name`` is the param at fault."""

    def __init__(self, name: str, message: str) -> None:
        super().__init__(message)
        self.name = name


def default_kinds(family: str, kinds: tuple[str, ...] | list[str]) -> tuple[str, ...]:
    """The kinds whose jobs a model's defaults apply to: the kinds it runs, or for a LoRA
    adapter (kind ``adapter``) the image kinds of its base family that take adapters."""
    from app.core.families import kinds_of

    runs = kinds_of(family, kinds)
    if "adapter" not in runs:
        return tuple(kind for kind in runs if kind in KINDS)
    rules = FAMILIES.get(family)
    return tuple(
        kind
        for kind in (rules.kinds if rules is not None else ())
        if kind in KINDS and ADAPTERS_PARAM in family_kind_spec(family, kind).accepted
    )


def check_defaults(family: str, kinds: tuple[str, ...] | list[str], defaults: Mapping[str, Any]) -> dict[str, Any]:
    """A model's (or adapter's) own default params, checked against the param spec of the kinds
    they apply to (:func:`default_kinds`): each a param at least one of them takes on
    ``family`` (not one of :data:`MODEL_DEFAULT_EXCLUDED`), a number in each such kind's range.
    Returns them as given.

    Raises:
        DefaultRefused: an unknown or excluded param, or a value out of range, naming it, the
            kinds' params or the range.
    """
    applies = default_kinds(family, kinds)
    specs = [family_kind_spec(family, kind) for kind in applies]
    takes = sorted({name for kind_spec in specs for name in kind_spec.params} - set(MODEL_DEFAULT_EXCLUDED))
    for name, value in defaults.items():
        if name not in takes:
            raise DefaultRefused(
                name,
                f"default {name!r} is not a param of {', '.join(applies) or 'any kind'} on "
                f"family {family}; a default may set {', '.join(takes)}",
            )
        for kind_spec in specs:
            for number in kind_spec.numbers:
                refusal = number.refusal(value) if number.name == name else None
                if refusal is not None:
                    raise DefaultRefused(name, f"default {name} {refusal} (kind {kind_spec.name})")
    return dict(defaults)


def with_defaults(
    kind_spec: KindSpec, params: Mapping[str, Any], *defaults: Mapping[str, Any] | None
) -> dict[str, Any]:
    """``params`` with each param of ``kind_spec`` it lacks taken from the first of ``defaults``
    (a model's or adapter's own, in order of precedence) that sets it: the client's value wins."""
    out = dict(params)
    for given in defaults:
        for name, value in (given or {}).items():
            if name in kind_spec.params and name not in out:
                out[name] = value
    return out
