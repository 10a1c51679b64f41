"""The model registry on the server (R1): model ids, their family and kinds, and the
manifest (every file with its size and full-content digest).

LoRA adapters are registry entries too, of kind ``adapter`` (``ADAPTER_KIND``) with
their base model's family: a folder of LoRA weights (``*.safetensors``, as diffusers'
``save_lora_weights`` writes them) or one downloaded LoRA file in the kohya or diffusers/PEFT
layout (stored as ``pytorch_lora_weights.safetensors``), its layout and base recognised from its
tensor names (app/core/lora_files.py), hashed, listed in the manifest, synced to workers and
verified there exactly like a model's files (R4-R6). An adapter runs no job of its own.

Registering copies the diffusers folder (or the LoRA file) into the server's own model folder
(``<data_dir>/models/<model_id>/``), the same layout every worker uses.
"""

from __future__ import annotations

import builtins
import fcntl
import json
import logging
import os
import re
import shutil
import tempfile
import time
import unicodedata
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import redis
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from app.core.digest import ALGORITHM, file_digest
from app.core.errors import Conflict, IntegrityFailure, NotFound, Rejected
from app.core.families import FAMILIES, PIPELINE_FAMILIES
from app.core.kinds import DefaultRefused, adapter_ids, check_defaults
from app.core.lora_files import LORA_WEIGHTS, LoraLayout, recognise, weight_file
from app.core.pricing import MissingTensors, loaded_bytes
from app.core.protocol import Manifest, ManifestFile
from app.core.safetensors import check_loadable, safetensors_header
from app.core.states import ACTIVE
from app.core.textgen import architectures, chat_prompt, kv_cache_bytes, load_tokenizer, model_config
from app.core.torch_archive import check_archive
from app.core.variants import Variant, check_family_variant, check_variant
from app.db.tables import Job, ModelFile, ModelRecord, utcnow
from app.store.hf_cache import BlobMismatch, check_blob
from app.store.selection import (
    TOKENIZER_FILES,
    check_config_keys,
    check_exists,
    check_index_components,
    check_index_entries,
    hub_cache_dir,
    model_json,
    select_files,
)
from routing.timings import ADAPTER_KIND

ADAPTER_CLASS = "LoRA"
"""The ``pipeline_class`` of a registered adapter."""

_MODEL_ID = re.compile(r"^[a-z0-9][a-z0-9._-]{0,62}$")


log = logging.getLogger(__name__)

MARK_EVERY_S = 1.0
"""How often a process looks whether the registry changed elsewhere (``Registry.get``), in
seconds: a record another process updated is seen at most this late."""


def checkpoint_hint(folder: Path, family: str | None = None) -> str:
    """A sentence for a folder that is no model folder but holds ``.safetensors`` files at its
    root (a single-file checkpoint as Civitai and the A1111 folders keep them, or a LoRA): how
    to register one of them, naming it; "" when it holds none. ``family``: the one asked for."""
    try:
        found = sorted(p.name for p in folder.glob("*.safetensors") if p.is_file())
    except OSError:
        return ""
    if not found:
        return ""
    named = ", ".join(found[:3]) + (f" and {len(found) - 3} more" if len(found) > 3 else "")
    return (
        f". It holds {named}: a single-file checkpoint is registered by naming the file "
        f"(`homefleet models add {folder / found[0]} --family {family or 'sd1|sdxl|flux'}`), a LoRA "
        "file with --adapter-of FAMILY"
    )


def cache_repo_hint(folder: Path) -> str:
    """A sentence for a Hugging Face cache folder named instead of a snapshot: a repository's
    (``…/models--org--name``, which holds ``snapshots/``), its ``snapshots/`` folder, or the
    cache's root (which holds ``models--*`` folders): the command that registers one, with the
    ``HF_HUB_CACHE`` it needs when the folder is in another cache than the configured one
    (:func:`app.store.selection.hub_cache_dir`), and for a repository the path of the snapshot its
    ``refs/main`` names, which registers as it is; "" for any other folder."""
    if folder.name == "snapshots" and folder.parent.name.startswith("models--"):
        folder = folder.parent  # the folder of the repository's snapshots: the same advice
    if folder.name.startswith("models--") and (folder / "snapshots").is_dir():
        repo = folder.name.removeprefix("models--").replace("--", "/")
        try:
            main = (folder / "refs" / "main").read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError):
            main = ""
        snapshot = folder / "snapshots" / main if main and (folder / "snapshots" / main).is_dir() else None
        elsewhere = "" if folder.parent.resolve() == hub_cache_dir().resolve() else f" (HF_HUB_CACHE={folder.parent})"
        return (
            f". It is the Hugging Face cache folder of {repo}: register its snapshot with "
            f"`homefleet models add --from-hf-cache {repo}`{elsewhere} (or name "
            + (f"the snapshot refs/main names, {snapshot})" if snapshot else f"{folder / 'snapshots'}/<commit>)")
        )
    held = sorted(
        p.name.removeprefix("models--").replace("--", "/")
        for p in folder.glob("models--*")
        if (p / "snapshots").is_dir()
    )
    if held:  # a cache's root
        named = ", ".join(held[:3]) + (f" and {len(held) - 3} more" if len(held) > 3 else "")
        return (
            f". It is a Hugging Face cache ({named}): register a repository's snapshot with "
            f"`homefleet models add --from-hf-cache {held[0]}` (HF_HUB_CACHE={folder})"
        )
    return ""


def component_hint(folder: Path) -> str:
    """A sentence for a diffusers component folder named instead of its pipeline's (``…/unet``:
    a ``config.json`` with a ``_class_name``, its parent holding ``model_index.json``): the folder
    to register; "" for any other folder."""
    parent = folder.parent
    config = folder / "config.json"
    if not (parent / "model_index.json").is_file() or not config.is_file():
        return ""
    try:
        class_name = json.loads(config.read_text(encoding="utf-8")).get("_class_name")
    except (OSError, ValueError, AttributeError):
        return ""
    if not class_name:
        return ""
    return (
        f". It is the {folder.name} component ({class_name}) of the pipeline in {parent}: register that folder, "
        f"the one holding model_index.json (`homefleet models add {parent}`)"
    )


