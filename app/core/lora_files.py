"""LoRA files as people download them (docs/operations.md "LoRA adapters"): one ``.safetensors``
file in the kohya / A1111 layout or in the diffusers / PEFT layout, recognised from its tensor
names (and, where the names leave SD 1.x/2.x and SDXL open, one tensor's width; the header,
:func:`app.core.safetensors.safetensors_header`) when it is registered:
which layout it is (the registry's ``source_format``: :data:`KOHYA` or :data:`DIFFUSERS`) and which
base it adapts (:data:`BASES`), so that a file for another family than ``--adapter-of``, or a file
that holds no LoRA at all, is refused before anything is copied (R1: the registry owns what a
worker may load).

Pure: tensor names (and shapes) in, a :class:`LoraLayout` out; no I/O.

The key forms, all of which diffusers 0.42's ``load_lora_weights`` reads (it converts kohya's
in ``lora_state_dict``: diffusers/loaders/lora_pipeline.py, lora_conversion_utils.py):

- kohya: ``lora_unet_<module path, '.' as '_'>.lora_down.weight`` with ``.lora_up.weight`` and
  ``.alpha`` (the scale is alpha / rank); text encoders ``lora_te_`` (SD 1.x) or ``lora_te1_`` /
  ``lora_te2_`` (SDXL); SDXL's UNet in the original naming (``lora_unet_input_blocks_``,
  ``output_blocks_``, ``middle_block_``); Flux ``lora_unet_double_blocks_`` / ``single_blocks_``.
- diffusers / PEFT: ``unet.<module path>.lora_A.weight`` / ``lora_B.weight`` (``transformer.``,
  ``text_encoder.``, ``text_encoder_2.``), or the older ``….lora.down.weight`` / ``lora.up.weight``
  that ``save_lora_weights`` still writes, or the attention processors' ``unet.….processor.to_k_lora.down.weight``
  of older diffusers. UNet and text-encoder keys must carry their component's prefix: without it
  (``unet.save_attn_procs``'s ``down_blocks.…``) ``load_lora_weights`` loads none and says nothing,
  so such a file is refused.

What the names cannot say: SD 1.x from SD 2.x (same module names; only tensor widths differ),
SD 1.x/2.x from SDXL where a diffusers-named file touches only blocks both UNets have (its
cross-attention width then decides, when it is a real one), nor which diffusion transformer a
``transformer.`` file without Flux's own blocks is for.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from app.core.errors import Rejected

LORA_WEIGHTS = "pytorch_lora_weights.safetensors"
"""The file diffusers' ``save_lora_weights`` writes and ``load_lora_weights`` reads first; a
single registered LoRA file is stored under this name in the adapter's model folder."""

KOHYA = "lora-kohya"
DIFFUSERS = "lora-diffusers"


@dataclass(frozen=True)
class Base:
    """What a LoRA adapts: ``what`` in words, ``families``: the registry families it fits."""

    what: str
    families: frozenset[str]


#: base name -> the families a LoRA of that base is registered for (``--adapter-of``)
BASES: Mapping[str, Base] = {
    "sd1": Base("a Stable Diffusion 1.x/2.x UNet", frozenset({"sd1", "sd1-pix2pix", "animatediff", "sd-upscale"})),
    "sdxl": Base("an SDXL UNet", frozenset({"sdxl"})),
    "unet": Base(
        "a Stable Diffusion UNet, 1.x/2.x or SDXL (the keys do not say which)",
        frozenset({"sd1", "sd1-pix2pix", "animatediff", "sd-upscale", "sdxl"}),
    ),
    "flux": Base("a Flux transformer", frozenset({"flux", "flux-kontext"})),
    "transformer": Base(
        "a diffusion transformer (the keys do not say which)", frozenset({"flux", "flux-kontext", "qwen-image", "wan"})
    ),
}

_KOHYA_KEY = re.compile(
    r"^lora_(?:unet|te[12]?)_\w+\.(?:lora_down\.weight|lora_up\.weight|lora_mid\.weight|alpha|dora_scale|diff|diff_b)$"
)
_PEFT_KEY = re.compile(
    r"\.(?:lora_[AB](?:\.[\w-]+)?\.(?:weight|bias)|lora\.(?:down|up)\.weight|lora_linear_layer\.(?:down|up)\.weight"
    r"|\w+_lora\.(?:down|up)\.weight|lora_magnitude_vector(?:\.[\w-]+)?(?:\.weight)?|alpha)$"
)

