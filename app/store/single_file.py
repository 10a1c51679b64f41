"""Single-file checkpoints (A1111 / ComfyUI / Civitai): one ``.safetensors`` with the original
training code's key names, converted ONCE, at registration, into a diffusers folder with
diffusers' own single-file loader (docs/operations.md, "Single-file checkpoints").

What a family's file must hold (the original layouts; ``diffusers/loaders/single_file_utils.py``
converts them):

======  ======================================================================================
sd1     UNet ``model.diffusion_model.``, VAE ``first_stage_model.``, CLIP-L
        ``cond_stage_model.transformer.text_model.``; 4 latent input channels
sdxl    UNet ``model.diffusion_model.`` (``label_emb``), VAE ``first_stage_model.``, CLIP-L
        ``conditioner.embedders.0.transformer.``, OpenCLIP ``conditioner.embedders.1.model.``
flux    the FLUX.1 transformer only: ``double_blocks.N.…``, ``single_blocks.N.…`` (optionally under
        ``model.diffusion_model.``); the VAE, text encoders and tokenizers come from ``--config``
======  ======================================================================================

The configs diffusers needs offline (``from_single_file(config=FOLDER, local_files_only=True)``)
ship in ``app/store/family_configs/<family>/`` (SD 1.5, SDXL base 1.0, FLUX.1-dev component
configs); a CLIP tokenizer's BPE vocabulary (49,408 tokens) is not shipped: it is built from
``bpe_simple_vocab_16e6.txt.gz`` of an installed ``open_clip_torch`` when there is one, else a
``--config DIR`` (a diffusers folder of the family) must give the tokenizers. ``--config``
replaces the shipped configs: its component configs, tokenizers and (Flux) the components the
file lacks are used.

Nothing here unpickles: a file that is not safetensors (a ``.ckpt`` pickle) is refused before
any loader sees it (R4: only files whose bytes are data).
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import shutil
import textwrap
from dataclasses import dataclass
from pathlib import Path

from app.core.errors import Rejected
from app.core.quiet import quiet_libraries
from app.core.safetensors import looks_like_safetensors
from app.store.selection import check_exists, model_json

FAMILY_CONFIGS = Path(__file__).with_name("family_configs")
"""The shipped configs: ``<family>/model_index.json`` and each component's config."""


@dataclass(frozen=True)
class SingleFileFamily:
    """A family a single-file checkpoint can be registered as.

    Attributes:
        name: the registry family (``app/core/families.py``).
        pipeline_class: the diffusers pipeline it becomes.
        parts: component -> the key prefix the file must hold it under (the original layout).
        whole: the file holds the whole pipeline (sd1, sdxl) or the denoiser only (flux).
    """

    name: str
    pipeline_class: str
    parts: dict[str, tuple[str, ...]]
    whole: bool = True


FAMILIES: dict[str, SingleFileFamily] = {
    "sd1": SingleFileFamily(
        "sd1",
        "StableDiffusionPipeline",
        {
            "unet": ("model.diffusion_model.",),
            "vae": ("first_stage_model.",),
            "text_encoder": ("cond_stage_model.transformer.text_model.",),
        },
    ),
    "sdxl": SingleFileFamily(
        "sdxl",
        "StableDiffusionXLPipeline",
        {
            "unet": ("model.diffusion_model.",),
            "vae": ("first_stage_model.",),
            "text_encoder": ("conditioner.embedders.0.transformer.text_model.",),
            "text_encoder_2": ("conditioner.embedders.1.model.",),
        },
    ),
    "flux": SingleFileFamily(
        "flux", "FluxPipeline", {"transformer": ("double_blocks.", "model.diffusion_model.double_blocks.")}, whole=False
    ),
}


def with_article(family: str) -> str:
    """``family`` after "a" or "an" as it is read: "an sd1", "an sdxl" (read S-D), "a flux"."""
    return f"{'an' if family.lower().startswith(('sd', 'a', 'e', 'i', 'o', 'u')) else 'a'} {family}"


_LORA_MARKS = ("lora_up.", "lora_down.", "lora_A.", "lora_B.", ".lora.up.", ".lora.down.", "lora_unet_", "lora_te")