def describe_pipeline(folder: Path) -> tuple[str, str, tuple[str, ...]]:
    """(pipeline class, family, kinds) from ``folder/model_index.json`` (a diffusers folder), or
    from ``folder/config.json``'s ``architectures`` (a transformers causal-LM folder).

    Raises:
        Rejected: neither file, either file not a JSON object (reason ``not_a_model``), an unknown
            pipeline or model class (reason ``unknown_pipeline``), or an index that does not name
            the components of its pipeline class (reason ``incomplete_model``).
    """
    index = folder / "model_index.json"
    if not index.exists():  # a folder there is read, and refused, as one (model_json)
        if (folder / "config.json").is_file():
            model_json(folder / "config.json")  # architectures() reads an unreadable one as none
        if found := architectures(folder):
            class_name = found[0]
            if class_name not in PIPELINE_FAMILIES:
                known = ", ".join(sorted(PIPELINE_FAMILIES))
                raise Rejected(
                    f"model class {class_name!r} (config.json architectures) is not supported; supported: {known}",
                    reason="unknown_pipeline",
                )
            family, kinds = PIPELINE_FAMILIES[class_name]
            return class_name, family, kinds
        raise Rejected(
            f"{folder} is not a diffusers folder (no model_index.json) nor a transformers model folder "
            "(no config.json with architectures)"
            + (component_hint(folder) or cache_repo_hint(folder) + checkpoint_hint(folder)),
            reason="not_a_model",
        )
    content = model_json(index)
    check_index_entries(index, content)
    class_name = content["_class_name"]
    if class_name not in PIPELINE_FAMILIES:
        known = ", ".join(sorted(PIPELINE_FAMILIES))
        raise Rejected(f"pipeline class {class_name!r} is not supported; supported: {known}", reason="unknown_pipeline")
    check_index_components(folder, content)
    check_config_keys(folder, content)
    family, kinds = PIPELINE_FAMILIES[class_name]
    return class_name, family, kinds


def describe_adapter(folder: Path, family: str) -> tuple[str, str, tuple[str, ...]]:
    """(pipeline class, family, kinds) of a LoRA adapter for base ``family`` (``folder``: a folder
    of LoRA weights or one ``.safetensors`` LoRA file): ``("LoRA", family, ("adapter",))``.

    Raises:
        Rejected: ``family`` is unknown (reason ``unknown_family``), or ``folder`` is a model
            (``model_index.json``), a folder without ``*.safetensors`` file or a file that is not
            ``.safetensors`` (reason ``not_an_adapter``).
    """
    if family not in FAMILIES:
        raise Rejected(
            f"adapter family {family!r} is unknown; known: {', '.join(sorted(FAMILIES))}", reason="unknown_family"
        )
    if folder.is_file():
        if folder.suffix != ".safetensors":
            raise Rejected(
                f"{folder} is not a .safetensors file; a LoRA adapter is one .safetensors file (kohya or "
                "diffusers/PEFT layout) or a folder of them",
                reason="not_an_adapter",
            )
        return ADAPTER_CLASS, family, (ADAPTER_KIND,)
    if (folder / "model_index.json").is_file():
        raise Rejected(
            f"{folder} is a diffusers pipeline (model_index.json), not a LoRA adapter; register it "
            "without --adapter-of",
            reason="not_an_adapter",
        )
    if not any(folder.glob("*.safetensors")):
        raise Rejected(
            f"{folder} holds no *.safetensors LoRA weights (diffusers' save_lora_weights writes "
            "pytorch_lora_weights.safetensors)",
            reason="not_an_adapter",
        )
    return ADAPTER_CLASS, family, (ADAPTER_KIND,)


def adapter_layout(source: Path, family: str) -> LoraLayout:
    """The layout (kohya or diffusers/PEFT) and base of the LoRA weights a worker loads from
    ``source`` (a ``.safetensors`` file, or the :func:`~app.core.lora_files.weight_file` of a
    folder), read from its safetensors header only, checked against ``family``.

    Raises:
        Rejected: not a safetensors file or no LoRA weights (reason ``not_an_adapter``), or a
            LoRA of another base than ``family`` (reason ``adapter_family_mismatch``); each names
            the file and the keys seen.
    """
    path = source
    if source.is_dir():
        path = source / (
            weight_file(p.relative_to(source).as_posix() for p in source.glob("*.safetensors")) or LORA_WEIGHTS
        )
    try:
        header = safetensors_header(path)
    except IntegrityFailure as error:
        raise Rejected(f"{path} is no LoRA adapter: {error}", reason="not_an_adapter") from error
    layout = recognise(header, str(path), {k: v.get("shape") or () for k, v in header.items()})
    layout.check_family(family, str(path))
    return layout


