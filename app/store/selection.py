"""What registering a model folder takes (R1, R4): exactly the files its pipeline loads, chosen the
way diffusers chooses them when it fetches a pipeline, so that only those are hashed, copied, listed
in the manifest, synced and priced (docs/operations.md, "What registration takes").

A downloaded repository holds much more than a pipeline loads: ``*.fp16.safetensors`` beside the
full-precision files, ``*.bin`` twins, flax ``*.msgpack``, ONNX and OpenVINO exports, single-file
checkpoints at the root, folders ``model_index.json`` does not name, README, LICENSE and images.

A diffusers folder (``model_index.json``), as ``DiffusionPipeline.download`` selects:

- the components ``model_index.json`` names, but those set to ``[null, null]``;
- in a component holding weights (a *model folder*): its ``config.json``, the transformers files
  read beside it (``generation_config.json``, ``preprocessor_config.json``, ...) and the weights
  diffusers' ``variant_compatible_siblings`` picks: the precision's variant files where the
  component has them (``--precision fp16``: ``*.fp16.safetensors``, sharded
  ``*.fp16-0000k-of-0000n.safetensors`` with their ``*.safetensors.index.fp16.json``; bf16 likewise
  with ``bf16`` files), else its full-precision files (shards with their index json); each
  component on its own, as a pipeline loads a folder on disk: its safetensors where it has them,
  else its ``.bin`` (diffusers' ``_get_ignore_patterns`` per component); never flax or ONNX weights;
- every file of a component without weights (tokenizer, scheduler, feature extractor), but flax,
  ONNX and ``.bin`` files when safetensors are taken;
- ``model_index.json`` itself, and nothing else at the root.

A transformers causal-LM folder (``config.json`` with ``architectures``, :mod:`app.core.textgen`):
its root ``config.json``, ``generation_config.json``, tokenizer and chat-template files and its
safetensors weights (``model.safetensors`` or shards with ``model.safetensors.index.json``;
``pytorch_model*.bin`` only when there are no safetensors); always the full-precision files.

A LoRA adapter folder: its root ``*.safetensors``.

Symbolic links are followed (a Hugging Face cache snapshot is links into ``blobs/``): sizes are
the targets' sizes and a copy holds the real bytes.
"""

from __future__ import annotations

import codecs
import fnmatch
import json
import logging
import os
import posixpath
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from app.core.errors import Rejected
from app.core.lora_files import LORA_WEIGHTS
from app.core.textgen import architectures
from app.core.variants import PRECISION_FILE_VARIANTS, check_variant

DIFFUSERS = "diffusers"
TRANSFORMERS = "transformers"
ADAPTER = "lora-diffusers"
HF_CACHE = "hf-cache"

#: Files transformers reads beside a model's ``config.json`` or a tokenizer (diffusers'
#: ``TRANSFORMERS_COMPONENT_AUX_FILES`` plus the tokenizer files of the usual tokenizer classes).
TOKENIZER_FILES: frozenset[str] = frozenset(
    {
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "added_tokens.json",
        "vocab.json",
        "vocab.txt",
        "merges.txt",
        "tokenizer.model",
        "spiece.model",
        "sentencepiece.bpe.model",
        "chat_template.jinja",
        "chat_template.json",
    }
)
AUX_FILES: frozenset[str] = frozenset(
    {
        "generation_config.json",
        "preprocessor_config.json",
        "processor_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
    }
)
_SHARDED = r"(-\d{5}-of-\d{5})?"
_COMPONENT = re.compile(r"^(?!\.\.?$)[A-Za-z0-9_.-]+$")  # a component is a folder right under the model's
_TEXT_SAFETENSORS = re.compile(rf"^model{_SHARDED}\.safetensors$|^model\.safetensors\.index\.json$")
_TEXT_BIN = re.compile(rf"^pytorch_model{_SHARDED}\.bin$|^pytorch_model\.bin\.index\.json$")
_CHECKPOINT_SUFFIXES = (".safetensors", ".ckpt", ".bin", ".pt", ".pth", ".gguf", ".sft")
_MEDIA_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".gif", ".mp4", ".webm", ".avi", ".mov")
_ANY_VARIANT = re.compile(
    r"^[^.]+\.(?P<variant>[a-z0-9_]+?)(-\d{5}-of-\d{5})?\.(safetensors|bin)$"
    r"|^[^.]+\.(safetensors|bin)\.index\.(?P<index_variant>[a-z0-9_]+)\.json$"
)


@dataclass(frozen=True)
class Selection:
    """The files of a model folder that registration takes, and those it leaves out.

    ``taken``: relative POSIX path -> size in bytes (a link's target size); ``left_out``:
    relative path -> (size in bytes, why it is left out); ``source_format``: ``diffusers``,
    ``transformers`` or ``lora-diffusers``; ``variant``: the diffusers variant whose files are
    taken for some component (``fp16``, ``bf16``) or None (full precision only).
    """

    source_format: str
    taken: dict[str, int]
    left_out: dict[str, tuple[int, str]] = field(default_factory=dict)
    variant: str | None = None

    @property
    def taken_bytes(self) -> int:
        return sum(self.taken.values())

    @property
    def left_out_bytes(self) -> int:
        return sum(size for size, _ in self.left_out.values())