def read_keys(path: Path) -> dict[str, list[int]]:
    """Tensor name -> shape from the safetensors header of ``path`` (no tensor is read).

    Raises:
        Rejected: nothing at ``path`` (reason ``path_not_found``); not a file, a
            ``.ckpt``/``.pt``/``.bin`` pickle (never unpickled), or not a safetensors file (reason
            ``not_a_checkpoint``); a safetensors file cut short or damaged (reason
            ``incomplete_checkpoint``).
    """
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    check_exists(path)
    if not path.is_file():
        raise Rejected(f"{path} is not a file", reason="not_a_checkpoint")
    if path.suffix.lower() in (".ckpt", ".pt", ".pth", ".bin"):
        raise Rejected(
            f"{path.name} is a pickled checkpoint ({path.suffix}); Homefleet never unpickles a file "
            "(it can run code): convert it to .safetensors where you trust it",
            reason="not_a_checkpoint",
        )
    try:
        with safe_open(str(path), framework="numpy") as handle:
            return {key: list(handle.get_slice(key).get_shape()) for key in handle.keys()}  # noqa: SIM118
    except (SafetensorError, OSError, ValueError) as error:
        if looks_like_safetensors(path):  # its header is there: the rest is cut short or damaged
            raise Rejected(
                f"{path.name} cannot be loaded ({error}): a truncated or damaged file (an interrupted download? "
                "download it again)",
                reason="incomplete_checkpoint",
            ) from error
        raise Rejected(f"{path.name} is not a safetensors checkpoint ({error})", reason="not_a_checkpoint") from error


def stored_dtype(path: Path) -> str:
    """The floating dtype most of the checkpoint's tensors are stored in (``F16``, ``BF16``,
    ``F32``, …, as the safetensors header names it); ``F32`` for a file without floats."""
    from collections import Counter

    from safetensors import safe_open

    with safe_open(str(path), framework="numpy") as handle:
        found = Counter(handle.get_slice(key).get_dtype() for key in handle.keys())  # noqa: SIM118
    floats = [(count, dtype) for dtype, count in found.items() if dtype.startswith(("F", "BF"))]
    return max(floats)[1] if floats else "F32"


def identify(keys: dict[str, list[int]]) -> str:
    """What the key layout is: ``sd1``, ``sdxl``, ``flux`` (registrable), or a description of
    what it is instead (``a LoRA adapter``, ``SD 2.x``, ``an SD 1.x inpainting model``, …)."""
    from diffusers.loaders.single_file_utils import CHECKPOINT_KEY_NAMES as NAMES

    if any(mark in key for key in keys for mark in _LORA_MARKS):
        return "a LoRA adapter"
    if any(key in keys for key in NAMES["flux"]):
        return "flux"
    if "model.diffusion_model.input_blocks.0.0.weight" in keys:
        channels = keys["model.diffusion_model.input_blocks.0.0.weight"][1]
        if NAMES["open_clip_sdxl"] in keys:
            return "sdxl" if channels == 4 else f"an SDXL model with {channels} input channels (inpainting)"
        if NAMES["open_clip_sdxl_refiner"] in keys:
            return "an SDXL refiner"
        if NAMES["open_clip"] in keys:
            return "SD 2.x (OpenCLIP-H text encoder)"
        if NAMES["clip"] in keys:
            if channels == 4:
                return "sd1"
            kind = {8: "instruct-pix2pix", 9: "inpainting"}.get(channels, f"{channels}-channel")
            return f"an SD 1.x {kind} model"
        return "a UNet in the original layout without a known text encoder"
    if any(key.startswith(("down_blocks.", "transformer_blocks.", "unet.", "text_model.")) for key in keys):
        return "weights already in diffusers/transformers names (one component, not a single-file checkpoint)"
    return "an unknown layout"