class Registry:
    """Registered models and their manifests, stored in the journal's database.

    A model's id, family, kinds and variant never change once registered (:meth:`add` refuses
    a taken id; nothing deletes one, a retired one included), so :meth:`get` keeps the records
    it found; its files, ``total_bytes`` and ``weights_bytes`` change only by :meth:`update`, and
    its ``retired_at`` only by :meth:`retire` (read them from :meth:`list`, :meth:`check_in_service`
    or the manifest, which read the database). ``on_change`` is called after every committed
    registration, update or retirement (the server replaces the registry's change mark there,
    app/fleet/costs.py, so every process re-reads its model list and workers re-verify).
    """

    def __init__(
        self,
        engine: Engine,
        models_dir: Path,
        on_change: Callable[[], None] | None = None,
        check_defaults_limits: Callable[[str, Mapping[str, Any]], None] | None = None,
        change_mark: Callable[[], object] | None = None,
    ) -> None:
        self.engine = engine
        self.models_dir = models_dir
        self.on_change = on_change
        # reads the registry's change mark (another process's `models update`): the records kept
        # here are dropped when it moved, looked at most every MARK_EVERY_S seconds
        self.change_mark = change_mark
        self._mark: object = None
        self._mark_read_at = float("-inf")
        # a submission's own checks of the defaults (R22: limits, types), from the layer above;
        # raises Rejected naming the param (app/jobs/validation.py check_model_defaults)
        self.check_defaults_limits = check_defaults_limits
        self._records: dict[str, ModelRecord] = {}  # found by get(); update() drops its own
        self._priced: dict[str, int] = {}  # weights_bytes of records registered before it was stored
        # (model id, path) -> ((size, mtime_ns, inode), digest) of a file found changed: not hashed again while as is
        self._seen: dict[tuple[str, str], tuple[tuple[int, int, int], str]] = {}

    def folder(self, model_id: str) -> Path:
        return self.models_dir / model_id

    @contextmanager
    def _one_registration(self) -> Iterator[None]:
        """An exclusive ``flock`` on ``<models_dir>/.registry.lock`` for one registration's id
        check, copy and commit: two ``models add`` of the same id at once leave one registered
        and refuse the other (``model_id_taken``), and neither removes the other's folder. The
        kernel releases it when its process dies; it is released explicitly otherwise (a child
        forked meanwhile would keep a lock released by closing the file)."""
        self.models_dir.mkdir(parents=True, exist_ok=True)
        with open(self.models_dir / ".registry.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def add(
        self,
        source: Path,
        model_id: str | None = None,
        precision: str = "fp32",
        quantization: str | None = None,
        adapter_of: str | None = None,
        *,
        source_format: str | None = None,
        source_digest: str | None = None,
        source_repo: str | None = None,
        source_revision: str | None = None,
        mint_from: str | None = None,
        defaults: dict[str, Any] | None = None,
    ) -> ModelRecord:
        """Register the diffusers folder ``source``: mint an id (or take ``model_id``), copy the
        files its pipeline loads at ``precision`` into the server's model folder and hash them
        (:func:`app.store.selection.select_files`: the rest of the folder, e.g. ``.bin`` twins,
        other variants, ONNX/flax exports, root single-file checkpoints, docs and images, is
        neither copied nor listed in the manifest; links are followed, the copy holds real
        bytes). ``total_bytes`` sums the files taken. ``precision`` and
        ``quantization`` name the variant workers load (:mod:`app.core.variants`); register the
        same folder under two ids to offer two variants. ``adapter_of``: ``source`` is a LoRA
        adapter of that base family instead (:func:`describe_adapter`; kind
        ``adapter``, fp32, no quantization): a folder, or one LoRA ``.safetensors`` file stored as
        :data:`~app.core.lora_files.LORA_WEIGHTS`; its layout (kohya or diffusers/PEFT,
        :func:`adapter_layout`) is the record's ``source_format``, and a file's digest its
        ``source_digest``. ``source_format``/``source_digest``: what the caller registers
        from, recorded as given (an adapter's recognised layout takes the place of a missing one);
        ``source_repo``/``source_revision``: a Hugging Face cache snapshot's repository
        (``org/name``) and commit, recorded as given.
        ``source_format`` is recorded as given (e.g. ``hf-cache``, ``single-file``), else as found
        (``diffusers``, ``transformers``, a LoRA's layout); ``mint_from`` names the id minted when
        ``model_id`` is None (default: the folder's or file's name). ``defaults``: the model's own
        default job params (``{param: value}``), checked against the param spec of the kinds it
        runs (an adapter: its family's kinds that take adapters; :func:`app.core.kinds.check_defaults`)
        and applied to a job that does not set them.

        Raises:
            Rejected: ``source`` does not exist (reason ``path_not_found``), not a model folder or a
                JSON file of it not a JSON object (reason ``not_a_model``, naming the file), an
                index that does not name its pipeline's components (reason ``incomplete_model``),
                unsupported pipeline, invalid or taken id,
                unknown precision or quantization (reason ``invalid_variant``), a default that is
                not a param of its kinds or out of range (reason ``invalid_default``, param
                ``defaults.<name>``); with
                ``adapter_of``: an unknown family, a folder or file without LoRA weights (reason
                ``not_an_adapter``), or a LoRA for another base (reason ``adapter_family_mismatch``).
                A taken file that is a broken link, a component without loadable weights
                (:func:`app.store.selection.select_files`).
            Conflict: no ``model_id`` given and a registered model of the same family already has
                the same files taken (paths and digests) and variant (reason
                ``model_already_registered``, naming it):
                a second copy under a minted id is only made when asked for by id.
        """
        check_exists(Path(source))
        source = Path(source).resolve()
        try:
            check_variant(precision, quantization)
        except ValueError as error:
            raise Rejected(str(error), reason="invalid_variant") from error
        if adapter_of is not None:
            if quantization is not None:
                raise Rejected(
                    "an adapter is loaded as it is saved; it takes no quantization", reason="invalid_variant"
                )
            class_name, family, kinds = describe_adapter(source, adapter_of)
            layout = adapter_layout(source, family)  # recognised even when the caller names a format
            source_format = source_format or layout.source_format
        else:
            class_name, family, kinds = describe_pipeline(source)
        try:
            check_family_variant(family, quantization)
        except ValueError as error:
            raise Rejected(str(error), reason="invalid_variant") from error
        try:
            defaults = check_defaults(family, kinds, defaults) if defaults else None
        except DefaultRefused as error:
            raise Rejected(str(error), reason="invalid_default", param=f"defaults.{error.name}") from error
        if defaults and self.check_defaults_limits is not None:
            self.check_defaults_limits(family, defaults)
        if source.is_file():  # one LoRA file, stored under the name the worker loads (tasks/adapters.py)
            sources = {LORA_WEIGHTS: source}
        else:
            selection = select_files(source, precision, adapter=adapter_of is not None)
            sources = {path: source / path for path in selection.taken}
            source_format = source_format or selection.source_format
        try:  # before anything is copied: what no loader can read is refused
            check_taken_files(sources)
        except IntegrityFailure as error:
            why = (
                ""
                if isinstance(error, BlobMismatch)
                else ": a truncated or damaged file (an interrupted download? download it again)"
            )
            raise Rejected(f"{source}: {error}{why}", reason="incomplete_model") from error
        with self._one_registration():  # ids are checked and taken one registration at a time
            with Session(self.engine) as session:
                taken = set(session.exec(select(ModelRecord.id)).all())
            minted = model_id is None
            if model_id is None:
                model_id = _mint_id(mint_from or (source.stem if source.is_file() else source.name), taken)
            else:
                self._check_new_id(model_id, taken)

            if minted and (same := self._registered_as(sources, family, precision, quantization)) is not None:
                raise Conflict(
                    f"{source} is already registered as {same!r} (the same files and variant "
                    f"{precision}{'+' + quantization if quantization else ''}); use that id, or pass an id "
                    "(--id) to register a second copy",
                    reason="model_already_registered",
                )
            staging = Path(tempfile.mkdtemp(prefix=f".{model_id}.", dir=self.models_dir))
            try:
                for path, origin in sources.items():
                    target = staging / path
                    target.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(origin, target)  # follows links: a cache snapshot's blobs are copied
                os.chmod(staging, 0o755)  # mkdtemp makes it 0700
                final = self.folder(model_id)
                if final.exists():
                    shutil.rmtree(final)  # left by an earlier registration that was never committed
                os.replace(staging, final)
            except BaseException:
                shutil.rmtree(staging, ignore_errors=True)
                raise
            try:
                files = [_hash_file(model_id, final, final / path) for path in sorted(sources)]
                if adapter_of is not None and source.is_file() and source_digest is None:
                    source_digest = files[0].digest  # the copy's bytes are the file's: hashed once
                weights = _price(final, Variant(precision, quantization))
                if "text" in kinds:
                    _check_tokenizer(final)
                record = ModelRecord(
                    id=model_id,
                    family=family,
                    kinds=list(kinds),
                    pipeline_class=class_name,
                    total_bytes=sum(f.size for f in files),
                    precision=precision,
                    quantization=quantization,
                    weights_bytes=weights,
                    source_format=source_format,
                    source_digest=source_digest,
                    source_repo=source_repo,
                    source_revision=source_revision,
                    defaults=defaults,
                )
                with Session(self.engine) as session:
                    session.add(record)
                    session.add_all(files)
                    session.commit()
                    session.refresh(record)
            except BaseException:
                shutil.rmtree(final, ignore_errors=True)  # nothing registered: nothing left in the models folder
                raise
        if self.on_change is not None:
            self.on_change()
        return record

    def add_single_file(
        self,
        source: Path,
        family: str,
        model_id: str | None = None,
        precision: str = "fp32",
        quantization: str | None = None,
        config: Path | None = None,
        defaults: dict[str, Any] | None = None,
    ) -> ModelRecord:
        """Register the single-file checkpoint ``source`` (one ``.safetensors`` in the original
        key layout of ``family``: sd1, sdxl or flux; ``app/store/single_file.py``): convert it ONCE,
        here, into a diffusers folder with diffusers' own single-file loader, offline, using the
        shipped family config or ``config`` (a diffusers folder of the family), then register that
        folder like any other (:meth:`add`) with ``source_format="single-file"`` and
        ``source_digest`` = the file's digest. The id is minted from the file name if not given.

        Raises:
            Rejected: the file is not a safetensors checkpoint of ``family`` (reasons
                ``not_a_checkpoint``, ``wrong_family``, ``incomplete_checkpoint``), the config is
                missing or unfit (``needs_config``, ``invalid_config``), the conversion failed
                (``conversion_failed``), or what :meth:`add` refuses.
            Conflict: no ``model_id`` given and the same file (digest) is already registered with
                this variant (reason ``model_already_registered``, naming it).
        """
        from app.store import single_file

        try:  # a cached download's blob against its name, before anything reads it (R4)
            check_blob(Path(source).name, Path(source))
        except IntegrityFailure as error:
            raise Rejected(str(error), reason="incomplete_checkpoint") from error
        source = Path(source).resolve()
        try:
            check_variant(precision, quantization)
            check_family_variant(family, quantization)
        except ValueError as error:
            raise Rejected(str(error), reason="invalid_variant") from error
        single_file.check_checkpoint(source, family)
        digest = file_digest(source)
        with Session(self.engine) as session:
            same = session.exec(
                select(ModelRecord.id).where(
                    ModelRecord.source_digest == digest,
                    ModelRecord.precision == precision,
                    ModelRecord.quantization == quantization,
                    col(ModelRecord.retired_at).is_(None),
                )
            ).first()
            taken = set(session.exec(select(ModelRecord.id)).all())
        if model_id is None:
            if same is not None:
                raise Conflict(
                    f"{source} is already registered as {same!r} (the same file and variant "
                    f"{precision}{'+' + quantization if quantization else ''}); use that id, or pass an id "
                    "(--id) to register a second copy",
                    reason="model_already_registered",
                )
            model_id = _mint_id(source.stem, taken)
        elif model_id in taken or not _MODEL_ID.match(model_id):
            self._check_new_id(model_id, taken)
        self.models_dir.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{model_id}.single-file.", dir=self.models_dir))
        try:
            folder = single_file.convert(source, family, staging / "pipeline", config=config)
            return self.add(
                folder,
                model_id,
                precision=precision,
                quantization=quantization,
                source_format="single-file",
                source_digest=digest,
                defaults=defaults,
            )
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    @staticmethod
    def _check_new_id(model_id: str, taken: set[str]) -> None:
        """Raise Rejected for an id that is malformed (``invalid_model_id``) or registered (``model_id_taken``)."""
        if not _MODEL_ID.match(model_id):
            raise Rejected(
                f"model id must match {_MODEL_ID.pattern} (lowercase, digits, '.', '_', '-'), got {model_id!r}",
                reason="invalid_model_id",
            )
        if model_id in taken:
            raise Rejected(
                f"model id {model_id!r} is already registered (a retired model's id stays taken too: "
                "`homefleet models list --all` lists every id); choose another with --id",
                reason="model_id_taken",
            )

    def _registered_as(
        self, sources: dict[str, Path], family: str, precision: str, quantization: str | None
    ) -> str | None:
        """The id of a registered model with exactly the files ``sources`` (stored path -> the file
        it is copied from: what :func:`app.store.selection.select_files` takes, or a single LoRA
        file as :data:`~app.core.lora_files.LORA_WEIGHTS`; paths and digests), of ``family`` (a
        LoRA registered for another base family is no copy to use) and this variant, or None.
        Paths and sizes are compared first: the files are hashed only when a model has the same
        ones, nothing is copied."""
        here = dict(sources)
        sizes = {path: file.stat().st_size for path, file in here.items()}
        digests: dict[str, str] | None = None
        with Session(self.engine) as session:
            for record in session.exec(
                select(ModelRecord).where(
                    ModelRecord.family == family,
                    ModelRecord.precision == precision,
                    ModelRecord.quantization == quantization,
                    col(ModelRecord.retired_at).is_(None),  # a retired model is no copy to use instead
                )
            ):
                rows = session.exec(
                    select(ModelFile.path, ModelFile.size, ModelFile.digest).where(ModelFile.model_id == record.id)
                ).all()
                if {path: size for path, size, _ in rows} != sizes:
                    continue
                digests = digests or {path: file_digest(file) for path, file in here.items()}
                if {path: digest for path, _, digest in rows} == digests:
                    return record.id
        return None

    def get(self, model_id: str) -> ModelRecord:
        """The model, retired or not, or raise :class:`NotFound` naming the known ids. A record
        found once is kept (its id, family, kinds and variant never change; its ``retired_at`` may
        be stale here: :meth:`check_in_service` reads it afresh); an unknown id is looked up in the
        database every time, so a model registered by another process is found. Do not mutate
        the result."""
        self._follow_changes()
        found = self._records.get(model_id)
        if found is not None:
            return found
        with Session(self.engine) as session:
            record = session.get(ModelRecord, model_id)
            if record is None:  # named among the models a job may name: adapters are no job's model
                in_service = select(ModelRecord).where(col(ModelRecord.retired_at).is_(None))
                models = session.exec(in_service.order_by(ModelRecord.id)).all()
                known = ", ".join(m.id for m in models if ADAPTER_KIND not in m.kinds) or "none"
                raise NotFound(f"model {model_id!r} is not registered; in service: {known}", reason="unknown_model")
        self._records[model_id] = record
        return record

    def _follow_changes(self) -> None:
        """Drop the records (and prices) kept here when the registry's change mark moved since it
        was last read: ``models update`` in another process changed a record's sizes and digests.
        The mark is read at most every :data:`MARK_EVERY_S` seconds; one that cannot be read
        keeps them (the next read decides)."""
        if self.change_mark is None or time.monotonic() - self._mark_read_at < MARK_EVERY_S:
            return
        self._mark_read_at = time.monotonic()
        try:
            mark = self.change_mark()
        except redis.RedisError as error:  # the cache kept; said only when there is one (a CLI command has none)
            if self._records or self._priced:
                log.warning("the registry's change mark could not be read (%s); cached records kept", error)
            return
        if mark != self._mark:
            self._records.clear()
            self._priced.clear()
            self._mark = mark

    def adapter(self, adapter_id: str) -> ModelRecord:
        """The registered LoRA adapter ``adapter_id``.

        Raises:
            NotFound: no such entry, or an entry that is a model, not an adapter (reason
                ``unknown_adapter``, naming the registered adapters).
        """
        try:
            record = self.get(adapter_id)
        except NotFound:
            record = None
        if record is None or ADAPTER_KIND not in record.kinds:
            known = ", ".join(m.id for m in self.list() if ADAPTER_KIND in m.kinds) or "none"
            what = "is a model, not an adapter" if record is not None else "is not registered"
            raise NotFound(
                f"adapter {adapter_id!r} {what}; registered adapters: {known} "
                "(`homefleet models add FOLDER --adapter-of FAMILY`)",
                reason="unknown_adapter",
            )
        return record

    def list(self, retired: bool = False) -> list[ModelRecord]:
        """The models in service, by id, read from the database now; ``retired``: the retired
        ones too (``homefleet models list --all``)."""
        query = select(ModelRecord).order_by(ModelRecord.id)
        if not retired:
            query = query.where(col(ModelRecord.retired_at).is_(None))
        with Session(self.engine) as session:
            return list(session.exec(query).all())

    def retired_at(self, model_id: str) -> datetime | None:
        """When the model was retired (UTC), read from the database now (:meth:`get`'s cached
        record may predate its retirement by another process), or None while in service.
        Raises NotFound (reason ``unknown_model``)."""
        self.get(model_id)
        with Session(self.engine) as session:
            return session.exec(select(ModelRecord.retired_at).where(ModelRecord.id == model_id)).first()

    def check_in_service(self, model_id: str) -> None:
        """Refuse a retired model: its ``retired_at`` is read from the database now, so a
        retirement by another process (``homefleet models retire``) is seen at once, whatever
        :meth:`get` cached.

        Raises:
            NotFound: no such model (reason ``unknown_model``), or a retired one (404, reason
                ``model_retired``, naming when, the models in service and the fix).
        """
        retired_at = self.retired_at(model_id)
        if retired_at is None:
            return
        record = self.get(model_id)
        adapter = ADAPTER_KIND in record.kinds
        with Session(self.engine) as session:
            in_service = session.exec(
                select(ModelRecord).where(col(ModelRecord.retired_at).is_(None)).order_by(ModelRecord.id)
            ).all()
        # an adapter's stand-ins: adapters of its base family only (another family's cannot load)
        known = ", ".join(
            m.id
            for m in in_service
            if (ADAPTER_KIND in m.kinds) == adapter and (not adapter or m.family == record.family)
        )
        what = "adapter" if adapter else "model"
        others = f"adapters of family {record.family}" if adapter else "models"
        raise NotFound(
            f"{what} {model_id!r} was retired on {retired_at:%Y-%m-%d %H:%M} UTC and runs no new job; "
            f"{others} in service: {known or 'none'}",
            reason="model_retired",
        )

    def retire(self, model_id: str, delete_files: bool = False) -> Retirement:
        """Take the model out of service (``homefleet models retire ID``): record its
        ``retired_at`` (UTC now), keep its record (its jobs name it; its id stays taken, R1), then
        call ``on_change`` so every process re-reads its model list and every worker withdraws
        it (R4). From then on :meth:`list` leaves it out and :meth:`check_in_service` refuses
        it. ``delete_files``: then remove the server's copy of its files (:meth:`folder`); else
        they stay there. A model already retired is left as it is (``Retirement.already``; its
        files are still removed when asked).

        The caller holds the fleet lock (app/fleet/lock.py), under which every submission is
        journaled, so no job of it is queued between the check and the record.

        Raises:
            NotFound: no such model (reason ``unknown_model``).
            Conflict: a job of it (or, for a LoRA adapter, a job that loads it) is queued or
                running (reason ``model_in_use``, naming up to 10
                of them and the fix: cancel them or wait for them to end); nothing is recorded.
        """
        adapter = ADAPTER_KIND in self.get(model_id).kinds
        with Session(self.engine) as session:
            stored = session.get(ModelRecord, model_id)
            assert stored is not None  # get() found it; nothing deletes a record
            already = stored.retired_at is not None
            if not already:
                active = session.exec(
                    select(Job).where(col(Job.state).in_(list(ACTIVE))).order_by(col(Job.created_at))
                ).all()  # at most max_pending_total: a job of it, or one that loads it as an adapter
                live = [
                    job.id
                    for job in active
                    if job.model_id == model_id or (adapter and model_id in adapter_ids(job.params or {}))
                ]
                if live:
                    named = ", ".join(live[:10]) + (f" (and {len(live) - 10} more)" if len(live) > 10 else "")
                    raise Conflict(
                        f"model {model_id!r} has {len(live)} queued or running job(s): {named}; cancel them "
                        "(POST /v1/jobs/ID/cancel) or wait for them to end, then retire it",
                        reason="model_in_use",
                    )
                stored.retired_at = utcnow()
                session.add(stored)
                session.commit()
            retired_at = stored.retired_at
            assert retired_at is not None
        self._records.pop(model_id, None)
        self._priced.pop(model_id, None)
        self._seen = {k: v for k, v in self._seen.items() if k[0] != model_id}
        if not already and self.on_change is not None:
            self.on_change()  # every process re-reads its models; workers withdraw it (tasks/verify.py)
        folder = self.folder(model_id)
        deleted = False
        if delete_files and folder.exists():
            shutil.rmtree(folder)
            deleted = True
        return Retirement(model_id, retired_at, already, folder, deleted)

    def manifest(self, model_id: str) -> Manifest:
        """The model's manifest with its REGISTERED digests, once the server's own copy is
        checked against them (R5): a file whose (size, mtime_ns, inode) is as recorded is
        taken as unchanged; one whose stat changed is hashed again, and its recorded stat is
        refreshed only if its digest is still the registered one. A registered digest never
        changes by itself: only ``homefleet models update`` (:meth:`update`) records new ones.

        Raises:
            NotFound: no such model.
            Conflict: a file of the model is missing from the server's model folder or differs
                from its registered digest (reason ``model_changed``, naming each file and the
                fix: restore it, or ``homefleet models update ID``); or a file cannot be read
                (reason ``model_unavailable``). Its manifest cannot be handed out.
        """
        record = self.get(model_id)
        folder = self.folder(model_id)
        try:
            checks = self._check(record.id, folder, full=False)
        except OSError as error:
            raise Conflict(
                f"model {model_id!r} cannot be read in the server's model folder {folder} ({error}); restore its "
                f"files there (`homefleet models verify {model_id}` lists what is missing)",
                reason="model_unavailable",
            ) from error
        changed = [check for check in checks if check.status != "ok"]
        if changed:
            raise model_changed(model_id, folder, changed)
        return self.registered_manifest(model_id)

    def registered_manifest(self, model_id: str) -> Manifest:
        """The model's manifest as registered (paths, sizes, digests), without reading its files:
        what every copy is verified against (R4, R5). Raises NotFound."""
        record = self.get(model_id)
        with Session(self.engine) as session:
            rows = session.exec(select(ModelFile).where(ModelFile.model_id == model_id).order_by(ModelFile.path))
            files = [ManifestFile(path=row.path, size=row.size, digest=row.digest) for row in rows]
        return Manifest(
            model_id=record.id,
            family=record.family,
            kinds=list(record.kinds),
            precision=record.precision,
            quantization=record.quantization,
            algorithm=ALGORITHM,
            files=files,
            weights_bytes=self.weights_bytes(model_id),
            source_digest=record.source_digest,
        )

    def _check(self, model_id: str, folder: Path, full: bool) -> builtins.list[FileCheck]:
        """Each registered file of the model in the server's folder against its registered
        digest. ``full``: hash every byte of every file (``models verify``, C07); otherwise a
        file whose (size, mtime_ns, inode) is as recorded is ``ok`` unhashed, and a changed
        file's digest is remembered in this process under its new stat, so it is not hashed
        again at every call. Only the stat of a file whose bytes still hash to the registered
        digest is written back (the cache), and only when not ``full``. Raises OSError."""
        checks: list[FileCheck] = []
        with Session(self.engine) as session:
            rows = list(session.exec(select(ModelFile).where(ModelFile.model_id == model_id).order_by(ModelFile.path)))
            for row in rows:
                path = folder / row.path
                try:
                    stat = path.stat()
                except FileNotFoundError:
                    checks.append(FileCheck(model_id, row.path, "missing", row.digest, None))
                    continue
                key = (stat.st_size, stat.st_mtime_ns, stat.st_ino)
                if not full and key == (row.size, row.mtime_ns, row.inode):
                    checks.append(FileCheck(model_id, row.path, "ok", row.digest, row.digest))
                    continue
                seen = self._seen.get((model_id, row.path))
                actual = seen[1] if not full and seen is not None and seen[0] == key else file_digest(path)
                if actual == row.digest:
                    self._seen.pop((model_id, row.path), None)
                    if not full:
                        row.size, row.mtime_ns, row.inode = key
                        session.add(row)
                    checks.append(FileCheck(model_id, row.path, "ok", row.digest, actual))
                else:
                    self._seen[(model_id, row.path)] = (key, actual)
                    checks.append(FileCheck(model_id, row.path, "changed", row.digest, actual))
            session.commit()
        return checks

    def weights_bytes(self, model_id: str) -> int:
        """Bytes the model holds once loaded as its variant: the figure priced at registration
        (``ModelRecord.weights_bytes``, :func:`app.core.pricing.loaded_bytes`); a record registered
        before it was stored is priced from its folder now (once per process).

        Raises:
            NotFound: no such model.
            Conflict: such an old record's folder cannot be priced (damaged, truncated, missing
                file; reason ``model_unreadable``, naming the model, the error and the fix): never
                a bare parsing error, so one damaged model cannot break another's submission.
        """
        record = self.get(model_id)
        if record.weights_bytes is not None:
            return record.weights_bytes
        if model_id not in self._priced:
            folder = self.folder(model_id)
            try:
                self._priced[model_id] = price_weights(folder, record)
            except (OSError, ValueError, KeyError, TypeError, RuntimeError, NotImplementedError) as error:
                raise Conflict(
                    f"model {model_id!r} cannot be priced: its configs or safetensors headers in {folder} "
                    f"cannot be read ({type(error).__name__}: {error}); `homefleet models verify "
                    f"{model_id}` shows what changed: restore the files, or `homefleet models update "
                    f"{model_id}`",
                    reason="model_unreadable",
                ) from error
        return self._priced[model_id]

    def kv_cache_bytes(self, model_id: str, tokens: int) -> int:
        """A text model's KV cache for ``tokens`` tokens (prompt + generated), in bytes: 2 x
        layers x KV heads x head dim x bytes per value (its precision) x ``tokens``, from its
        ``config.json`` (``app/core/textgen.py``); 0 for a model that is not a text model.
        Raises NotFound."""
        record = self.get(model_id)
        folder = self.folder(model_id)
        if "text" not in record.kinds:
            return 0
        return kv_cache_bytes(model_config(folder), tokens, record.precision)

    def verify(self, model_ids: builtins.list[str] | None = None) -> builtins.list[FileCheck]:
        """Rehash every file of ``model_ids`` (default: every model) in full, ignoring the
        (size, mtime_ns, inode) cache, against its registered digest (``homefleet models
        verify``). Records NOTHING: a registered digest never changes by itself (R5); a
        changed file keeps the model refused (``model_changed``, :meth:`manifest`) until it is
        restored or ``homefleet models update`` takes the new content (:meth:`update`).

        This is what catches a change the cache cannot see, e.g. bytes rewritten in place with
        the size and mtime restored (C07).

        Raises:
            NotFound: an unknown model id.
        """
        ids = model_ids or [m.id for m in self.list()]
        checks: list[FileCheck] = []
        for model_id in ids:
            self.get(model_id)
            checks += self._check(model_id, self.folder(model_id), full=True)
        return checks

    def update(self, model_id: str, price: Callable[[Path, ModelRecord], int] | None = None) -> Update:
        """Take the current content of the model's server folder as its new manifest
        (``homefleet models update ID``): the files registration would take from it
        (:func:`app.store.selection.select_files` at the record's precision; the others are
        returned as ``left_out`` and not recorded), checked as registration checks them
        (:func:`check_taken_files`; a text model's tokenizer loads); hash them, record their digests,
        sizes and stats (files gone are dropped, new ones added), its ``total_bytes``, and its
        ``weights_bytes`` when the record has one (the folder is always priced by
        ``price(folder, record)``, bytes, default :func:`price_weights`, so unreadable headers
        are refused here), then call ``on_change`` so every worker
        re-verifies its copy against the new digests and withdraws an old one (R4). The
        family, kinds and variant stay.

        A folder whose taken files are the registered ones (no digest changed, none added or
        removed: :attr:`Update.unchanged`) records no new content and no new price, only the
        stats of a file put back (the server's own check of its folder reads them): the
        manifest every copy is verified against is the same, so no copy is old and nothing is
        withdrawn anywhere (R4, R6). ``on_change`` is still called: a worker that
        withdrew its copy of the model (its files changed, then put back) hashes it again and
        advertises it if it matches; the others keep theirs.

        Raises:
            NotFound: no such model, or a retired one (reason ``model_retired``: it runs no job,
                so a new content would serve none).
            Rejected: the folder holds no file, or its weights cannot be read (reason
                ``model_unreadable``); it now describes another pipeline class or family (reason
                ``family_changed``); or registration would refuse it (its reason, e.g.
                ``incomplete_model``): nothing is recorded.
        """
        record = self.get(model_id)
        self.check_in_service(model_id)
        folder = self.folder(model_id)
        if not folder.is_dir() or not any(p.is_file() for p in folder.rglob("*")):
            raise Rejected(
                f"model {model_id!r} has no files in the server's model folder {folder}; put its files "
                "back there first",
                reason="model_unreadable",
            )
        adapter = ADAPTER_KIND in record.kinds
        try:  # what registration would refuse is refused here too, and takes what it would take
            if not adapter:
                class_name, family, _ = describe_pipeline(folder)
                if (class_name, family) != (record.pipeline_class, record.family):
                    raise Rejected(
                        f"the folder now holds a {class_name} (family {family}), but the model is registered as "
                        f"a {record.pipeline_class} (family {record.family}); an update keeps the family, kinds "
                        "and variant: register the folder as a new model (`homefleet models add`)",
                        reason="family_changed",
                    )
            selection = select_files(folder, record.precision, adapter=adapter)
        except Rejected as error:
            raise Rejected(
                f"model {model_id!r}: {error.message}; nothing was recorded", reason=error.reason, param=error.param
            ) from error
        paths = [folder / p for p in sorted(selection.taken)]
        try:  # weights no loader can read would fail every job: refuse them here
            check_taken_files({p.relative_to(folder).as_posix(): p for p in paths})
            if adapter:  # still a LoRA of its family, as registration checked
                adapter_layout(folder, record.family)
            weights = (price or price_weights)(folder, record)
            if "text" in record.kinds:
                _check_tokenizer(folder)
        except (IntegrityFailure, OSError, ValueError, KeyError, TypeError, RuntimeError, NotImplementedError) as error:
            raise Rejected(
                f"model {model_id!r} cannot be priced from its configs and safetensors headers in "
                f"{folder} ({type(error).__name__}: {error}); nothing was recorded",
                reason="model_unreadable",
            ) from error
        fresh = [_hash_file(model_id, folder, p) for p in paths]
        with Session(self.engine) as session:
            before = {row.path: row for row in session.exec(select(ModelFile).where(ModelFile.model_id == model_id))}
            changes = Update(model_id, [], [], [], sorted(selection.left_out))
            changes.added += [f.path for f in fresh if f.path not in before]
            changes.changed += [f.path for f in fresh if f.path in before and before[f.path].digest != f.digest]
            changes.removed += sorted(set(before) - {f.path for f in fresh})
            if changes.unchanged:  # the registered manifest is the folder's: no new content to record
                for file in fresh:  # but a file put back has new stats, which the server's own check reads (R4)
                    kept = before[file.path]
                    if (kept.mtime_ns, kept.inode) != (file.mtime_ns, file.inode):
                        kept.mtime_ns, kept.inode = file.mtime_ns, file.inode
                        session.add(kept)
                session.commit()
                if self.on_change is not None:
                    self.on_change()  # a worker that withdrew its copy hashes it again; nothing is withdrawn
                return changes
            for file in fresh:
                old = before.pop(file.path, None)
                if old is None:
                    session.add(file)
                    continue
                old.size, old.digest, old.mtime_ns, old.inode = file.size, file.digest, file.mtime_ns, file.inode
                session.add(old)
            for gone in before.values():
                session.delete(gone)
            stored = session.get(ModelRecord, model_id)
            assert stored is not None  # get() found it; nothing deletes a record
            stored.total_bytes = sum(f.size for f in fresh)
            if stored.weights_bytes is not None:  # priced at registration: priced again (None: priced when read)
                stored.weights_bytes = weights
            session.add(stored)
            session.commit()
        self._records.pop(model_id, None)
        self._priced.pop(model_id, None)
        self._seen = {k: v for k, v in self._seen.items() if k[0] != model_id}
        if self.on_change is not None:
            self.on_change()  # workers re-verify against the new digests (tasks/verify.py follow_registry)
        return changes