# Evidence of a base, strongest first: a key matching a later pattern only decides the base
# when no earlier one matched (a Flux file may carry CLIP keys ``lora_te1_``/``text_encoder.``
# and its T5 as ``text_encoder_2.``; an SDXL file may name its UNet as diffusers does). kohya's
# names say which UNet (SDXL's are the original ``input_blocks``...); diffusers' ``unet.`` names
# are the same for both but where SDXL has several transformer blocks per attention, so they
# leave it open ("unet") unless the cross-attention width decides (:data:`CONTEXT_WIDTHS`). The
# blocks that carry attentions differ too in the real UNets, but not in small test ones.
_EVIDENCE: tuple[tuple[str, re.Pattern[str]], ...] = (
    (
        "flux",
        re.compile(
            r"^lora_unet_(?:double|single)_blocks_|(?:^|\.)(?:double_blocks|single_blocks"
            r"|single_transformer_blocks)\."
        ),
    ),
    ("transformer", re.compile(r"^(?:transformer|diffusion_model)\.")),
    (
        "sdxl",
        re.compile(
            r"^lora_te[12]_|^lora_unet_(?:input_blocks|output_blocks|middle_block|label_emb)_"
            r"|^text_encoder_2\.|(?:^|\.)add_embedding\.|transformer_blocks[._][1-9]"
        ),
    ),
    (
        "sd1",
        re.compile(r"^lora_te_|^lora_unet_(?:down_blocks|up_blocks|mid_block)_"),
    ),
    ("unet", re.compile(r"^(?:unet\.|text_encoder\.)|^(?:down_blocks|up_blocks|mid_block)\.")),
)

CONTEXT_WIDTHS: Mapping[int, str] = {768: "sd1", 1024: "sd1", 2048: "sdxl"}
"""The cross-attention width (the text encoder's hidden size the UNet attends to) -> the base:
SD 1.x's CLIP ViT-L 768, SD 2.x's OpenCLIP ViT-H 1024, SDXL's two encoders concatenated 2048
(the ``cross_attention_dim`` of the real repositories' ``unet/config.json``). A LoRA of the
cross-attention's key or value projection has it as its down matrix's input width."""

_CONTEXT_NAMES: Mapping[int, str] = {768: "SD 1.x", 1024: "SD 2.x", 2048: "SDXL"}

_CONTEXT_KEY = re.compile(
    r"attn2[._]to_[kv]\.(?:lora_A(?:\.[\w-]+)?|lora\.down|lora_linear_layer\.down|lora_down)\.weight$"
    r"|attn2\.processor\.to_[kv]_lora\.down\.weight$"
)
_PREFIXED = re.compile(r"^(?:unet|text_encoder(?:_2)?)\.")
"""A diffusers-named UNet or text-encoder key as ``load_lora_weights`` reads it: under its
component's name. Without one (``down_blocks.…``, what ``unet.save_attn_procs`` wrote) it loads
none of them and says nothing (diffusers 0.42: the job would run without the adapter)."""
_SHOWN = 3  # keys named in a message

_KOHYA_TEXT_ENCODERS = ("lora_te_", "lora_te1_", "lora_te2_")
"""The prefixes of a kohya file's text-encoder keys: one per encoder (SD 1.x/2.x's one; SDXL's
first and second), each loaded by diffusers into its own component."""


@dataclass(frozen=True)
class LoraLayout:
    """A recognised LoRA file: ``source_format`` (:data:`KOHYA` or :data:`DIFFUSERS`), ``base``
    (a key of :data:`BASES`), ``evidence``: the first keys that decided the base (at most 3),
    ``tensors``: how many tensors it holds."""

    source_format: str
    base: str
    evidence: tuple[str, ...]
    tensors: int

    @property
    def families(self) -> frozenset[str]:
        return BASES[self.base].families

    def check_family(self, family: str, name: str) -> None:
        """Raise unless this LoRA fits ``family``.

        Raises:
            Rejected: reason ``adapter_family_mismatch``, naming the file ``name``, what it
                adapts, the keys that say so and the families it fits.
        """
        if family in self.families:
            return
        fits = ", ".join(sorted(self.families))
        raise Rejected(
            f"{name} is a LoRA for {BASES[self.base].what} (keys like {', '.join(self.evidence)}), not for family "
            f"{family!r}; register it with --adapter-of one of: {fits}",
            reason="adapter_family_mismatch",
        )


