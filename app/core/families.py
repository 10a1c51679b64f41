"""Per-family rules (R22), in one place: which diffusers pipeline class is which family,
the kind it runs, and how that kind's params map onto that pipeline's own arguments and ranges.

A kind (``app/core/kinds.py``) says what a job of that kind accepts in general; a family
adjusts it to its pipeline: params it does not take are dropped (Qwen-Image-Edit has no
``image_guidance_scale``; its ``guidance_scale`` is ignored, true CFG replaces it), params
only it takes are added (``true_cfg_scale``), defaults and ranges are its own (Flux's
``guidance_scale`` is distilled guidance, 3.5), and its sides and frame counts follow its
VAE (Wan: frames 4k+1, sides multiples of 16). The server's validation
(``app/jobs/validation.py``) refuses a submission that breaks a rule with a 422 naming the
family's limit; the worker's kind code (``tasks/kinds/*.py``) reads params through
:func:`app.core.kinds.family_kind_spec` and passes them under :attr:`Family.arguments`'s names, so a param a
pipeline does not take never reaches it (no TypeError on a worker).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from app.core.specs import NumberRange
from routing.timings import ADAPTER_KIND


@dataclass(frozen=True)
class FrameRule:
    """Frame counts a video family takes: ``count % step == offset`` (Wan: 4k+1)."""

    step: int
    offset: int
    why: str


@dataclass(frozen=True)
class Family:
    """One model family.

    Attributes:
        name: the family, e.g. ``flux`` (the registry's ``family`` column).
        pipeline_class: the diffusers class in ``model_index.json`` (``_class_name``), or for
            a text model the transformers class in ``config.json`` (``architectures``).
        kind: the job kind its pipeline runs.
        multiple_of: ``width``/``height`` must be multiples of it (pixels): the VAE's
            downsampling times the transformer's patch size; an input image is drawn at the
            nearest multiples (``tasks.kinds.DrawnInput``).
        size_why: what ``multiple_of`` comes from, for refusals.
        drop: params of the kind this pipeline does not take (refused at submission).
        add: params only this family takes (with their defaults and ranges below).
        defaults: this family's defaults, over the kind's.
        numbers: this family's ranges, replacing the kind's range of the same name.
        arguments: param -> the pipeline's argument name, for the params passed through as
            they are (the runner adds prompt, sizes, steps, seed, guidance itself).
        frames: the frame-count rule of a video family, or None.
        size_arguments: the size arguments the runner gives an edit pipeline so that the output
            keeps the input's size (``width``, ``height``, ``max_area`` = width x height):
            Qwen-Image-Edit and Flux Kontext would otherwise draw ~1024x1024.
        fixed_arguments: arguments always passed as they are (Flux Kontext: ``_auto_resize``
            off, or it resizes the input to one of its trained resolutions).
        cfg_param: the param that turns true classifier-free guidance on above 1; a
            ``negative_prompt`` is only used when it is above 1 (else it is refused).
        limits: its default limits (``app/core/limits.py``) where they differ from the
            SD-1-sized ones: ``max_prompt_tokens`` its text encoder reads (T5: 512, Qwen2.5-VL:
            1024; CLIP: 77), ``max_frames`` its video model was trained on (Wan: 81).
        pipelines: kind -> the diffusers class that runs it on the same components
            (``img2img``, ``inpaint``), built on the worker from the resident pipeline with
            ``from_pipe`` (no second load). The family's drop/add/defaults/ranges apply to
            these kinds too.
    """

    name: str
    pipeline_class: str
    kind: str
    multiple_of: int = 8
    size_why: str = "the VAE downsamples by 8"
    drop: tuple[str, ...] = ()
    add: tuple[str, ...] = ()
    defaults: Mapping[str, Any] = field(default_factory=dict)
    numbers: tuple[NumberRange, ...] = ()
    arguments: Mapping[str, str] = field(default_factory=dict)
    frames: FrameRule | None = None
    size_arguments: tuple[str, ...] = ()
    fixed_arguments: Mapping[str, Any] = field(default_factory=dict)
    cfg_param: str | None = None
    limits: Mapping[str, int] = field(default_factory=dict)
    pipelines: Mapping[str, str] = field(default_factory=dict)

    @property
    def kinds(self) -> tuple[str, ...]:
        """Every kind a model of this family runs: :attr:`kind`, then :attr:`pipelines`' kinds."""
        return (self.kind, *self.pipelines)

    def pipeline_class_of(self, kind: str) -> str:
        """The diffusers class that runs ``kind`` (:attr:`pipeline_class` for :attr:`kind`).

        Raises:
            KeyError: the family does not run ``kind`` (the message names the kinds it runs).
        """
        if kind == self.kind:
            return self.pipeline_class
        if kind not in self.pipelines:
            raise KeyError(f"family {self.name} runs kinds {', '.join(self.kinds)}, not {kind!r}")
        return self.pipelines[kind]

    def __post_init__(self) -> None:
        object.__setattr__(self, "defaults", MappingProxyType(dict(self.defaults)))
        object.__setattr__(self, "limits", MappingProxyType(dict(self.limits)))
        object.__setattr__(self, "fixed_arguments", MappingProxyType(dict(self.fixed_arguments)))
        object.__setattr__(self, "arguments", MappingProxyType(dict(self.arguments)))
        object.__setattr__(self, "pipelines", MappingProxyType(dict(self.pipelines)))


_TEXT_PROMPT_CHARS = 1_000_000
_TRUE_CFG = NumberRange("true_cfg_scale", 1.0, 50.0)

FAMILIES: dict[str, Family] = {
    family.name: family
    for family in (
        # img2img and inpainting run on the txt2img components (from_pipe; a 4-channel
        # UNet inpaints by blending the input's latents outside the mask at every step)
        Family(
            "sd1",
            "StableDiffusionPipeline",
            "txt2img",
            pipelines={"img2img": "StableDiffusionImg2ImgPipeline", "inpaint": "StableDiffusionInpaintPipeline"},
        ),
        Family(
            "sdxl",
            "StableDiffusionXLPipeline",
            "txt2img",
            defaults={"guidance_scale": 5.0},
            pipelines={"img2img": "StableDiffusionXLImg2ImgPipeline", "inpaint": "StableDiffusionXLInpaintPipeline"},
        ),
        Family(
            "flux",
            "FluxPipeline",
            "txt2img",
            multiple_of=16,
            size_why="the VAE downsamples by 8, then 2x2 patches",
            add=("true_cfg_scale",),
            defaults={"guidance_scale": 3.5, "true_cfg_scale": 1.0},
            # guidance_scale is the distilled guidance embedded in the transformer (FLUX.1-dev), not CFG
            numbers=(NumberRange("guidance_scale", 0.0, 20.0), _TRUE_CFG),
            arguments={"true_cfg_scale": "true_cfg_scale"},
            cfg_param="true_cfg_scale",
            limits={"max_prompt_tokens": 512},
        ),
        Family(
            "sd1-pix2pix",
            "StableDiffusionInstructPix2PixPipeline",
            "edit",
            arguments={"image_guidance_scale": "image_guidance_scale"},
        ),
        Family(
            "qwen-image",
            "QwenImageEditPipeline",
            "edit",
            multiple_of=16,
            size_why="the VAE downsamples by 8, then 2x2 patches",
            # no image_guidance_scale; guidance_scale is ignored (no guidance embeddings): true CFG instead
            drop=("image_guidance_scale", "guidance_scale"),
            add=("true_cfg_scale",),
            defaults={"true_cfg_scale": 4.0, "negative_prompt": " "},
            numbers=(_TRUE_CFG,),
            arguments={"true_cfg_scale": "true_cfg_scale"},
            size_arguments=("width", "height"),
            cfg_param="true_cfg_scale",
            limits={"max_prompt_tokens": 1024},
        ),
        Family(
            "flux-kontext",
            "FluxKontextPipeline",
            "edit",
            multiple_of=16,
            size_why="the VAE downsamples by 8, then 2x2 patches",
            # FLUX.1-Kontext-dev: guidance_scale is the distilled guidance (2.5); no image_guidance_scale
            drop=("image_guidance_scale",),
            add=("true_cfg_scale",),
            defaults={"guidance_scale": 2.5, "true_cfg_scale": 1.0},
            numbers=(NumberRange("guidance_scale", 0.0, 20.0), _TRUE_CFG),
            arguments={"true_cfg_scale": "true_cfg_scale"},
            size_arguments=("width", "height", "max_area"),
            fixed_arguments={"_auto_resize": False},
            cfg_param="true_cfg_scale",
            limits={"max_prompt_tokens": 512},
        ),
        Family("sd-upscale", "StableDiffusionUpscalePipeline", "upscale", arguments={"noise_level": "noise_level"}),
        Family("animatediff", "AnimateDiffPipeline", "video", arguments={"frames": "num_frames"}),
        Family(
            "wan",
            "WanPipeline",
            "video",
            multiple_of=16,
            size_why="the VAE downsamples by 8, then 1x2x2 patches",
            defaults={"frames": 33, "fps": 16, "guidance_scale": 5.0},
            arguments={"frames": "num_frames"},
            frames=FrameRule(4, 1, "the VAE packs 4 frames into each latent frame after the first"),
            limits={"max_prompt_tokens": 512, "max_frames": 81},
        ),
        # causal language models: pipeline_class is config.json's ``architectures`` class
        # (prompts are limited in tokens, max_input_tokens; the characters' limit only refuses absurd sizes early)
        Family("llama", "LlamaForCausalLM", "text", limits={"max_prompt_chars": _TEXT_PROMPT_CHARS}),
        Family("qwen2", "Qwen2ForCausalLM", "text", limits={"max_prompt_chars": _TEXT_PROMPT_CHARS}),
        Family("gpt2", "GPT2LMHeadModel", "text", limits={"max_prompt_chars": _TEXT_PROMPT_CHARS}),
    )
}

PIPELINE_FAMILIES: dict[str, tuple[str, tuple[str, ...]]] = {
    family.pipeline_class: (family.name, family.kinds) for family in FAMILIES.values()
}
"""diffusers pipeline class (``model_index.json`` ``_class_name``), or transformers model class
(``config.json`` ``architectures``) -> (family, kinds it runs): what the registry accepts."""

TEXT_FAMILIES: tuple[str, ...] = tuple(name for name, f in FAMILIES.items() if f.kind == "text")
"""The causal-LM families (kind ``text``)."""


def family(name: str) -> Family | None:
    """The rules of family ``name``, or None for a family this table does not know."""
    return FAMILIES.get(name)


def kinds_of(family_name: str, registered: tuple[str, ...] | list[str]) -> tuple[str, ...]:
    """The kinds a model runs: those registered with it, then those its family runs today
    (a model registered before its family gained a kind, e.g. img2img, runs it too). A LoRA
    adapter (registered kind :data:`routing.timings.ADAPTER_KIND`) runs no kind of
    its family: only ``("adapter",)``."""
    if ADAPTER_KIND in registered:
        return (ADAPTER_KIND,)
    rules = FAMILIES.get(family_name)
    extra = tuple(kind for kind in rules.kinds if kind not in registered) if rules is not None else ()
    return (*registered, *extra)