def price_weights(folder: Path, record: ModelRecord) -> int:
    """The bytes ``record``'s variant holds once loaded, from the configs and safetensors
    headers in ``folder`` (:func:`app.core.pricing.loaded_bytes`). Raises OSError, ValueError,
    KeyError, TypeError, RuntimeError for a folder that cannot be priced."""
    return loaded_bytes(folder, record.variant)


def model_changed(model_id: str, folder: Path, changed: list[FileCheck]) -> Conflict:
    """The refusal of a model whose server copy differs from its registered digests (R5):
    409 reason ``model_changed``, naming each file (changed: the digest found; missing) and
    the two fixes."""
    listed = "; ".join(
        f"{c.path}: {'missing' if c.actual is None else 'digest ' + c.actual}, registered {c.recorded}"
        for c in changed[:5]
    )
    more = f" (and {len(changed) - 5} more)" if len(changed) > 5 else ""
    return Conflict(
        f"model {model_id!r} changed in the server's model folder {folder}: {listed}{more}; a registered digest "
        f"never changes by itself (R5): restore the files, or take the new content with "
        f"`homefleet models update {model_id}`",
        reason="model_changed",
    )


@dataclass(frozen=True)
class Retirement:
    """What :meth:`Registry.retire` did: when the model was retired (UTC), whether it already
    was (``already``), its folder on the server and whether its files were removed there."""

    model_id: str
    retired_at: datetime
    already: bool
    folder: Path
    files_deleted: bool