def check_exists(path: Path) -> None:
    """Check that ``path``, a model folder or file to register, exists on this machine.

    Raises:
        Rejected: nothing is there, or a broken link (reason ``path_not_found``).
    """
    if not Path(path).exists():
        broken = " (a broken link)" if Path(path).is_symlink() else ""
        raise Rejected(f"{path} does not exist{broken}", reason="path_not_found")


def select_files(folder: Path, precision: str = "fp32", *, adapter: bool = False) -> Selection:
    """The files of ``folder`` that a model registered at ``precision`` (fp32 | bf16 | fp16) loads
    (the module's rules), or of a LoRA adapter folder with ``adapter``.

    Raises:
        Rejected: an unknown ``precision`` (reason ``invalid_variant``), a taken file is a
            broken link (reason ``incomplete_model``: an interrupted download, naming it), or a
            component holds weights but none the pipeline loads (reason
            ``no_loadable_weights``, e.g. only ``.fp16`` files for fp32).
    """
    try:  # an unknown precision would otherwise be taken as full precision and refused for its files
        check_variant(precision, None)
    except ValueError as error:
        raise Rejected(str(error), reason="invalid_variant", param="precision") from error
    folder = Path(folder)
    files = _list_files(folder)
    if adapter:
        weights = sorted(p for p in files if "/" not in p and p.endswith(".safetensors"))
        if len(weights) > 1 and LORA_WEIGHTS not in weights:
            raise Rejected(
                f"{folder} holds {len(weights)} LoRA files ({', '.join(weights[:5])}); a worker loads one: "
                f"register the one you want (`homefleet models add {folder / weights[-1]} --adapter-of "
                "FAMILY`)",
                reason="ambiguous_adapter",
            )
        taken = {LORA_WEIGHTS if LORA_WEIGHTS in weights else weights[0]} if weights else set()
        selection = _finish(
            ADAPTER, folder, files, taken, lambda p: f"not the LoRA weights a worker loads ({', '.join(sorted(taken))})"
        )
    elif (folder / "model_index.json").is_file():
        selection = _select_diffusers(folder, files, PRECISION_FILE_VARIANTS.get(precision))
        one_checkpoint_each(selection, _loaders(folder, DIFFUSERS))
    elif architectures(folder):
        selection = _select_transformers(folder, files)
        one_checkpoint_each(selection, _loaders(folder, TRANSFORMERS))
    else:
        selection = _finish(DIFFUSERS, folder, files, set(files), lambda p: "")
    junk = [p for p in selection.taken if _is_junk(p)]
    for path in junk:  # no loader reads them: hashed and synced, a Finder's touch would withdraw the model
        selection.left_out[path] = (selection.taken.pop(path), JUNK_WHY)
    for path, (size, why) in list(selection.left_out.items()):  # said, though nothing loads it
        if (folder / path).is_symlink() and not (folder / path).exists():
            selection.left_out[path] = (size, f"{why}; a broken link: its target is missing")
    broken = sorted(p for p in selection.taken if not (folder / p).is_file())
    if broken:
        raise Rejected(
            f"{folder}: {', '.join(broken)} "
            + ("is a broken link (its target is" if len(broken) == 1 else "are broken links (their targets are")
            + " missing: an interrupted download?); download the model again",
            reason="incomplete_model",
        )
    check_shards(folder, selection.taken)
    return selection


def _loaders(folder: Path, source_format: str) -> dict[str, str]:
    """Folder of weights (``""``: the model's root) -> the library whose loader reads it:
    :data:`TRANSFORMERS` for a causal LM's root and for the components whose class is a
    transformers model (a text encoder, SD 1.5's safety checker), :data:`DIFFUSERS` for the
    other components."""
    if source_format == TRANSFORMERS:
        return {"": TRANSFORMERS}
    index = model_json(folder / "model_index.json")
    loaders = {}
    for name in named_components(index):
        library, class_name = index[name]
        found = component_config(str(library), str(class_name))
        loaders[name] = TRANSFORMERS if found is not None and found[1] == "model_type" else DIFFUSERS
    return loaders