def check_checkpoint(path: Path, family: str) -> dict[str, list[int]]:
    """The header of ``path`` if it is a single-file checkpoint of ``family`` holding every part
    the family needs (:data:`FAMILIES`); returns its tensor shapes.

    Raises:
        Rejected: an unknown family (``unknown_family``); not a safetensors checkpoint, a
            LoRA file, or an unknown layout (``not_a_checkpoint``); keys of another family
            (``wrong_family``, naming what the keys are); a part missing (``incomplete_checkpoint``).
    """
    if family not in FAMILIES:
        raise Rejected(
            f"single-file family {family!r} is not supported; supported: {', '.join(FAMILIES)}", reason="unknown_family"
        )
    keys = read_keys(path)
    found = identify(keys)
    if found == "a LoRA adapter":
        raise Rejected(
            f"{Path(path).name} is a LoRA adapter (lora_up/lora_down or lora_A/lora_B keys), not a "
            "checkpoint; register it as an adapter (--adapter-of)",
            reason="not_a_checkpoint",
        )
    if found not in FAMILIES:
        reason = "not_a_checkpoint" if found.startswith(("an unknown", "weights already")) else "wrong_family"
        raise Rejected(
            f"{Path(path).name} is not {with_article(family)} checkpoint: its keys are those of {found}", reason=reason
        )
    if found != family:
        raise Rejected(
            f"{Path(path).name} is not {with_article(family)} checkpoint: its keys are those of {found}",
            reason="wrong_family",
        )
    spec = FAMILIES[family]
    missing = [part for part, prefixes in spec.parts.items() if not any(key.startswith(prefixes) for key in keys)]
    if missing:
        wanted = "; ".join(f"{part}: {' or '.join(spec.parts[part])}…" for part in missing)
        raise Rejected(
            f"{Path(path).name} lacks part of the {family} pipeline ({wanted})", reason="incomplete_checkpoint"
        )
    return keys


def clip_vocabulary() -> Path | None:
    """CLIP's BPE merges (``bpe_simple_vocab_16e6.txt.gz``): the copy shipped beside the family
    configs (``family_configs/clip/``), else the one an installed ``open_clip_torch`` ships (found
    without importing it), else None."""
    shipped = FAMILY_CONFIGS / "clip" / "bpe_simple_vocab_16e6.txt.gz"
    if shipped.is_file():
        return shipped
    spec = importlib.util.find_spec("open_clip")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(folder) / "bpe_simple_vocab_16e6.txt.gz"
        if candidate.is_file():
            return candidate
    return None