@dataclass
class Update:
    """What :meth:`Registry.update` recorded: paths (relative to the model folder) whose digest
    changed, that were added, that were removed."""

    model_id: str
    changed: list[str]
    added: list[str]
    removed: list[str]
    left_out: list[str] = field(default_factory=list)  # in the folder, but no loader reads them: not recorded

    @property
    def unchanged(self) -> bool:
        """No file changed, was added or was removed: the folder holds the registered manifest,
        so :meth:`Registry.update` recorded nothing (``left_out`` files are never recorded)."""
        return not (self.changed or self.added or self.removed)


@dataclass(frozen=True)
class FileCheck:
    """One file's result of :meth:`Registry.verify`: ``status`` is ok, changed or missing."""

    model_id: str
    path: str
    status: str
    recorded: str  # the registered digest
    actual: str | None  # the digest of the bytes now (None when missing)


def _price(folder: Path, variant: Variant) -> int:
    """:func:`app.core.pricing.loaded_bytes` of a folder being registered; a folder that cannot be
    priced is removed and refused (reason ``not_a_model``, naming the error; ``incomplete_model``
    when its weights lack parameters its config builds, :class:`app.core.pricing.MissingTensors`):
    it could not be loaded either."""
    try:
        return loaded_bytes(folder, variant)
    except MissingTensors as error:
        shutil.rmtree(folder, ignore_errors=True)
        raise Rejected(str(error), reason="incomplete_model") from error
    except (OSError, ValueError, TypeError, RuntimeError, NotImplementedError, AttributeError, KeyError) as error:
        # AttributeError, KeyError: a config that does not suit the class named (a CLIP config
        # for a T5 encoder); the library reads a field the config lacks
        shutil.rmtree(folder, ignore_errors=True)
        raise Rejected(
            f"{folder.name}: its {variant.key()} variant cannot be priced from its configs and "
            f"safetensors headers ({type(error).__name__}: {error})",
            reason="not_a_model",
        ) from error