def one_checkpoint_each(selection: Selection, loaders: dict[str, str]) -> None:
    """Leave out, in place, the weights a folder's loader skips when it holds both one weights
    file (``model.safetensors``, ``diffusion_pytorch_model.fp16.safetensors``) and shards of the
    same format with their index: diffusers reads the shard index first
    (``ModelMixin.from_pretrained``: an index that exists makes the load sharded), transformers
    the single file (``PreTrainedModel.from_pretrained`` looks for ``model.safetensors`` before
    ``model.safetensors.index.json``). Taking both would copy, sync and price the weights twice.

    ``loaders``: folder of weights (``""`` the root) -> :data:`DIFFUSERS` or :data:`TRANSFORMERS`
    (:func:`_loaders`); other folders are left as they are."""
    by_folder: dict[str, list[str]] = {}
    for path in selection.taken:
        by_folder.setdefault(posixpath.dirname(path), []).append(path)
    for where, paths in sorted(by_folder.items()):
        loader = loaders.get(where)
        if loader is None:
            continue
        for suffix in (".safetensors", ".bin"):
            single = sorted(p for p in paths if p.endswith(suffix) and not _SHARD.search(p))
            sharded = sorted(p for p in paths if (_SHARD.search(p) and p.endswith(suffix)) or f"{suffix}.index" in p)
            if not single or not sharded:
                continue
            index = next((p for p in sharded if _SHARD_INDEX.search(p)), sharded[0])
            if loader == TRANSFORMERS:
                dropped = sharded
                why = f"sharded twin of {single[0]}, which transformers loads first"
            else:
                dropped = single
                why = f"single-file twin of the shards diffusers loads through {index}"
            for path in dropped:
                selection.left_out[path] = (selection.taken.pop(path), why)


JUNK_WHY = "a hidden file or an editor's backup (no loader reads it)"
"""Why :func:`select_files` leaves out a file :func:`_is_junk` names."""

_BACKUP_SUFFIXES = (".bak", ".orig", ".swp", ".tmp", "~")


def _is_junk(path: str) -> bool:
    """Whether a file of a model folder is one no loader reads, whatever folder it sits in: a
    hidden file (``.DS_Store``, macOS's AppleDouble ``._vocab.json``, ``.gitattributes``) or an
    editor's or tool's backup (``scheduler_config.json.bak``, ``config.json~``)."""
    name = path.rsplit("/", 1)[-1]
    return name.startswith(".") or name.endswith(_BACKUP_SUFFIXES)