def recognise(keys: Iterable[str], name: str, shapes: Mapping[str, Sequence[int]] | None = None) -> LoraLayout:
    """The layout and base of a LoRA file whose tensors are named ``keys`` (its header's names,
    ``__metadata__`` left out); ``name`` names the file in messages. ``shapes`` (tensor name ->
    shape, from the same header) decides a UNet file whose names fit SD 1.x/2.x and SDXL alike by
    its cross-attention width (:data:`CONTEXT_WIDTHS`); without it, or at another width (a
    tiny test model), such a file's base is ``unet``.

    Raises:
        Rejected: reason ``not_an_adapter``: no tensors, no LoRA tensor (a full checkpoint, or
            anything else: the message shows the first keys), tensors that are not LoRA weights
            beside LoRA ones, LoRA keys of no base in :data:`BASES`, or diffusers-named UNet keys
            without the ``unet.`` prefix (:data:`_PREFIXED`: diffusers would load none of them),
            or kohya text-encoder keys of self-attention without its ``out_proj``
            (:func:`_check_text_encoder_layout`).
    """
    names = sorted(keys)
    if not names:
        raise Rejected(
            f"{name} holds no tensors; a LoRA file holds .lora_down/.lora_up (kohya) or "
            ".lora_A/.lora_B (diffusers/PEFT) weights",
            reason="not_an_adapter",
        )
    kohya = [k for k in names if _KOHYA_KEY.match(k)]
    peft = [k for k in names if not _KOHYA_KEY.match(k) and _PEFT_KEY.search(k)]
    other = [k for k in names if not _KOHYA_KEY.match(k) and not _PEFT_KEY.search(k)]
    if not kohya and not peft:
        raise Rejected(
            f"{name} holds no LoRA weights: its {len(names)} tensors are named like {_some(names)} (a full "
            "checkpoint or another file); a LoRA file's keys end in .lora_down.weight/.lora_up.weight (kohya) or "
            ".lora_A.weight/.lora_B.weight (diffusers/PEFT)",
            reason="not_an_adapter",
        )
    if kohya and peft:
        raise Rejected(
            f"{name} mixes kohya keys ({_some(kohya)}) with diffusers/PEFT keys ({_some(peft)}); diffusers "
            "loads a file of one layout",
            reason="not_an_adapter",
        )
    if other:
        raise Rejected(
            f"{name} holds {len(other)} tensors that are not LoRA weights, e.g. {_some(other)}, beside "
            f"{len(names) - len(other)} LoRA ones; it is not a LoRA file diffusers can load",
            reason="not_an_adapter",
        )
    _check_text_encoder_layout(kohya, name)
    for base, pattern in _EVIDENCE:
        evidence = [k for k in names if pattern.search(k)]
        if evidence:
            if not kohya and base in ("sdxl", "unet") and not any(_PREFIXED.match(k) for k in names):
                raise Rejected(
                    f"{name}'s LoRA keys name UNet modules without the `unet.` prefix (e.g. {_some(evidence)}: a "
                    "file of `unet.save_attn_procs`); diffusers' load_lora_weights would load none of them. Save it "
                    "again with the pipeline's save_lora_weights, or prefix each key with `unet.`",
                    reason="not_an_adapter",
                )
            if base == "unet" and shapes:
                found = context_key(shapes)
                if found is not None and shapes[found][1] in CONTEXT_WIDTHS:
                    base, evidence = CONTEXT_WIDTHS[shapes[found][1]], [f"{found} of width {shapes[found][1]}"]
            return LoraLayout(KOHYA if kohya else DIFFUSERS, base, tuple(evidence[:_SHOWN]), len(names))
    raise Rejected(
        f"{name} holds LoRA weights for no base Homefleet recognises (keys like {_some(names)}); "
        f"known: {', '.join(BASES[b].what for b in BASES)}",
        reason="not_an_adapter",
    )