def check_taken_files(files: Mapping[str, Path]) -> None:
    """Check the files a model takes (relative path -> the file) as their loaders would read
    them, without loading any (a file that is a Hugging Face cache blob first against its name,
    :func:`app.store.hf_cache.check_blob`): safetensors by safetensors' own reader
    (:func:`app.core.safetensors.check_loadable`), ``.bin`` archives by their central directory
    (:func:`app.core.torch_archive.check_archive`), JSON files by :func:`model_json`.

    Raises:
        IntegrityFailure: ``"<path> cannot be loaded (<why>)"`` for a weights file;
            :class:`app.store.hf_cache.BlobMismatch`, ``"<path> does not match its Hugging Face
            cache blob (...)"``.
        Rejected: a JSON file that is not a JSON object in UTF-8 (reason ``not_a_model``).
    """
    for path, origin in files.items():
        check_blob(path, origin)  # a Hugging Face cache blob whose bytes no longer match its name
        if path.endswith((".safetensors", ".bin")):
            try:
                (check_loadable if path.endswith(".safetensors") else check_archive)(origin)
            except IntegrityFailure as error:
                raise IntegrityFailure(f"{path} cannot be loaded ({error})") from error
        elif path.endswith(".json"):
            model_json(origin)


CHAT_PROBE = [{"role": "user", "content": "Hello"}]
"""The chat every chat template must render at registration: one user message."""