def check_shards(folder: Path, taken: Iterable[str]) -> None:
    """Check that every shard a taken shard index (:data:`_SHARD_INDEX`: ``*.safetensors.index.json``,
    ``*.bin.index.json``, ``*.index.fp16.json``: its ``weight_map``, tensor -> file beside it) names is taken too: a
    download that lost a shard loads nowhere ("does not appear to have a file named ... which is
    required according to the checkpoint index"); and that every taken shard (:data:`_SHARD`)
    is named by a taken index: without it the loader finds none of them.

    Raises:
        Rejected: reason ``incomplete_model``, naming the index and the missing shards, or the
            shards no index names; or
            ``not_a_model`` when the index is no JSON object or has no ``weight_map`` object.
    """
    paths = set(taken)
    indexed: set[str] = set()  # the shards the taken indexes name, relative to the model folder
    for index in sorted(p for p in paths if _SHARD_INDEX.search(p)):
        weight_map = model_json(folder / index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise Rejected(
                f"{folder / index} has no `weight_map` object (tensor name -> shard file), which every shard "
                "index holds: a damaged download, download the model again",
                reason="not_a_model",
            )
        base = posixpath.dirname(index)
        indexed |= {posixpath.join(base, str(f)) for f in weight_map.values()}
        missing = sorted({str(f) for f in weight_map.values()} - {posixpath.relpath(p, base or ".") for p in paths})
        if missing:
            raise Rejected(
                f"{folder}: {index} names {len(missing)} shard(s) the folder does not hold: "
                f"{', '.join(posixpath.join(base, m) for m in missing[:5])}"
                f"{' …' if len(missing) > 5 else ''} (an interrupted download? download the model again)",
                reason="incomplete_model",
            )
    orphans = sorted(p for p in paths if _SHARD.search(p) and p not in indexed)
    if orphans:  # the loader finds shards through their index only ("no file named ... found")
        unread = _unread_indexes(folder, orphans, paths)
        why = (
            f"the folder holds {', '.join(unread[:3])}, an index under a name the loader does not read for "
            "these shards (diffusers reads <weights>.safetensors.index.<variant>.json for a variant's shards, "
            "e.g. diffusion_pytorch_model.safetensors.index.fp16.json): rename it so"
            if unread
            else "the index is missing (an interrupted download? download the model again)"
        )
        raise Rejected(
            f"{folder}: {', '.join(orphans[:3])}{' …' if len(orphans) > 3 else ''} "
            + ("is a shard" if len(orphans) == 1 else f"are {len(orphans)} shards")
            + f" that no shard index (*.index.json) beside it names: {why}",
            reason="incomplete_model",
        )


def _unread_indexes(folder: Path, orphans: Sequence[str], taken: set[str]) -> list[str]:
    """The files beside ``orphans`` (shards no taken index names) that are not taken, are named
    like an index (``*.index*.json``) and whose ``weight_map`` names one of them: an index under
    a name the loader does not read for these shards (``diffusion_pytorch_model.fp16.safetensors
    .index.json`` where diffusers reads ``….safetensors.index.fp16.json``)."""
    found = []
    for base in sorted({posixpath.dirname(p) for p in orphans}):
        names = {posixpath.basename(p) for p in orphans if posixpath.dirname(p) == base}
        for file in sorted((folder / base).iterdir()):
            relative = posixpath.join(base, file.name)
            if relative in taken or not (file.name.endswith(".json") and ".index" in file.name):
                continue
            try:
                weight_map = json.loads(file.read_text(encoding="utf-8")).get("weight_map")
            except (OSError, ValueError, AttributeError):
                continue
            if isinstance(weight_map, dict) and names & {str(f) for f in weight_map.values()}:
                found.append(relative)
    return found


_SHARD_INDEX = re.compile(r"\.index(?:\.[a-z0-9]+)?\.json$")
"""A shard index's file name: ``model.safetensors.index.json``, and diffusers' variant form
``diffusion_pytorch_model.safetensors.index.fp16.json``."""
_SHARD = re.compile(r"-\d{5}-of-\d{5}(?:\.[a-z0-9]+)?\.(?:safetensors|bin)$")
"""A shard's file name as ``save_pretrained(max_shard_size=…)`` writes it (``model-00001-of-00003.safetensors``,
``diffusion_pytorch_model.fp16-00001-of-00002.safetensors``)."""


def _list_files(folder: Path) -> list[str]:
    """Every file under ``folder`` (links followed, broken links included), relative POSIX paths.
    A link to a folder that holds it (``unet/loop -> ..``) is not followed: it would list the
    model again and again (a loop of links ends only at the system's limit on path depth)."""
    found: list[str] = []
    for root, dirs, names in os.walk(folder, followlinks=True):
        here = os.path.realpath(root)
        dirs[:] = sorted(
            d
            for d in dirs
            if not os.path.islink(os.path.join(root, d))
            or not (here + os.sep).startswith(os.path.realpath(os.path.join(root, d)) + os.sep)
        )
        base = Path(root).relative_to(folder)
        for name in names:
            found.append((base / name).as_posix())
    return sorted(found)


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _finish(
    source_format: str, folder: Path, files: list[str], taken: set[str], why: object, variant: str | None = None
) -> Selection:
    return Selection(
        source_format=source_format,
        taken={p: _size(folder / p) for p in files if p in taken},
        left_out={p: (_size(folder / p), why(p)) for p in files if p not in taken},  # type: ignore[operator]
        variant=variant,
    )


def _weights_of(
    model_folders: list[str], candidates: list[str], variant: str | None
) -> tuple[list[str], list[str], set[str]]:
    """Diffusers' file rule over ``candidates`` (paths under the component folders) for the
    model components ``model_folders``: (the weight files a pipeline of ``variant`` loads, those
    of them that are the variant's, the candidates its ignore patterns leave out). ``.bin`` is
    taken where not every component has safetensors (allow_pickle: diffusers' rule; nothing is
    unpickled here, and workers load ``.bin`` weights-only); a variant no component has falls
    back to full precision."""
    from diffusers.pipelines.pipeline_loading_utils import _get_ignore_patterns, variant_compatible_siblings

    ignore = _get_ignore_patterns(
        passed_components=[],
        model_folder_names=model_folders,
        model_filenames=candidates,
        use_safetensors=True,
        allow_pickle=True,
        use_onnx=False,
        is_onnx=False,
        use_flashpack=False,
        variant=variant,
    )
    weight_candidates = [p for p in candidates if len(p.split("/")) == 2]
    loading_log = logging.getLogger(variant_compatible_siblings.__module__)
    level = loading_log.level
    loading_log.setLevel(logging.ERROR)  # its "mixture of fp16 and non-fp16" warning: the caller lists the files
    try:
        try:
            weights, variant_files = cast(
                "tuple[list[str], list[str]]",  # diffusers annotates it as a list
                variant_compatible_siblings(weight_candidates, variant=variant, ignore_patterns=ignore),
            )
        except ValueError:  # no component has the variant's files: every component loads full precision
            weights, variant_files = cast(
                "tuple[list[str], list[str]]",
                variant_compatible_siblings(weight_candidates, variant=None, ignore_patterns=ignore),
            )
    finally:
        loading_log.setLevel(level)
    ignore_all = [*ignore, *(f"{pattern}.index.*json" for pattern in ignore)]
    ignored = {p for p in candidates if any(fnmatch.fnmatch(p, pattern) for pattern in ignore_all)}
    return weights, variant_files, ignored


def _select_diffusers(folder: Path, files: list[str], variant: str | None) -> Selection:
    from diffusers.pipelines.pipeline_loading_utils import (
        filter_model_files,
    )

    index = model_json(folder / "model_index.json")
    components = named_components(index)
    nulls = {k for k, v in index.items() if isinstance(v, list) and k != "_class_name"} - components
    odd = sorted(c for c in components if not _COMPONENT.match(c))
    if odd:
        raise Rejected(
            f"{folder}: model_index.json names component(s) {', '.join(map(repr, odd))}, which are no "
            "folder names of this model",
            reason="not_a_model",
        )
    absent = sorted(c for c in components if not (folder / c).is_dir())
    if absent:
        raise Rejected(
            f"{folder}: component(s) {', '.join(absent)} named in model_index.json have no folder (an "
            "interrupted download? download the model again)",
            reason="incomplete_model",
        )
    check_component_configs(folder, index)
    ignored_by_index = set(index.get("_ignore_files") or ())
    candidates = [p for p in files if p.split("/")[0] in components and "/" in p and p not in ignored_by_index]
    model_folders = {os.path.split(p)[0] for p in filter_model_files(candidates) if os.path.split(p)[0] in components}
    # Each component on its own: a folder on disk loads each component's own files
    # (``DiffusionPipeline.from_pretrained`` of a local folder: ``use_safetensors`` None, so each
    # model takes its safetensors where present, else its .bin; its variant where it has one,
    # else full precision). diffusers' rule for a download (.bin for every component as soon as
    # one lacks safetensors) would take pickled weights a worker never needs.
    weights, variant_files, ignored = [], [], set()
    for component in sorted(model_folders):
        own = [p for p in candidates if p.split("/")[0] == component]
        found, found_variant, found_ignored = _weights_of([component], own, variant)
        weights += found
        variant_files += found_variant
        ignored |= found_ignored
    taken = {"model_index.json"}
    for path in candidates:
        component, _, name = path.partition("/")
        if path in ignored:
            continue
        if component in model_folders:
            if path in weights or ("/" not in name and (name == "config.json" or name in AUX_FILES)):
                taken.add(path)
        elif "/" not in name:  # a tokenizer, scheduler or processor reads its own folder's files, not deeper
            taken.add(path)
    weightless = sorted(c for c in components - model_folders if f"{c}/config.json" in candidates)
    if weightless:  # a model's config.json and no weights at all: the download stopped before them
        raise Rejected(
            f"{folder}: component(s) {', '.join(weightless)} hold a model's config.json but no weights "
            "(an interrupted download? download the model again)",
            reason="incomplete_model",
        )
    starved = sorted(c for c in model_folders if not any(p.startswith(c + "/") for p in weights))
    if starved:
        raise Rejected(
            f"{folder}: component(s) {', '.join(starved)} hold weights but none a "
            f"{'variant ' + variant if variant else 'full-precision'} pipeline loads; register it "
            "with the precision of its files (--precision fp16 for *.fp16.* files only)",
            reason="no_loadable_weights",
        )
    chosen = f"variant {variant}" if variant_files else "full precision"

    def why(path: str) -> str:
        top, _, _name = path.partition("/")
        base = path.rsplit("/", 1)[-1]
        if "/" not in path:
            if base.endswith(_CHECKPOINT_SUFFIXES):
                return "weights at the root (single-file checkpoint or LoRA; the pipeline loads its component folders)"
            if base.lower().endswith(_MEDIA_SUFFIXES):
                return "image or video, not loaded"
            return "not loaded (at the root the pipeline reads model_index.json only)"
        if top in nulls:
            return f"component {top!r} is null in model_index.json"
        if top not in components:
            return "folder not named in model_index.json"
        if path in ignored_by_index:
            return "listed in model_index.json _ignore_files"
        if path.count("/") > 1:
            return f"in a subfolder of {top}, which the pipeline does not read"
        if base.startswith("openvino_"):
            return "OpenVINO export, not loaded"
        if base.endswith(".msgpack"):
            return "flax weights, not loaded"
        if ".onnx" in base or base.endswith(".pb"):
            return "ONNX export, not loaded"
        found = _ANY_VARIANT.match(base)
        other = (found["variant"] or found["index_variant"]) if found else None
        if other and other not in PRECISION_FILE_VARIANTS.values() and other != variant:
            return f"{other} weights, not loaded by the pipeline"  # non_ema, ema: no .bin twin either
        if path in ignored and (base.endswith(".bin") or ".bin.index" in base):
            return ".bin twin of the safetensors weights taken"
        if path in ignored:
            return f"safetensors left out: {top} has none of this precision, its .bin weights are taken"
        if other:
            return f"{other} variant; this model takes {chosen} for {top}"
        if variant and (base.endswith((".safetensors", ".bin")) or ".index" in base):
            return f"full-precision weights; this model takes the {variant} variant for {top}"
        return "not loaded (a model folder's config.json and weights only)"

    return _finish(DIFFUSERS, folder, files, taken, why, variant if variant_files else None)


def check_index_entries(path: Path, index: dict[str, Any]) -> None:
    """Check the shape of a ``model_index.json`` (``index``, read from ``path``) as diffusers
    reads it: ``_class_name`` a string, and every component entry (a list) a pair ``[library,
    class]`` of strings, or ``[null, null]`` for a component left out; other keys are the
    pipeline's config values and are not checked.

    Raises:
        Rejected: reason ``not_a_model``, naming the file, the key and what it holds.
    """
    if "_class_name" not in index:
        raise Rejected(
            f'{path}: no `_class_name` (the pipeline class, e.g. "StableDiffusionPipeline"): not a '
            "diffusers model_index.json, or a damaged one; download the model again",
            reason="not_a_model",
        )
    class_name = index.get("_class_name")
    if not isinstance(class_name, str) or not class_name:
        raise Rejected(
            f"{path}: `_class_name` must name the pipeline class as a string, got {json.dumps(class_name)}: "
            "a damaged or edited file, download the model again",
            reason="not_a_model",
        )
    for key, value in index.items():
        if key.startswith("_") or not isinstance(value, list):
            continue
        pair = len(value) == 2 and all(part is None or isinstance(part, str) for part in value)
        if not pair or (value[0] is None) != (value[1] is None):
            raise Rejected(
                f'{path}: component `{key}` must be [library, class] (e.g. ["diffusers", "UNet2DConditionModel"]) '
                f"or [null, null], got {json.dumps(value)}: a damaged or edited file, download the model again",
                reason="not_a_model",
            )


def named_components(index: dict[str, Any]) -> set[str]:
    """The components a ``model_index.json`` (``index``) names a class for: its list entries but
    ``_class_name`` and those set to ``[null, null]``."""
    return {k for k, v in index.items() if isinstance(v, list) and k != "_class_name" and any(p is not None for p in v)}


def check_index_components(folder: Path, index: dict[str, Any]) -> None:
    """Check that ``folder``'s ``model_index.json`` (``index``) names a class for every component
    its pipeline class cannot load without, as ``DiffusionPipeline.from_pretrained`` requires: the
    arguments of the class's ``__init__`` without a default, but its ``_optional_components``.

    Raises:
        Rejected: a required component is missing or ``[null, null]``, or the index names no
            component at all (reason ``incomplete_model``, naming the missing ones).
    """
    import diffusers

    class_name = str(index.get("_class_name", ""))
    named = named_components(index)
    found = getattr(diffusers, class_name, None)
    required: set[str] = set()
    if isinstance(found, type) and issubclass(found, diffusers.DiffusionPipeline):
        pipeline: Any = found
        expected, _ = pipeline._get_signature_keys(pipeline)
        required = set(expected) - set(pipeline._optional_components)
    missing = sorted(required - named)
    if missing or not named:
        raise Rejected(
            f"{folder}: model_index.json names no {', '.join(missing) or 'component'} ({class_name} needs "
            f"{', '.join(sorted(required)) or 'its components'}; the index names "
            f"{', '.join(sorted(named)) or 'none'}): an incomplete or edited index, download the model again",
            reason="incomplete_model",
        )


def component_config(library: str, class_name: str) -> tuple[str, str] | None:
    """The config file a component of ``class_name`` from ``library`` (a ``model_index.json``
    entry, resolved as :func:`app.core.pricing.component_class` resolves it: a diffusers
    pipeline module such as ``stable_diffusion`` too) cannot load without, and the key every
    such file has (the library writes it): ``config.json`` with ``_class_name`` for a diffusers
    model, with ``model_type`` for a transformers one, ``scheduler_config.json`` with
    ``_class_name`` for a scheduler; None for anything else (tokenizers and processors, whose
    files vary) or a class that is not found (pricing names it)."""
    import diffusers
    import transformers

    from app.core.pricing import component_class

    try:
        found = component_class(library, class_name)
    except ValueError:
        return None
    if not isinstance(found, type):
        return None
    if issubclass(found, diffusers.ModelMixin):
        return "config.json", "_class_name"
    if issubclass(found, diffusers.SchedulerMixin):
        return "scheduler_config.json", "_class_name"
    if issubclass(found, transformers.PreTrainedModel):
        return "config.json", "model_type"
    return None


def check_component_configs(folder: Path, index: dict[str, Any]) -> None:
    """Check that each component ``folder``'s ``model_index.json`` (``index``) names holds the
    config file its class loads from (:func:`component_config`).

    Raises:
        Rejected: reason ``incomplete_model``, naming each component and the file it lacks, or
            the config that is a broken link (a cache snapshot's link whose blob is gone).
    """
    lacking = []
    for name in sorted(named_components(index)):
        library, class_name = index[name]
        found = component_config(str(library), str(class_name))
        if found is None or (path := folder / name / found[0]).is_file():
            continue
        if path.is_symlink():
            raise Rejected(
                f"{folder}: {name}/{found[0]} is a broken link (its target {os.readlink(path)} is missing: an "
                "interrupted download?); download the model again",
                reason="incomplete_model",
            )
        lacking.append(f"{name}/{found[0]} ({class_name})")
    if lacking:
        raise Rejected(
            f"{folder}: no {', '.join(lacking)}: a component's config is missing (an interrupted download? "
            "download the model again)",
            reason="incomplete_model",
        )


def check_config_keys(folder: Path, index: dict[str, Any]) -> None:
    """Check that each component config of ``folder`` (:func:`component_config`, where present)
    holds the key its library writes into every one: without it the loader builds the class's
    default shapes (an emptied ``unet/config.json`` priced the tiny sd1 model at 3.3 GiB, and
    every job failed at load).

    Raises:
        Rejected: reason ``not_a_model``, naming the config and the key it lacks (or what
            :func:`model_json` refuses in it).
    """
    for name in sorted(named_components(index)):
        library, class_name = index[name]
        found = component_config(str(library), str(class_name))
        if found is None or not (path := folder / name / found[0]).is_file():
            continue
        if found[1] not in model_json(path):
            raise Rejected(
                f"{path} has no `{found[1]}`, which every {library} config of {class_name} holds: an emptied "
                "or hand-made config (the loader would build the class's default shapes), download the model again",
                reason="not_a_model",
            )


_JSON_TYPES = {list: "an array", str: "a string", int: "a number", float: "a number", bool: "a boolean"}


def encoding_hint(raw: bytes) -> str:
    """What a JSON file that is not UTF-8 was probably saved as, from its first bytes: a byte
    order mark names UTF-16 or UTF-32 (UTF-32's first, as its little-endian mark begins with
    UTF-16's), NULs between ASCII letters name them without one; anything else is a single-byte
    code page (Latin-1, Windows-1252: an editor's "ANSI")."""
    head = raw[:64]
    if head.startswith((codecs.BOM_UTF32_LE, codecs.BOM_UTF32_BE)):
        return "saved as UTF-32"
    if head.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
        return 'saved as UTF-16, "Unicode"?'
    if b"\x00\x00" in head:
        return "saved as UTF-32?"
    if b"\x00" in head:
        return 'saved as UTF-16, "Unicode"?'
    return 'saved as Latin-1 or Windows-1252, "ANSI"?'


def model_json(path: Path) -> dict[str, Any]:
    """The JSON object in ``path``, a JSON file of a model being registered (``model_index.json``,
    a component's or a text model's ``config.json``, a tokenizer or scheduler file).

    Raises:
        Rejected: the file cannot be read, starts with a UTF-8 byte order mark, is not valid JSON,
            or holds another JSON value than an object (reason ``not_a_model``), naming the file
            and what is wrong.
    """
    try:
        raw = Path(path).read_bytes()
        if raw.startswith(codecs.BOM_UTF8):  # Python's json takes it; diffusers and transformers do not
            raise Rejected(
                f"{path} starts with a UTF-8 byte order mark (BOM), which diffusers and transformers cannot "
                "read: save it as UTF-8 without a BOM (an editor added it?), or download the model again",
                reason="not_a_model",
            )
        try:
            text = raw.decode("utf-8")  # json.loads(bytes) would take UTF-16 and UTF-32 too; the loaders do not
            if "\x00" in text:  # ASCII saved as UTF-16 or UTF-32 without a BOM decodes, NULs between the letters
                where = raw.index(b"\x00")
                raise UnicodeDecodeError("utf-8", raw, where, where + 1, "a NUL byte, which JSON text never holds")
        except UnicodeDecodeError as error:
            raise Rejected(
                f"{path} is not UTF-8 text ({error.reason} at byte {error.start}; {encoding_hint(raw)}), "
                "which diffusers and transformers cannot read: save it as UTF-8, or download the model again",
                reason="not_a_model",
            ) from error
        loaded = json.loads(text)
    except OSError as error:
        raise Rejected(f"{path} cannot be read ({error.strerror or error})", reason="not_a_model") from error
    except ValueError as error:  # json.JSONDecodeError, UnicodeDecodeError
        raise Rejected(
            f"{path} is not valid JSON ({error}): a damaged or edited file, download the model again",
            reason="not_a_model",
        ) from error
    if not isinstance(loaded, dict):
        found = "null" if loaded is None else _JSON_TYPES.get(type(loaded), type(loaded).__name__)
        raise Rejected(
            f"{path} holds {found}, not a JSON object: a damaged or edited file, download the model again",
            reason="not_a_model",
        )
    return loaded


def _select_transformers(folder: Path, files: list[str]) -> Selection:
    root = [p for p in files if "/" not in p]
    safetensors = {p for p in root if _TEXT_SAFETENSORS.match(p)}
    weights = safetensors or {p for p in root if _TEXT_BIN.match(p)}
    if not any(p.endswith((".safetensors", ".bin")) for p in weights):
        raise Rejected(
            f"{folder}: a transformers model's config.json but no model*.safetensors or pytorch_model*.bin "
            "weights (an interrupted download? download the model again)",
            reason="incomplete_model",
        )
    taken = weights | {p for p in root if p in TOKENIZER_FILES or p in AUX_FILES or p == "config.json"}

    def why(path: str) -> str:
        if "/" in path:
            return "in a subfolder (transformers loads the folder's root files)"
        if _TEXT_BIN.match(path):
            return ".bin twin of the safetensors weights taken"
        if path.endswith(_CHECKPOINT_SUFFIXES):
            return "weights transformers does not load (not model*.safetensors)"
        if path.lower().endswith(_MEDIA_SUFFIXES):
            return "image or video, not loaded"
        return "not loaded by transformers (config, tokenizer and weights only)"

    return _finish(TRANSFORMERS, folder, files, taken, why)


def hub_cache_dir() -> Path:
    """The Hugging Face hub cache folder as huggingface_hub resolves it, read now (not at import):
    ``HF_HUB_CACHE``, else ``HUGGINGFACE_HUB_CACHE``, else ``HF_HOME/hub``, else
    ``XDG_CACHE_HOME/huggingface/hub``, else ``~/.cache/huggingface/hub``."""
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(name):
            return Path(os.environ[name]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "huggingface"
    )
    return Path(home).expanduser() / "hub"


def snapshot_repo(folder: Path) -> str | None:
    """The repository id (``org/name``) whose Hugging Face cache snapshot ``folder`` is
    (``…/models--org--name/snapshots/<commit>``, the path people paste), else None."""
    repo = folder.parent.parent.name
    if folder.parent.name != "snapshots" or not repo.startswith("models--"):
        return None
    return repo.removeprefix("models--").replace("--", "/")


SHORT_COMMIT_MIN = 7
"""The fewest hex digits of a commit that ``--revision`` takes for a cached snapshot (git's own
shortest default abbreviation); ``models list`` shows 12."""
_SHORT_COMMIT = re.compile(rf"[0-9a-f]{{{SHORT_COMMIT_MIN},39}}")


def _full_commit(repo: Path, repo_id: str, revision: str | None) -> str | None:
    """``revision`` as :func:`cached_snapshot` passes it on: a shortened commit (hex digits, no
    ref of that name under ``repo/refs``) that exactly one snapshot folder of the cached
    repository ``repo`` starts with becomes that snapshot's full commit; anything else is
    returned as it is (huggingface_hub resolves refs and full commits).

    Raises:
        Rejected: several snapshots start with it (reason ``not_in_hf_cache``, naming them).
    """
    if revision is None or not _SHORT_COMMIT.fullmatch(revision) or (repo / "refs" / revision).is_file():
        return revision
    snapshots = repo / "snapshots"
    found = sorted(p.name for p in snapshots.iterdir() if p.name.startswith(revision)) if snapshots.is_dir() else []
    if len(found) > 1:
        raise Rejected(
            f"{repo_id} in the Hugging Face cache {repo.parent}: revision {revision} is the start of "
            f"{len(found)} snapshots' commits ({', '.join(found)}); pass more of its digits with --revision",
            reason="not_in_hf_cache",
        )
    return found[0] if found else revision


def cached_snapshot(repo_id: str, revision: str | None = None, cache_dir: Path | None = None) -> Path:
    """The snapshot folder of ``repo_id`` at ``revision`` (a branch, tag or commit; default
    ``main``) in the local Hugging Face cache (:func:`hub_cache_dir` unless ``cache_dir``), found by
    ``huggingface_hub.snapshot_download(..., local_files_only=True)``: no network. A commit may
    be shortened to its first :data:`SHORT_COMMIT_MIN` or more hex digits, as ``models list``
    shows it (12), when no ref has that name and one cached snapshot's commit starts with them.

    Raises:
        Rejected: the repository or revision is not in the cache, or a shortened commit that
            several cached snapshots start with (reason ``not_in_hf_cache``, naming the cache
            folder and the repositories it holds, or the repository's refs and snapshots).
    """
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    cache = Path(cache_dir) if cache_dir is not None else hub_cache_dir()
    revision = _full_commit(cache / ("models--" + repo_id.replace("/", "--")), repo_id, revision)
    try:
        return Path(snapshot_download(repo_id, revision=revision, cache_dir=str(cache), local_files_only=True))
    except (LocalEntryNotFoundError, FileNotFoundError, ValueError) as error:
        repo = cache / ("models--" + repo_id.replace("/", "--"))
        refs = sorted(p.name for p in (repo / "refs").iterdir()) if (repo / "refs").is_dir() else []
        wanted = revision or "main"
        ref = repo / "refs" / wanted
        snapshots = sorted(p.name for p in (repo / "snapshots").iterdir()) if (repo / "snapshots").is_dir() else []
        commit = ref.read_text().strip() if ref.is_file() else ""
        if commit and commit not in snapshots:  # the ref is there, the snapshot it names is not
            raise Rejected(
                f"{repo_id} in the Hugging Face cache {cache}: its ref {wanted} names snapshot {commit}, which "
                f"is not in {repo / 'snapshots'} (a download interrupted or cleaned up); its snapshots: "
                f"{', '.join(snapshots) or 'none'} (pass one with --revision, or download {repo_id} again)",
                reason="not_in_hf_cache",
            ) from error
        if repo.is_dir():  # the repository is there, not this revision
            raise Rejected(
                f"{repo_id} is in the Hugging Face cache {cache} but not at revision {revision or 'main'} "
                f"({type(error).__name__}); its cached refs: {', '.join(refs) or 'none'}; its snapshots: "
                f"{', '.join(snapshots) or 'none'} (pass a ref or a snapshot's commit, or its first "
                f"{SHORT_COMMIT_MIN}+ hex digits, with --revision)",
                reason="not_in_hf_cache",
            ) from error
        held = (
            sorted(p.name.removeprefix("models--").replace("--", "/") for p in cache.glob("models--*"))
            if cache.is_dir()
            else []
        )
        raise Rejected(
            f"{repo_id} is not in the Hugging Face cache {cache} ({type(error).__name__}); it holds: "
            f"{', '.join(held) or 'no models'} (HF_HUB_CACHE or HF_HOME name another cache)",
            reason="not_in_hf_cache",
        ) from error