def write_clip_tokenizer_files(bpe: Path, folder: Path) -> None:
    """``vocab.json`` (49,408 tokens) and ``merges.txt`` of the OpenAI CLIP tokenizer, built from
    its BPE merges file the way CLIP's own ``SimpleTokenizer`` builds its encoder: the 256 byte
    characters, the same with ``</w>``, the first 48,894 merges, then the two special tokens."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    lines = gzip.decompress(bpe.read_bytes()).decode("utf-8").split("\n")
    merges = [tuple(line.split()) for line in lines[1 : 49152 - 256 - 2 + 1]]
    chars = list(bytes_to_unicode().values())
    vocab = chars + [char + "</w>" for char in chars] + ["".join(merge) for merge in merges]
    vocab += ["<|startoftext|>", "<|endoftext|>"]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.json").write_text(
        json.dumps({token: i for i, token in enumerate(vocab)}, ensure_ascii=False), encoding="utf-8"
    )
    (folder / "merges.txt").write_text(
        "#version: 0.2\n" + "\n".join(" ".join(m) for m in merges) + "\n", encoding="utf-8"
    )


def config_folder(family: str, config: Path | None, scratch: Path) -> Path:
    """The diffusers folder whose configs (and tokenizers; for flux, its other components) the
    conversion uses: ``config`` when given (checked to be a diffusers folder of ``family``),
    else the shipped one, completed with CLIP tokenizer files in ``scratch``.

    Raises:
        Rejected: ``config`` does not exist (``path_not_found``), its ``model_index.json`` is no
            JSON object (``not_a_model``), it is not a diffusers folder of the family (``invalid_config``); no
            ``config`` for flux, or for sd1/sdxl without a CLIP vocabulary here (``needs_config``).
    """
    spec = FAMILIES[family]
    if config is not None:
        index = Path(config) / "model_index.json"
        check_exists(Path(config))
        if not index.is_file():
            raise Rejected(
                f"--config {config} is not a diffusers folder (no model_index.json)", reason="invalid_config"
            )
        class_name = model_json(index).get("_class_name")
        if class_name != spec.pipeline_class:
            raise Rejected(
                f"--config {config} is a folder of pipeline class {class_name}; {with_article(family)} checkpoint "
                f"needs a {spec.pipeline_class} folder",
                reason="invalid_config",
            )
        return Path(config)
    if not spec.whole:
        raise Rejected(
            f"{with_article(family)} single file holds only the transformer: pass --config DIR, a "
            f"{spec.pipeline_class} diffusers folder with the VAE, text encoders and tokenizers (its "
            "transformer/ may be absent)",
            reason="needs_config",
        )
    bpe = clip_vocabulary()
    if bpe is None:
        raise Rejected(
            f"the shipped {family} config has no CLIP tokenizer vocabulary (49,408 tokens, not shipped): "
            f"pass --config DIR, a {spec.pipeline_class} diffusers folder with its tokenizer/ folders, or "
            "install open_clip_torch (it ships CLIP's BPE vocabulary)",
            reason="needs_config",
        )
    target = scratch / "config"
    shutil.copytree(FAMILY_CONFIGS / family, target)
    for tokenizer in sorted(target.glob("tokenizer*")):
        write_clip_tokenizer_files(bpe, tokenizer)
    return target


def convert(path: Path, family: str, target: Path, config: Path | None = None) -> Path:
    """Convert the single-file checkpoint ``path`` of ``family`` into the diffusers folder
    ``target`` (created; ``save_pretrained(safe_serialization=True)``): sd1/sdxl with
    ``StableDiffusion(XL)Pipeline.from_single_file(path, config=…, local_files_only=True)``; flux
    with ``FluxTransformer2DModel.from_single_file`` and the other components of ``config``
    (``FluxPipeline.from_pretrained``). Components are saved in the dtype most of the file's
    tensors have (:func:`stored_dtype`: an fp16 checkpoint stays fp16; the variant workers load
    is the registration's ``precision``). Offline: nothing is fetched.

    Raises:
        Rejected: what :func:`check_checkpoint` and :func:`config_folder` refuse; the loader
            failed (``conversion_failed``: e.g. shapes that do not match the config); a
            component left without weights (``incomplete_checkpoint``).
    """
    check_checkpoint(path, family)
    target = Path(target)
    scratch = target.parent / f".{target.name}.scratch"
    scratch.mkdir(parents=True, exist_ok=True)
    try:
        folder = config_folder(family, config, scratch)
        source = Path(path)
        if source.suffix != ".safetensors":  # `.sft` (ComfyUI, BFL's flux1-dev.sft), `.SAFETENSORS`:
            # diffusers picks its reader by the extension, and would read this safetensors file as a pickle
            source = scratch / f"{source.stem}.safetensors"
            source.symlink_to(Path(path).resolve())
        with quiet_libraries():
            described = f"the config {config}" if config is not None else f"the shipped {family} config"
            pipe = _load(source, family, folder, stored_dtype(source), described)
            for name, component in pipe.components.items():
                parameters = getattr(component, "parameters", None)
                if parameters is not None and any(p.is_meta for p in parameters()):
                    raise Rejected(
                        f"{Path(path).name} left {name} without weights (keys the {family} converter "
                        "expects are missing)",
                        reason="incomplete_checkpoint",
                    )
            pipe.save_pretrained(str(target), safe_serialization=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return target


def _load(path: Path, family: str, folder: Path, dtype: str, described: str):
    import diffusers
    import torch
    from diffusers.loaders.single_file_utils import SingleFileComponentError

    torch_dtype = {"F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}.get(dtype, torch.float32)
    shipped = FAMILY_CONFIGS / family
    try:
        if family == "flux":
            transformer_config = folder if (folder / "transformer" / "config.json").is_file() else shipped
            transformer = diffusers.FluxTransformer2DModel.from_single_file(
                str(path),
                config=str(transformer_config),
                subfolder="transformer",
                local_files_only=True,
                torch_dtype=torch_dtype,
            )
            return diffusers.FluxPipeline.from_pretrained(str(folder), transformer=transformer, local_files_only=True)
        pipeline = getattr(diffusers, FAMILIES[family].pipeline_class)
        return pipeline.from_single_file(str(path), config=str(folder), local_files_only=True, torch_dtype=torch_dtype)
    except (SingleFileComponentError, ValueError, RuntimeError, OSError, KeyError) as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        first = textwrap.shorten(first, width=400, placeholder=" [...]")  # at a word: torch lists every shape
        raise Rejected(
            f"{path.name} did not convert as {family} with {described}: {first} (the "
            "config's shapes must match the checkpoint's: pass --config DIR of the same model size)",
            reason="conversion_failed",
        ) from error