def _check_text_encoder_layout(kohya: Sequence[str], name: str) -> None:
    """Refuse a kohya file whose keys for one text encoder adapt self-attention projections but
    not ``out_proj``. diffusers (0.42) renames those keys to its older attention-processor names
    and tells that layout by a ``to_out_lora`` key alone: without one it refuses the encoder's
    keys ("Could not automatically infer state dict type"), and beside MLP keys it loads those
    and leaves the self-attention out without a word (both measured on tiny-sd). Files kohya's
    scripts write adapt all four projections.

    Raises:
        Rejected: reason ``not_an_adapter``, naming the encoder's first such keys.
    """
    for prefix in _KOHYA_TEXT_ENCODERS:
        attention = [k for k in kohya if k.startswith(prefix) and "_self_attn_" in k]
        if attention and not any("_self_attn_out_proj." in k for k in attention):
            raise Rejected(
                f"{name}'s text-encoder keys ({prefix}…) adapt self-attention without its out_proj (e.g. "
                f"{_some(attention)}); diffusers tells a kohya text encoder's layout by an out_proj key: it would "
                "refuse these keys, or apply the file without their self-attention and say nothing. Use a file "
                "that adapts out_proj too (as kohya's scripts write them), or one without these keys",
                reason="not_an_adapter",
            )


def context_key(shapes: Mapping[str, Sequence[int]]) -> str | None:
    """The first (by name) cross-attention key or value down matrix of a UNet LoRA (``shapes``:
    tensor name -> shape, from its header; any layout :data:`_CONTEXT_KEY` knows, kohya's
    included), or None when it adapts none. Its shape is (rank, the width the LoRA was made for)."""
    return next((k for k in sorted(shapes) if _CONTEXT_KEY.search(k) and len(shapes[k] or ()) == 2), None)


def context_width(shapes: Mapping[str, Sequence[int]]) -> int | None:
    """The cross-attention width (the text encoder's hidden size the UNet attends to) that a UNet
    LoRA was made for: its :func:`context_key`'s input width; None when it adapts no
    cross-attention key or value (it then fits any width as far as this check can tell)."""
    key = context_key(shapes)
    return None if key is None else int(shapes[key][1])


_DIFFUSERS_PAIR = re.compile(
    r"^(?P<component>unet|text_encoder(?:_2)?|transformer)\.(?P<module>.+?)\."
    r"(?:lora_(?P<ab>[AB])(?:\.[\w-]+)?|lora\.(?P<ud>down|up)|lora_linear_layer\.(?P<ud2>down|up))\.weight$"
)
_PROCESSOR_PAIR = re.compile(
    r"^(?P<component>unet)\.(?P<module>.+?)\.processor\.(?P<projection>to_[qkv]|to_out)_lora\.(?P<ud>down|up)\.weight$"
)
_KOHYA_PAIR = re.compile(r"^(?P<prefix>lora_unet_|lora_te[12]?_)(?P<module>\w+)\.lora_(?P<ud>down|up)\.weight$")
_KOHYA_DIFFUSERS_UNET = ("down_blocks_", "mid_block_", "up_blocks_")
"""kohya UNet names that are diffusers' module paths with underscores (SD 1.x/2.x files); SDXL's
original names (``input_blocks_``…) and Flux's (``double_blocks_``…) are converted by diffusers
to other paths, which this module does not redo: their tensors are not judged."""
_KOHYA_COMPONENTS: Mapping[str, str] = {
    "lora_unet_": "unet",
    "lora_te_": "text_encoder",
    "lora_te1_": "text_encoder",
    "lora_te2_": "text_encoder_2",
}


@dataclass(frozen=True)
class Misfit:
    """A LoRA tensor whose width is not its base module's: ``key`` (the LoRA's tensor) of
    ``shape``, ``component`` and ``module`` (the model's module it adapts, whose weight is
    ``base_shape``), ``side``: ``"input"`` (a down matrix: its second dimension is the module's
    input width), ``"output"`` (an up matrix: its first, the output width) or ``"missing"`` (the
    model has no such module; ``module`` as the LoRA names it, ``base_shape`` empty)."""

    key: str
    shape: tuple[int, ...]
    component: str
    module: str
    base_shape: tuple[int, ...]
    side: str