def _check_tokenizer(folder: Path) -> None:
    """Load the tokenizer of a text model from ``folder`` (its stored copy), as a worker loads
    it (:func:`app.core.textgen.load_tokenizer`), and render its chat template, if it has one,
    for one user message (:data:`CHAT_PROBE`), as the chat routes render it.

    Raises:
        Rejected: reason ``incomplete_model`` when it cannot be loaded: every request would fail;
            reason ``invalid_chat_template`` when its chat template does not compile or refuses
            a lone user message: every chat would fail (a template that refuses only some roles,
            e.g. a system message, is kept: those requests get 422 ``invalid_messages``).
    """
    try:
        tokenizer = load_tokenizer(folder)
    except (OSError, ValueError, TypeError, KeyError, AttributeError, ImportError) as error:
        held = sorted(p.name for p in folder.iterdir() if p.name in TOKENIZER_FILES)
        lacking = "" if (folder / "tokenizer.json").is_file() else "no tokenizer.json; "
        said = " ".join(str(error).split())  # transformers' messages run over several lines
        raise Rejected(
            f"{folder.name}: its tokenizer cannot be loaded: {lacking}its tokenizer files: "
            f"{', '.join(held) or 'none'} ({type(error).__name__}: {said[:240]}{'…' if len(said) > 240 else ''}); "
            "a text model needs tokenizer.json, or the vocabulary files its tokenizer_config.json names, "
            "beside config.json: an interrupted download? download the model again",
            reason="incomplete_model",
        ) from error
    if getattr(tokenizer, "chat_template", None):
        try:
            chat_prompt(tokenizer, CHAT_PROBE)
        except ValueError as error:
            where = "chat_template.jinja" if (folder / "chat_template.jinja").is_file() else "tokenizer_config.json"
            raise Rejected(
                f"{folder.name}: its chat template ({where}) cannot template one user message: {error}; fix the "
                "template, or remove it to serve plain completions only",
                reason="invalid_chat_template",
            ) from error


def _hash_file(model_id: str, folder: Path, path: Path) -> ModelFile:
    stat = path.stat()
    return ModelFile(
        model_id=model_id,
        path=path.relative_to(folder).as_posix(),
        size=stat.st_size,
        digest=file_digest(path),
        mtime_ns=stat.st_mtime_ns,
        inode=stat.st_ino,
    )


def _mint_id(name: str, taken: set[str]) -> str:
    """An id from a file or folder name: accents folded to ASCII ("Ünïcode" -> "unicode"), every
    other run of characters an id may not hold made one "-", at most 56 characters, "model" when
    nothing is left; "-2", "-3", ... appended while taken."""
    folded = unicodedata.normalize("NFKD", name).encode("ascii", "ignore").decode()
    base = re.sub(r"[^a-z0-9._-]+", "-", folded.lower()).strip("-._")[:56] or "model"
    candidate, n = base, 2
    while candidate in taken:
        candidate, n = f"{base}-{n}", n + 1
    return candidate