def adapted_module(key: str) -> tuple[str, str, str] | None:
    """What one LoRA tensor adapts: (component, module path as the component's weight file names
    it without ``.weight``, ``"input"`` for a down matrix or ``"output"`` for an up one); kohya's
    module path keeps its underscores (``down_blocks_0_…``: matched against the model's names with
    their dots made underscores). None for an alpha, a bias or a key of no known layout (SDXL's
    kohya ``input_blocks`` names, Flux's kohya names): not checked."""
    found = _DIFFUSERS_PAIR.match(key)
    if found is not None:
        down = found["ab"] == "A" or (found["ud"] or found["ud2"]) == "down"
        return found["component"], found["module"], "input" if down else "output"
    found = _PROCESSOR_PAIR.match(key)
    if found is not None:
        projection = "to_out.0" if found["projection"] == "to_out" else found["projection"]
        return found["component"], f"{found['module']}.{projection}", "input" if found["ud"] == "down" else "output"
    found = _KOHYA_PAIR.match(key)
    if found is not None and (found["prefix"] != "lora_unet_" or found["module"].startswith(_KOHYA_DIFFUSERS_UNET)):
        return _KOHYA_COMPONENTS[found["prefix"]], found["module"], "input" if found["ud"] == "down" else "output"
    return None


def first_misfit(lora: Mapping[str, Sequence[int]], base: Mapping[str, Mapping[str, Sequence[int]]]) -> Misfit | None:
    """The first LoRA tensor (by name) of ``lora`` (tensor name -> shape, its header's) whose
    width differs from the module it adapts in ``base`` (component -> the model's weight name
    without ``.weight`` -> shape, from its weight files' headers); else the first that adapts a
    module the model lacks in a component it has (``side`` ``"missing"``, ``base_shape`` empty:
    diffusers would load the rest and leave it out without a word); None when every tensor fits.
    A tensor of a component the model lacks, or of a layout :func:`adapted_module` does not map,
    is not judged. Text encoders' names are compared without a leading ``text_model.``
    (transformers 5 saves CLIP without it)."""
    lookups: dict[str, dict[str, tuple[str, Sequence[int]]]] = {}
    for component, shapes in base.items():
        lookup: dict[str, tuple[str, Sequence[int]]] = {}
        for name, shape in shapes.items():
            bare = name.removeprefix("text_model.")
            lookup[bare] = lookup[bare.replace(".", "_")] = (name, shape)
        lookups[component] = lookup
    missing: Misfit | None = None
    for key in sorted(lora):
        shape = tuple(lora[key] or ())
        adapted = adapted_module(key)
        if adapted is None or len(shape) < 2 or adapted[0] not in lookups:
            continue
        component, module, side = adapted
        found = lookups[component].get(module.removeprefix("text_model.").removeprefix("text_model_"))
        if found is None:
            missing = missing or Misfit(key, shape, component, module, (), "missing")
            continue
        name, base_shape = found
        if len(base_shape) < 2:
            continue
        lora_width, base_width = (shape[1], base_shape[1]) if side == "input" else (shape[0], base_shape[0])
        if lora_width != base_width:
            return Misfit(key, shape, component, name, tuple(base_shape), side)
    return missing


def width_name(width: int) -> str:
    """``width`` in words for messages: ``"768 (SD 1.x)"``, or the bare number for a width no
    released base has (a tiny test model's)."""
    return f"{width} ({_CONTEXT_NAMES[width]})" if width in _CONTEXT_NAMES else str(width)


def weight_file(paths: Iterable[str]) -> str | None:
    """The file of an adapter folder that workers load (``paths``: its files, relative POSIX
    paths): :data:`LORA_WEIGHTS` when it has one, else its first top-level ``*.safetensors``
    file, else None."""
    names = sorted(p for p in paths if p.endswith(".safetensors") and "/" not in p)
    if LORA_WEIGHTS in names:
        return LORA_WEIGHTS
    return names[0] if names else None


def _some(keys: list[str]) -> str:
    return ", ".join(keys[:_SHOWN]) + (f" (and {len(keys) - _SHOWN} more)" if len(keys) > _SHOWN else "")
