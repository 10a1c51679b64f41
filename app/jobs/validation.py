"""Validate before the GPU (R22): every check a submission passes before any side effect, in
one module (STYLE.md #8). :meth:`Validator.request` is the single entry; the checks it runs are
the functions below, each refusing with :class:`~app.core.errors.Rejected` (422) whose message
names the field, the value, the limit and the fix, and whose ``reason`` is ``invalid_<field>``
(``unknown_param``, ``kind_not_supported``, ``unknown_file``…) so refusals can be counted.

What each kind accepts (params, defaults, ranges, inputs, "prompt required") is its spec in
``app/core/kinds.py``; what each family allows (pixels, steps, frames, tokens, uploads) is its
:class:`~app.core.limits.FamilyLimits`.
"""

from __future__ import annotations

import functools
import json
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from app.core import constraints
from app.core.errors import Conflict, IntegrityFailure, NotFound, Rejected
from app.core.families import FAMILIES, kinds_of
from app.core.families import family as family_rules
from app.core.kinds import (
    ADAPTERS_PARAM,
    BATCH_PARAM,
    CHAT_SHOWN_PARAM,
    KINDS,
    MAX_SEED,
    OUTPUT_SIZE_FIELDS,
    SERVER_SET_PARAMS,
    KindSpec,
    adapter_ids,
    denoised_steps,
    greedy,
    job_request,
    spec,
    with_defaults,
)
from app.core.kinds import family_kind_spec as family_spec
from app.core.limits import MAX_MODEL_ID, FamilyLimits, TokenLimits, limits_for, token_limits
from app.core.lora_files import context_width, first_misfit, weight_file, width_name
from app.core.safetensors import safetensors_header
from app.core.specs import shown
from app.core.textgen import (
    CHAT_ROLES,
    CONTEXT_LENGTH_EXCEEDED,
    ChatTemplateBroken,
    TokenDecoder,
    chat_prompt,
    end_token_ids,
    folder_end_token_ids,
    is_text_folder,
    load_tokenizer,
    max_positions,
    model_config,
    prompt_ids,
    stop_sequences,
)
from app.db.tables import ModelRecord
from app.store.files import InputStore, StoredFile
from app.store.media import upright_size
from app.store.registry import Registry
from routing.placement import JobRequest
from routing.timings import ADAPTER_KIND, TEXT_KIND

log = logging.getLogger(__name__)

INTEGER_PARAMS: tuple[str, ...] = (
    "width",
    "height",
    "steps",
    "frames",
    "n",
    "seed",
    *dict.fromkeys(number.name for spec in KINDS.values() for number in spec.numbers if number.integer),
)
"""Params taken as integers, also when a JSON client sends an integer-valued float (``512.0``;
JSON Schema's ``integer`` admits it, R22): the sizes :func:`check_submission` checks, the seed
and every integer number of a kind (``noise_level``, ``max_new_tokens``)."""

MAX_ADAPTER_SCALE = 4.0
"""``params.adapters[i].scale`` lies in [-MAX_ADAPTER_SCALE, MAX_ADAPTER_SCALE]: the
LoRA's weight in diffusers' ``set_adapters``; 0 leaves the model as it is, 1 is the adapter as
trained, beyond a few it only breaks images."""


def check_runs(record: ModelRecord, kind: str) -> None:
    """Refuse ``kind`` for a model that does not run it.

    Raises:
        Rejected: reason ``kind_not_supported``, naming the kinds the model runs.
    """
    kinds = kinds_of(record.family, record.kinds)
    if kind not in kinds:
        if ADAPTER_KIND in kinds:  # a LoRA named as the job's model
            raise Rejected(
                f"model {record.id!r} is a LoRA adapter of family {record.family}, not a model that runs jobs: "
                f'name it in `params.adapters` ([{{"id": "{record.id}", "scale": 1.0}}]) of a job on a '
                f"{record.family} model",
                reason="kind_not_supported",
                param="model",
            )
        hint = ""
        if kind == "edit" and {"img2img", "inpaint"} & set(kinds):
            # OpenAI's images.edit names no kind: say what an edit is here and where this model's kinds run
            editors = ", ".join(name for name, f in FAMILIES.items() if "edit" in f.kinds)
            hint = (
                f": an edit (POST /v1/images/edits) changes an image from an instruction and needs a model of "
                f"an edit family ({editors}); this model's img2img and inpaint run as jobs (POST /v1/jobs with "
                "`kind` img2img or inpaint, docs/api.md)"
            )
        raise Rejected(
            f"model {record.id!r} runs kinds {', '.join(kinds)}; got kind {kind!r}{hint}", reason="kind_not_supported"
        )


class Validator:
    """Checks a submission against its model (registry), its kind's spec, its family's limits
    and its inputs (the input store), counting prompt tokens with the model's own tokenizer."""

    def __init__(
        self,
        registry: Registry,
        inputs: InputStore,
        limits: Mapping[str, FamilyLimits],
        models: Mapping[str, Any] | None = None,
    ) -> None:
        self.registry = registry
        self.inputs = inputs
        self.limits = limits
        self.models = models or {}  # the fleet file's [models.<id>] (ModelGuess): a text model's token limits
        self.tokenizers = PromptTokenizers(registry.folder)  # each model's own, cached (R22)

    def model(self, model_id: str) -> ModelRecord:
        """The registered model a submission names, once its files in the server's model folder
        are checked against their registered digests (R5, :meth:`Registry.manifest`: a stat
        compare, a rehash only of a file whose stat changed).

        Raises:
            NotFound: the model is not registered (reason ``unknown_model``), or was retired
                (reason ``model_retired``, :meth:`Registry.check_in_service`, read afresh).
            Conflict: a file of it changed or is missing there (409, reason ``model_changed``,
                naming the files and ``homefleet models update ID``), or cannot be read
                (``model_unavailable``): nothing of it is read further, nothing is queued.
        """
        record = self.registry.get(model_id)
        self.registry.check_in_service(model_id)
        self.registry.manifest(model_id)
        return record

    def token_limits(self, model_id: str) -> TokenLimits:
        """A text model's token limits: the fleet file's ``[models.<id>]``, else its
        family's limits, else its ``config.json``'s ``max_position_embeddings``.

        Raises:
            NotFound: the model is not registered.
        """
        record = self.registry.get(model_id)
        own = self.models.get(model_id)
        positions = max_positions(model_config(self.registry.folder(model_id)))
        return token_limits(
            limits_for(self.limits, record.family),
            positions,
            getattr(own, "max_input_tokens", None),
            getattr(own, "max_total_tokens", None),
        )

    def chat_prompt(self, model_id: str, messages: Any) -> str:
        """The prompt text of a chat request for ``model_id``: ``messages`` (a list of
        ``{"role": str, "content": str}``) through the model's own chat template.

        Raises:
            NotFound: the model is not registered.
            Rejected: a model that does not generate text (reason ``kind_not_supported``),
                malformed messages, a model without a chat template or a template that refuses
                these messages (reason ``invalid_messages``, quoting it), or a template that
                does not compile (reason ``chat_template_broken``).
            Conflict: the model's files changed on the server (``model_changed``, :meth:`model`).
        """
        check_runs(self.model(model_id), TEXT_KIND)
        if (
            not isinstance(messages, list)
            or not messages
            or not all(
                isinstance(m, dict) and m.get("role") in CHAT_ROLES and isinstance(m.get("content"), str)
                for m in messages
            )
        ):
            raise Rejected(
                '`messages` must be a non-empty list of {"role": string, "content": string}, each role one of '
                + ", ".join(CHAT_ROLES),
                reason="invalid_messages",
                param="messages",
            )
        tokenizer = self.tokenizers.tokenizer(model_id)
        if tokenizer is None:
            raise Rejected(f"model {model_id!r} has no tokenizer", reason="invalid_messages", param="messages")
        try:
            return chat_prompt(tokenizer, [{k: m[k] for k in ("role", "content", "name") if k in m} for m in messages])
        except ChatTemplateBroken as error:  # the model's fault, not the request's: fixed with `models update`
            raise Rejected(
                f"model {model_id!r}: {error}; the operator fixes its chat_template (chat_template.jinja or "
                "tokenizer_config.json) and runs `homefleet models update`",
                reason="chat_template_broken",
                param="messages",
            ) from error
        except ValueError as error:
            raise Rejected(f"model {model_id!r}: {error}", reason="invalid_messages", param="messages") from error

    def request(self, model_id: str, kind: str, params: dict[str, Any], target: str) -> JobRequest:
        """The placement request of a submission, after every check of its params. Mutates
        ``params``: integer-valued floats become ints, a text job's ``temperature`` below
        ``GREEDY_TEMPERATURE`` (5e-324) becomes 0.0 (greedy decoding, as OpenAI's 0), and for kinds whose output size
        follows
        their input image (edit, upscale) ``output_width``/``output_height`` (pixels) are set,
        so the journal shows what was priced.

        Raises:
            NotFound: the model is not registered (reason ``unknown_model``), or it or an adapter
                it names was retired (reason ``model_retired``).
            Conflict: a file of the model, or of an adapter it names, changed or is missing in
                the server's model folder (409, reason ``model_changed``, :meth:`model`).
            Rejected: the model does not run ``kind`` (reason ``kind_not_supported``), the
                params exceed the family's limits (reason ``invalid_<field>``), or an input,
                format, seed or number is refused (:func:`check_kind_params`).
        """
        record = self.model(model_id)
        check_runs(record, kind)
        asked_new_tokens = "max_new_tokens" in params
        self.apply_defaults(record, kind, params)
        limits = limits_for(self.limits, record.family)
        if kind == "text":
            params.update(integer_params(params))  # 16.0 new tokens are 16
            check_submission(params, limits, None, kind, record.family)  # tokens: check_text_tokens
            check_kind_params(kind, params, self.inputs, limits, record.family)
            if isinstance(temperature := params.get("temperature"), int | float) and greedy(temperature):
                params["temperature"] = 0.0  # journaled as it runs: greedy (GREEDY_TEMPERATURE)
            tokenizer = self.tokenizers.tokenizer(model_id)
            tokens = check_text_tokens(params, tokenizer, self.token_limits(model_id), asked=asked_new_tokens)
            check_text_grammar(params, tokenizer, model_config(self.registry.folder(model_id)))
            if "stop" in params:  # journaled as a list (a string is one sequence)
                try:
                    params["stop"] = stop_sequences(params["stop"])
                except ValueError as error:
                    raise Rejected(f"params.stop {error}", reason="invalid_stop", param="params.stop") from error
            return job_request(model_id, record.family, kind, target, params, prompt_tokens=tokens)
        text_model = params.get("expand_prompt") if kind == "txt2img" else None
        if text_model is not None and not (isinstance(text_model, str) and 1 <= len(text_model) <= MAX_MODEL_ID):
            raise Rejected(
                f"params.expand_prompt must be a text model's id (1-{MAX_MODEL_ID} characters)",
                reason="invalid_expand_prompt",
                param="params.expand_prompt",
            )
        if text_model is not None and not isinstance(params.get("expanded_by"), str):
            raise Rejected(
                "params.expand_prompt is run by POST /v1/jobs (the expansion's text job first, "
                "app/jobs/expansion.py); this route cannot expand a prompt",
                reason="invalid_expand_prompt",
                param="params.expand_prompt",
            )
        if kind == "video" and (most := model_max_frames(self.registry.folder(model_id))) is not None:
            limits = limits.model_copy(update={"max_frames": min(limits.max_frames, most)})  # the model's own limit
        check_submission(params, limits, self.tokenizers.counter(model_id), kind, record.family)
        if ADAPTERS_PARAM in params:  # journaled as checked, each with its scale
            params[ADAPTERS_PARAM] = check_adapters(params, limits, record.family, self.adapter_families(params))
            for index, entry in enumerate(params[ADAPTERS_PARAM]):
                try:
                    self.model(entry["id"])  # R5: an adapter's files are checked like its model's
                except NotFound as error:  # retired: the entry is at fault, not the job's model
                    error.param = error.param or f"params.adapters[{index}].id"
                    raise
            if params[ADAPTERS_PARAM]:
                folder = self.registry.folder(model_id)
                check_adapter_fit(
                    model_id,
                    model_context_width(folder),
                    model_modules(folder),
                    [adapter_shapes(self.registry.folder(entry["id"])) for entry in params[ADAPTERS_PARAM]],
                    params[ADAPTERS_PARAM],
                )
        params.update(integer_params(params))  # 64.0 frames are 64 frames from here on
        check_kind_params(kind, params, self.inputs, limits, record.family)
        check_family_params(record.family, kind, params)
        params.update(output_size(kind, params, self.inputs))
        if "output_width" in params:
            check_output_pixels(params["output_width"], params["output_height"], limits)
        return job_request(model_id, record.family, kind, target, params)

    def placed_request(self, model_id: str, kind: str, target: str, params: Mapping[str, Any]) -> JobRequest:
        """The placement request of a job already journaled, priced as :meth:`request` priced it
        at submission, without its checks: a text job's size is its prompt's tokens, counted with
        the model's own tokenizer as the worker feeds them (``prompt_ids``, chat-templated
        prompts as they are), at least 1 (a remembered OOM at size 0 would refuse every request
        of its kind, R21); where the tokenizer cannot be loaded now, 1. Any other kind:
        ``job_request`` (pixels x frames x batch)."""
        try:
            family = self.registry.get(model_id).family
        except NotFound:  # removed since: the kind's defaults
            family = ""
        if kind != TEXT_KIND:
            return job_request(model_id, family, kind, target, params)
        tokens = 0
        chat = KINDS[TEXT_KIND].value(params, "chat")
        try:
            tokenizer = self.tokenizers.tokenizer(model_id)
            if tokenizer is not None:
                tokens = len(prompt_ids(tokenizer, str(params.get("prompt", "")), chat is True))
        except Conflict as error:  # tokenizer_unloadable: no count, never 0
            log.warning("model %s: prompt tokens not counted (%s); size taken as 1", model_id, error)
        return job_request(model_id, family, kind, target, params, prompt_tokens=max(1, tokens))

    def apply_defaults(self, record: ModelRecord, kind: str, params: dict[str, Any]) -> None:
        """Set in ``params`` each param of ``kind`` it lacks that the job's adapters (in order)
        or else its model default (``ModelRecord.defaults``, ``models add --default``): the
        client's value wins, then an adapter's, then the model's. Journaled as set, so the
        job's params and provenance show what ran (R9). An adapter entry that names no
        registered model is left to :func:`check_adapters`."""
        adapters: list[dict[str, Any] | None] = []
        for adapter_id in adapter_ids(params):
            try:
                adapters.append(self.registry.get(adapter_id).defaults)
            except NotFound:
                continue
        if kind in KINDS and (record.defaults or any(adapters)):
            params.update(with_defaults(family_spec(record.family, kind), params, *adapters, record.defaults))

    def adapter_families(self, params: Mapping[str, Any]) -> dict[str, str]:
        """The base family of each registered adapter ``params.adapters`` names,
        ``{adapter id: family}``; ids that name no adapter are left out (:func:`check_adapters`
        refuses them)."""
        entries = params.get(ADAPTERS_PARAM)
        families: dict[str, str] = {}
        for entry in entries if isinstance(entries, list) else ():
            adapter_id = entry.get("id") if isinstance(entry, dict) else None
            if isinstance(adapter_id, str) and 1 <= len(adapter_id) <= MAX_MODEL_ID:
                try:
                    families[adapter_id] = self.registry.adapter(adapter_id).family
                except NotFound:
                    continue
        return families


def check_adapters(
    params: Mapping[str, Any], limits: FamilyLimits, family: str, adapter_families: Mapping[str, str]
) -> list[dict[str, Any]]:
    """Check ``params.adapters`` of a job on a model of ``family``: a list of at most
    ``limits.max_adapters`` objects ``{"id": str, "scale": number}`` (``scale`` optional,
    default 1.0, finite, within +-:data:`MAX_ADAPTER_SCALE`), each id a registered adapter
    (``adapter_families``: adapter id -> its base family) of the model's own family, no id
    twice. Returns the entries as journaled: ``[{"id", "scale": float}]``.

    Raises:
        Rejected: naming ``params.adapters`` (reason ``invalid_adapters``: not a list, too many,
            an entry that is not such an object), ``params.adapters[i].id`` (reason
            ``unknown_adapter``: not a registered adapter; ``adapter_family_mismatch``: an
            adapter of another family; ``invalid_adapters``: twice) or
            ``params.adapters[i].scale`` (reason ``invalid_adapters``).
    """
    entries = params.get(ADAPTERS_PARAM)
    field = f"params.{ADAPTERS_PARAM}"
    if not isinstance(entries, list):
        raise Rejected(
            f'{field} must be a list of {{"id": adapter id, "scale": number}}, got {entries!r}'[:500],
            reason="invalid_adapters",
            param=field,
        )
    if len(entries) > limits.max_adapters:
        raise Rejected(
            f"{field} holds {len(entries)} adapters; family {family} takes at most "
            f"{limits.max_adapters} (max_adapters)",
            reason="invalid_adapters",
            param=field,
        )
    checked: list[dict[str, Any]] = []
    for i, entry in enumerate(entries):
        at = f"{field}[{i}]"
        if not isinstance(entry, dict) or set(entry) - {"id", "scale"} or "id" not in entry:
            raise Rejected(
                f'{at} must be an object {{"id": adapter id, "scale": number}} (only those keys), got {entry!r}'[:500],
                reason="invalid_adapters",
                param=at,
            )
        adapter_id, scale = entry["id"], entry.get("scale", 1.0)
        if not isinstance(adapter_id, str) or adapter_id not in adapter_families:
            raise Rejected(
                f"{at}.id {adapter_id!r} is not a registered adapter; register one with "
                "`homefleet models add FOLDER --adapter-of FAMILY` (GET /v1/models lists kind adapter)",
                reason="unknown_adapter",
                param=f"{at}.id",
            )
        if adapter_families[adapter_id] != family:
            raise Rejected(
                f"{at}.id: adapter {adapter_id!r} is of family {adapter_families[adapter_id]}, the model is "
                f"of family {family}; use an adapter of family {family}",
                reason="adapter_family_mismatch",
                param=f"{at}.id",
            )
        if any(done["id"] == adapter_id for done in checked):
            raise Rejected(
                f"{at}.id: adapter {adapter_id!r} is named twice; give it once with its scale",
                reason="invalid_adapters",
                param=f"{at}.id",
            )
        if (
            not isinstance(scale, int | float)
            or isinstance(scale, bool)
            or not -MAX_ADAPTER_SCALE <= scale <= MAX_ADAPTER_SCALE
        ):  # NaN compares false: refused too
            raise Rejected(
                f"{at}.scale must be a number from {-MAX_ADAPTER_SCALE:g} to {MAX_ADAPTER_SCALE:g}, got {scale!r}"[
                    :500
                ],
                reason="invalid_adapters",
                param=f"{at}.scale",
            )
        checked.append({"id": adapter_id, "scale": float(scale)})
    return checked


def check_adapter_fit(
    model_id: str,
    model_width: int | None,
    modules: Mapping[str, Mapping[str, Sequence[int]]],
    adapters: Sequence[Mapping[str, Sequence[int]] | None],
    entries: Sequence[Mapping[str, Any]],
) -> None:
    """Check that each adapter of ``entries`` (``params.adapters`` as :func:`check_adapters`
    returns them; ``adapters``: each one's tensor shapes, :func:`adapter_shapes`, None where
    unreadable) fits the model: first its cross-attention width against ``model_width``
    (:func:`model_context_width`; SD 1.x and 2.x share a family and their LoRAs' tensor names, so
    only this width tells an SD 1.x LoRA, 768, from an SD 2.x one, 1024), then every tensor whose
    module the model has against that module's weight in ``modules`` (:func:`model_modules`;
    :func:`app.core.lora_files.first_misfit`), then that no tensor adapts a module the model's
    component lacks. Loaded on a base it does not fit, diffusers fails the job on the device with
    a shape mismatch, or applies the adapter in part without a word.

    Raises:
        Rejected: reason ``adapter_base_mismatch``, naming ``params.adapters[i].id``: both
            cross-attention widths and where the model's comes from, or the tensor, the module
            and both shapes, or the tensor and the module the model lacks.
    """
    for index, (entry, shapes) in enumerate(zip(entries, adapters, strict=True)):
        if shapes is None:
            continue
        at = f"params.adapters[{index}].id"
        width = context_width(shapes)
        if model_width is not None and width is not None and width != model_width:
            raise Rejected(
                f"{at}: adapter {entry['id']!r} was made for a UNet of cross-attention width {width_name(width)}; "
                f"model {model_id!r} attends at width {width_name(model_width)} (cross_attention_dim in its "
                "unet/config.json); use an adapter made for the model's base",
                reason="adapter_base_mismatch",
                param=at,
            )
        misfit = first_misfit(shapes, modules)
        if misfit is not None and misfit.side == "missing":
            raise Rejected(
                f"{at}: adapter {entry['id']!r} does not fit model {model_id!r}: its {misfit.key} adapts "
                f"{misfit.module}, a module the model's {misfit.component} does not have; diffusers would apply "
                "the rest of it and leave that out without a word; use an adapter made for the model's base",
                reason="adapter_base_mismatch",
                param=at,
            )
        if misfit is not None:
            side = 0 if misfit.side == "output" else 1
            raise Rejected(
                f"{at}: adapter {entry['id']!r} does not fit model {model_id!r}: its {misfit.key} is "
                f"{list(misfit.shape)}, for {misfit.side}s of width {misfit.shape[side]}, where the model's "
                f"{misfit.component} {misfit.module} has {misfit.base_shape[side]} (weight "
                f"{list(misfit.base_shape)}); use an adapter made for the model's base",
                reason="adapter_base_mismatch",
                param=at,
            )


LORA_COMPONENTS = ("unet", "transformer", "text_encoder", "text_encoder_2")
"""The model components a LoRA adapts (the prefixes of diffusers' LoRA names)."""


def fitting_adapters(model_id: str, folder: Path, adapters: Sequence[tuple[str, Path]]) -> list[str]:
    """The ids of ``adapters`` (``(id, folder)`` of registered LoRA adapters of the model's family)
    that :func:`check_adapter_fit` lets the model in ``folder`` load, in their order: what a
    submission naming them with this model would not be refused for (R22). An adapter whose
    file cannot be read is kept (the worker's file check, R5, reports it)."""
    width, modules = model_context_width(folder), model_modules(folder)
    fitting = []
    for adapter_id, adapter_folder in adapters:
        try:
            check_adapter_fit(model_id, width, modules, [adapter_shapes(adapter_folder)], [{"id": adapter_id}])
        except Rejected:
            continue
        fitting.append(adapter_id)
    return fitting


def model_modules(folder: Path) -> dict[str, dict[str, Sequence[int]]]:
    """The weight shapes of the model ``folder``'s components a LoRA may adapt
    (:data:`LORA_COMPONENTS`): component -> weight name without ``.weight`` -> shape, from the
    headers of every ``*.safetensors`` file in that component's folder (shards and variants
    alike: their shapes agree; :func:`header_shapes`). An unreadable one is left out (the
    worker's file check, R5, reports it)."""
    out: dict[str, dict[str, Sequence[int]]] = {}
    for component in LORA_COMPONENTS:
        shapes: dict[str, Sequence[int]] = {}
        for path in sorted((folder / component).glob("*.safetensors")):
            shapes.update(
                (name.removesuffix(".weight"), shape)
                for name, shape in (header_shapes(path) or {}).items()
                if name.endswith(".weight")
            )
        if shapes:
            out[component] = shapes
    return out


def model_context_width(folder: Path) -> int | None:
    """The cross-attention width of the UNet in the model ``folder``: ``cross_attention_dim`` in
    its ``unet/config.json`` (one number, or a list of equal ones; :func:`config_value`); None
    for a model without a UNet (a diffusion transformer) or a config that does not say (the
    worker's file check, R5, reports an unreadable one)."""
    width = config_value(folder / "unet" / "config.json", "cross_attention_dim")
    if isinstance(width, list) and width and all(w == width[0] for w in width):
        width = width[0]
    return width if isinstance(width, int) and not isinstance(width, bool) and width > 0 else None


def adapter_shapes(folder: Path) -> Mapping[str, Sequence[int]] | None:
    """The tensor shapes of the LoRA adapter in ``folder`` (a registered adapter's model folder):
    its weight file's header only (:func:`header_shapes`); None when it cannot be read (the
    worker's file check, R5, reports that)."""
    name = weight_file(p.name for p in folder.glob("*.safetensors"))
    return None if name is None else header_shapes(folder / name)


def config_value(path: Path, key: str) -> Any:
    """``key`` of the JSON object in ``path`` (a model's ``config.json``), None when the file or
    the key is missing or the file is no JSON object. The file is read again only when its size
    or modification time changes (one cache for every config the submission checks read)."""
    try:
        stat = path.stat()
    except OSError:
        return None
    return _config_at(path, stat.st_mtime_ns, stat.st_size).get(key)


@functools.lru_cache(maxsize=256)
def _config_at(path: Path, _mtime_ns: int, _size: int) -> Mapping[str, Any]:
    try:
        found = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


def header_shapes(path: Path) -> Mapping[str, Sequence[int]] | None:
    """Tensor name -> shape of the ``.safetensors`` file ``path``, from its header only
    (:func:`app.core.safetensors.safetensors_header`); None when it cannot be read. Read again
    only when the file's size or modification time changes."""
    try:
        stat = path.stat()
    except OSError:
        return None
    return _shapes_at(path, stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=256)
def _shapes_at(path: Path, _mtime_ns: int, _size: int) -> Mapping[str, Sequence[int]] | None:
    try:
        header = safetensors_header(path)
    except (OSError, IntegrityFailure):
        return None
    return {name: tuple(entry.get("shape") or ()) for name, entry in header.items() if isinstance(entry, dict)}


def _integer(params: Mapping[str, Any], name: str) -> int | None:
    value = params.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer() and abs(value) <= 2**53:  # exactly an integer
            return int(value)
        raise Rejected(
            f"`{name}` must be an integer, got {shown(value)}", reason=f"invalid_{name}", param=f"params.{name}"
        )
    return value


def integer_params(params: Mapping[str, Any]) -> dict[str, int]:
    """The :data:`INTEGER_PARAMS` of ``params`` sent as integer-valued floats, as ints: what the
    server stores, prices and sends to the pipeline (``64.0`` frames are 64 frames, not 8)."""
    return {
        name: int(value)
        for name in INTEGER_PARAMS
        if isinstance(value := params.get(name), float) and value.is_integer() and abs(value) <= 2**53
    }


def _bounded(name: str, value: int | None, low: int, high: int, hint: str = "") -> None:
    if value is not None and not low <= value <= high:
        raise Rejected(
            f"`{name}` must be between {low} and {high}{hint}, got {shown(value)}",
            reason=f"invalid_{name}",
            param=f"params.{name}",
        )


def check_known_params(kind: str, params: Mapping[str, Any], family: str = "") -> KindSpec:
    """Refuse keys of ``params`` that ``kind`` does not use on a model of ``family``, instead of
    ignoring them (R22): ``{"prompt": "x", "stepz": 4}`` would otherwise run with the default
    steps, and ``image_guidance_scale`` would reach a Qwen-Image-Edit pipeline that has no such
    argument. Returns the kind's spec for that family (``app/core/families.py``).

    Raises:
        Rejected: reason ``unknown_param``, naming each unknown key and listing the params
            ``kind`` takes; reason ``kind_not_supported`` when ``kind`` is not implemented.
    """
    try:
        kind_spec = family_spec(family, kind)
    except KeyError as error:
        raise Rejected(
            f"kind {kind!r} is not implemented; implemented: {', '.join(KINDS)}", reason="kind_not_supported"
        ) from error
    unknown = [name for name in params if name not in kind_spec.accepted]
    if unknown:
        named = ", ".join(f"params.{name}" for name in unknown)
        verb = "is not a param" if len(unknown) == 1 else "are not params"
        rules = family_rules(family)
        on = (
            f" on family {family} ({rules.pipeline_class_of(kind)})"
            if rules is not None and kind in rules.kinds
            else ""
        )
        takes = [name for name in kind_spec.params + kind_spec.server_params if name not in SERVER_SET_PARAMS]
        raise Rejected(
            f"{named} {verb} of kind {kind!r}{on}; it takes {', '.join(takes)}",
            reason="unknown_param",
            param=f"params.{unknown[0]}",
        )
    return kind_spec


def check_submission(
    params: Mapping[str, Any],
    limits: FamilyLimits,
    count_tokens: Callable[[str], int] | None = None,
    kind: str | None = None,
    family: str = "",
) -> None:
    """Refuse a submission whose params exceed ``limits`` (R22). Pure: no side effect.

    With ``kind``, first refuses keys that kind does not use on ``family`` (:func:`check_known_params`) and a
    missing prompt where the kind requires one. Checks ``width``/``height`` (pixels, multiples of
    ``multiple_of``, product <= ``max_pixels``), ``steps``, ``frames`` (video) and ``n`` (images
    per OpenAI request), ``prompt``/``negative_prompt`` (strings; characters; tokens, counted
    with ``count_tokens``).

    Raises:
        Rejected: reason ``invalid_<field>``; the message names the field, value and limit.
            Reason ``unknown_param`` for a key ``kind`` does not use, naming it and the params
            ``kind`` takes.
    """
    prompt = params.get("prompt")
    if prompt is not None and not isinstance(prompt, str):
        raise Rejected(
            f"`prompt` must be a string, got {type(prompt).__name__}", reason="invalid_prompt", param="params.prompt"
        )
    if kind is not None:
        kind_spec = check_known_params(kind, params, family)
        if kind_spec.prompt_required and not (prompt or "").strip():
            got = "none was given" if prompt is None else "it is empty" if not prompt else "it is only whitespace"
            raise Rejected(
                f"`prompt` is required for kind {kind}; {got}", reason="invalid_prompt", param="params.prompt"
            )
    width, height = _integer(params, "width"), _integer(params, "height")
    for name, side in (("width", width), ("height", height)):
        if side is None:
            continue
        if side < limits.min_side or side % limits.multiple_of:
            raise Rejected(
                f"`{name}` must be a multiple of {limits.multiple_of} and at least {limits.min_side} pixels, "
                f"got {shown(side)}",
                reason=f"invalid_{name}",
                param=f"params.{name}",
            )
    if width is not None or height is not None:
        pixels = (width or 64) * (height or 64)
        if pixels > limits.max_pixels:
            raise Rejected(
                f"`width` x `height` must be at most {limits.max_pixels} pixels, got {shown(width)} x "
                f"{shown(height)} = {shown(pixels)}; ask for a smaller size",
                reason="invalid_size",
                param="params.width" if width is not None else "params.height",
            )
    _bounded("steps", _integer(params, "steps"), 1, limits.max_steps)
    _bounded("frames", _integer(params, "frames"), 1, limits.max_frames)  # the video kind's name
    _bounded("n", _integer(params, "n"), 1, limits.max_batch, f" (max_batch{f' of family {family}' if family else ''})")
    for name in ("prompt", "negative_prompt", CHAT_SHOWN_PARAM):  # the last: a chat's, as the page shows it
        text = params.get(name)
        if text is None:
            continue
        if not isinstance(text, str):
            raise Rejected(
                f"`{name}` must be a string, got {type(text).__name__}",
                reason=f"invalid_{name}",
                param=f"params.{name}",
            )
        if len(text) > limits.max_prompt_chars:
            raise Rejected(
                f"`{name}` must be at most {limits.max_prompt_chars} characters (max_prompt_chars), "
                f"got {len(text)}; shorten it",
                reason=f"invalid_{name}",
                param=f"params.{name}",
            )
        if count_tokens is not None and name != CHAT_SHOWN_PARAM:  # shown, never fed to a model
            tokens = count_tokens(text)
            if tokens > limits.max_prompt_tokens:
                raise Rejected(
                    f"`{name}` must be at most {limits.max_prompt_tokens} tokens (the model's tokenizer, "
                    f"with start and end tokens), got {tokens}; shorten it",
                    reason=f"invalid_{name}",
                    param=f"params.{name}",
                )


def check_model_defaults(limits: Mapping[str, FamilyLimits], family: str, defaults: Mapping[str, Any]) -> None:
    """Refuse a model's own defaults (``models add --default``; matched to its kinds' params and
    their number ranges by :func:`app.core.kinds.check_defaults` first) that every job would be
    refused for: the submission's checks of sizes, steps, frames, ``n`` and the prompts' types and
    lengths (:func:`check_submission`, the family's ``limits``), before anything is registered (R22).

    Raises:
        Rejected: reason ``invalid_default``, ``param`` ``defaults.<name>``, the submission's
            message prefixed with ``default``.
    """
    try:
        check_submission(defaults, limits_for(limits, family), None, None, family)
    except Rejected as error:
        name = (error.param or "").removeprefix("params.") or error.reason.removeprefix("invalid_")
        raise Rejected(f"default {error.message}", reason="invalid_default", param=f"defaults.{name}") from error


def check_text_tokens(params: dict[str, Any], tokenizer: Any, limits: TokenLimits, asked: bool = True) -> int:
    """Refuse a text job whose prompt (tokenized as the worker will feed it, ``prompt_ids``:
    chat-templated prompts as they are) exceeds ``max_input_tokens``, or whose prompt tokens +
    ``max_new_tokens`` exceed ``max_total_tokens`` (TGI's router's checks). Returns
    the prompt's token count. Call after :func:`check_kind_params` (numbers are checked).

    ``asked`` false: the client sent no ``max_new_tokens``, so a default fills it, and a
    default never makes a refusal: ``params["max_new_tokens"]`` becomes the model's default
    (``models add --default``) or, for a chat, the rest of the context (``max_total_tokens`` -
    the prompt's tokens, as OpenAI's and TGI's chat routes), else the kind's 16, each at most
    the rest of the context.

    Raises:
        Rejected: reason ``context_length_exceeded``, param ``params.prompt`` (over
            ``max_input_tokens``, or no room left for one new token) or
            ``params.max_new_tokens`` (the sum over ``max_total_tokens``), naming the limit and
            the figures; ``invalid_prompt`` when the model has no tokenizer;
            ``invalid_params`` when ``chat`` is not a boolean.
    """
    text_spec = KINDS["text"]
    chat = text_spec.value(params, "chat")
    if not isinstance(chat, bool):
        raise Rejected(f"params.chat must be true or false, got {chat!r}", reason="invalid_params")
    if tokenizer is None:
        raise Rejected("the model has no tokenizer to count the prompt's tokens", reason="invalid_prompt")
    tokens = len(prompt_ids(tokenizer, str(params.get("prompt", "")), chat))
    room = limits.max_total_tokens - tokens
    if tokens > limits.max_input_tokens or (not asked and room < 1):
        limit = (
            f"at most {limits.max_input_tokens} tokens (max_input_tokens)"
            if tokens > limits.max_input_tokens
            else f"under {limits.max_total_tokens} tokens (max_total_tokens) to leave room for one new token"
        )
        raise Rejected(
            f"the prompt must be {limit}, got {tokens} tokens; shorten it",
            reason=CONTEXT_LENGTH_EXCEEDED,
            param="params.prompt",
        )
    if not asked:
        default = "max_new_tokens" in params or not chat  # a model's default, or the kind's for a plain prompt
        params["max_new_tokens"] = min(int(text_spec.value(params, "max_new_tokens")), room) if default else room
    new = int(text_spec.value(params, "max_new_tokens"))
    if tokens + new > limits.max_total_tokens:
        raise Rejected(
            f"prompt tokens + max_new_tokens must be at most {limits.max_total_tokens} (max_total_tokens), "
            f"got {tokens} + {new} = {tokens + new}; lower max_new_tokens to at most {max(0, room)}",
            reason=CONTEXT_LENGTH_EXCEEDED,
            param="params.max_new_tokens",
        )
    return tokens


def check_text_grammar(params: Mapping[str, Any], tokenizer: Any, config: Mapping[str, Any]) -> None:
    """Refuse a text job whose ``grammar`` (a JSON schema or a regex, app/core/constraints.py)
    is malformed or does not compile with llguidance for the model's tokenizer, before any
    device: the worker compiles the same grammar the same way.

    Raises:
        Rejected: reason ``invalid_grammar``, param ``params.grammar``, with llguidance's message.
    """
    grammar = params.get("grammar")
    if grammar is None:
        return
    vocab = config.get("vocab_size")
    try:
        constraints.check(
            grammar, tokenizer, constraints.vocab_size(tokenizer, vocab if isinstance(vocab, int) else None)
        )
    except ValueError as error:
        raise Rejected(f"params.grammar {error}"[:2000], reason="invalid_grammar", param="params.grammar") from error


def check_numbers(kind_spec: KindSpec, params: Mapping[str, Any]) -> None:
    """Refuse a number param of the kind that is not a finite number in its range
    (:meth:`app.core.specs.NumberRange.refusal`).

    Raises:
        Rejected: reason ``invalid_params``, naming the field, the value and the range.
    """
    for number in kind_spec.numbers:
        if number.name not in params:
            continue
        refusal = number.refusal(params[number.name])
        if refusal is not None:
            raise Rejected(f"params.{number.name} {refusal}", reason="invalid_params", param=f"params.{number.name}")


def check_strength(kind_spec: KindSpec, params: Mapping[str, Any]) -> None:
    """Refuse a ``strength`` that leaves no denoising step: the pipeline runs
    ``int(steps * strength)`` of ``steps`` (:func:`app.core.kinds.denoised_steps`) and cannot run
    none. Call after :func:`check_numbers` (the range is checked).

    Raises:
        Rejected: reason ``invalid_params``, param ``params.strength``, naming the smallest strength.
    """
    if "strength" not in kind_spec.params:
        return
    steps, strength = kind_spec.value(params, "steps"), kind_spec.value(params, "strength")
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1 or not isinstance(strength, int | float):
        return  # steps are refused elsewhere (check_submission)
    if denoised_steps(steps, float(strength)) < 1:
        raise Rejected(
            f"params.strength must leave at least one denoising step (the pipeline runs int(steps x "
            f"strength) = int({steps} x {strength:g}) = 0 steps); ask for strength >= {1 / steps:g} or "
            "more steps",
            reason="invalid_params",
            param="params.strength",
        )


def check_upload(size_bytes: int, media_type: str, limits: FamilyLimits, field: str = "image") -> None:
    """Refuse an uploaded input over ``max_upload_bytes`` or of a media type not allowed.

    Raises:
        Rejected: reason ``invalid_<field>``, naming size or type and the limit.
    """
    if size_bytes > limits.max_upload_bytes:
        raise Rejected(
            f"`{field}` must be at most {limits.max_upload_bytes} bytes (max_upload_bytes), got {size_bytes}",
            reason=f"invalid_{field}",
        )
    if media_type not in limits.upload_media_types:
        allowed = ", ".join(limits.upload_media_types)
        raise Rejected(
            f"`{field}` must be one of {allowed} (upload_media_types), got {media_type!r}", reason=f"invalid_{field}"
        )


def check_input_upload(field: str, stored: StoredFile, limits: FamilyLimits) -> None:
    """Refuse an uploaded input that a job names in ``params.<field>`` when its model family
    does not take it (R22): more than ``max_upload_bytes`` bytes, or a media type (sniffed at
    upload) not in ``upload_media_types``. ``POST /v1/files`` knows no model and checks only
    the global ``max_input_bytes``; the family's limits apply here, at submission.

    Raises:
        Rejected: reason ``invalid_<field>`` as ``POST /v1/images/edits`` refuses the same
            upload (:func:`check_upload`), param ``params.<field>``; the message names the
            param, the limit and the value.
    """
    try:
        check_upload(stored.size_bytes, stored.media_type, limits, field)
    except Rejected as error:
        raise Rejected(f"params.{field}: {error.message}", reason=error.reason, param=f"params.{field}") from error


def check_kind_params(
    kind: str, params: Mapping[str, Any], inputs: InputStore, limits: FamilyLimits | None = None, family: str = ""
) -> None:
    """Refuse params ``kind`` cannot run with on a model of ``family``, naming the field, the
    value and the limit. With ``limits`` (the model family's), each input file must also fit
    its upload limits (:func:`check_input_upload`).

    Raises:
        Rejected: a missing or unknown input file (reason ``invalid_params``/``unknown_file``),
            an input file over the family's ``max_upload_bytes`` or of a media type not in its
            ``upload_media_types`` (reason ``invalid_<field>``), a bad video format, a number
            out of its range, a seed that is not an integer from 0 to 2**63-1,
            a ``strength`` that leaves no denoising step (:func:`check_strength`), a second input
            (inpaint's ``mask``) whose size is not the first's (reason ``invalid_params``,
            param ``params.<field>``).
    """
    kind_spec = family_spec(family, kind)
    seed = params.get("seed")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed <= MAX_SEED):
        raise Rejected(
            f"params.seed must be an integer from 0 to {MAX_SEED}, got {shown(seed)}",
            reason="invalid_params",
            param="params.seed",
        )
    count = params.get(BATCH_PARAM)
    if isinstance(seed, int) and isinstance(count, int) and count > 1 and seed + count - 1 > MAX_SEED:
        raise Rejected(
            f"params.seed + params.n - 1 must be at most {MAX_SEED} (image i gets seed + i), got {seed} + {count} - 1",
            reason="invalid_params",
            param="params.seed",
        )
    check_numbers(kind_spec, params)
    check_strength(kind_spec, params)
    first: tuple[str, tuple[int, int]] | None = None  # the first input's field and size (pixels)
    for field in kind_spec.inputs:
        value = params.get(field)
        if not isinstance(value, str) or not value:
            raise Rejected(
                f"params.{field} is required for kind {kind!r}: the id of a file uploaded with "
                f"POST /v1/files, got {value!r}",
                reason="invalid_params",
                param=f"params.{field}",
            )
        try:
            stored = inputs.get(value)
        except (Rejected, NotFound) as error:  # a refusal of the submission, naming the field
            raise Rejected(f"params.{field}: {error.message}", reason=error.reason, param=f"params.{field}") from error
        if limits is not None:
            check_input_upload(field, stored, limits)
        if kind_spec.output_scale is not None:  # the output keeps the first input's size (tasks/kinds DrawnInput)
            width, height = image_size(stored.path)
            if first is None:
                first = (field, (width, height))
            elif (width, height) != first[1]:
                raise Rejected(
                    f"params.{field} must have the size of params.{first[0]} ({first[1][0]}x{first[1][1]} "
                    f"pixels), got {width}x{height}",
                    reason=f"invalid_{field}",
                    param=f"params.{field}",
                )
    if kind_spec.formats:
        fmt = kind_spec.value(params, "format")
        if fmt not in kind_spec.formats:
            raise Rejected(
                f"params.format must be one of {', '.join(kind_spec.formats)}, got {fmt!r}", reason="invalid_params"
            )


def check_family_params(family: str, kind: str, params: Mapping[str, Any]) -> None:
    """Refuse params a model of ``family`` cannot run with, naming the family's limit and where
    it comes from (``app/core/families.py``): ``width``/``height`` not multiples of its
    ``multiple_of`` (Flux, Qwen-Image, Wan: 16), a frame count its VAE cannot pack (Wan: 4k+1),
    a non-blank ``negative_prompt`` while its true-CFG scale is at most 1 (the pipeline would
    ignore it). Call after :func:`check_kind_params` (numbers are checked). A family this table
    does not know, or a kind it does not run, has no rules here.

    Raises:
        Rejected: reason ``invalid_<field>`` (``invalid_params`` for the negative prompt).
    """
    rules = family_rules(family)
    if rules is None or kind not in rules.kinds:
        return
    kind_spec = family_spec(family, kind)
    owner = f"family {family} ({rules.pipeline_class_of(kind)}"
    for name in ("width", "height"):
        side = params.get(name)
        if isinstance(side, int) and side % rules.multiple_of:
            raise Rejected(
                f"`{name}` must be a multiple of {rules.multiple_of} pixels for {owner}: {rules.size_why}), got {side}",
                reason=f"invalid_{name}",
            )
    frames = kind_spec.value(params, "frames") if rules.frames is not None else None
    if rules.frames is not None and isinstance(frames, int) and frames % rules.frames.step != rules.frames.offset:
        step, offset = rules.frames.step, rules.frames.offset
        examples = ", ".join(str(step * k + offset) for k in range(4))
        lower = frames - (frames - offset) % step
        raise Rejected(
            f"`frames` must be {step}k+{offset} ({examples}, ...) for {owner}: {rules.frames.why}), got "
            f"{frames}; ask for {max(lower, offset)} or {lower + step}",
            reason="invalid_frames",
        )
    negative = params.get("negative_prompt")
    if rules.cfg_param is not None and isinstance(negative, str) and negative.strip():
        scale = kind_spec.value(params, rules.cfg_param)
        if isinstance(scale, int | float) and scale <= 1:
            raise Rejected(
                f"params.negative_prompt is used only with params.{rules.cfg_param} above 1 for {owner}: "
                f"true classifier-free guidance), got {rules.cfg_param}={scale}; raise it or drop the "
                "negative prompt",
                reason="invalid_params",
                param="params.negative_prompt",
            )


def output_size(kind: str, params: Mapping[str, Any], inputs: InputStore) -> dict[str, int]:
    """``{"output_width": W, "output_height": H}`` in pixels for kinds whose output size follows
    their input image (the kind's ``output_scale`` times the input's sides), else ``{}``.
    Placement prices a job's run time and memory by its output pixels. Call after
    :func:`check_kind_params` (the input must exist)."""
    kind_spec = spec(kind)
    if kind_spec.output_scale is None:
        return {}
    width, height = image_size(inputs.get(str(params[kind_spec.inputs[0]])).path)
    return dict(zip(OUTPUT_SIZE_FIELDS, (width * kind_spec.output_scale, height * kind_spec.output_scale), strict=True))


def check_webhook(url: str, allow_hosts: Sequence[str], api_key_id: str | None, secrets: Mapping[str, str]) -> None:
    """A job's ``webhook_url``: an absolute ``http``/``https`` URL without credentials
    whose host is one of the fleet file's ``[webhooks] allow_hosts`` (exact, case-insensitive),
    submitted with an API key that has a webhook secret (``webhook_secrets``), since every
    webhook is signed.

    Raises:
        Rejected: reason ``invalid_webhook_url``, param ``webhook_url``; the message names the
            field, the host and the allow-list, or the key without a secret.
    """

    def refuse(message: str) -> Rejected:
        return Rejected(f"webhook_url: {message}", reason="invalid_webhook_url", param="webhook_url")

    if not url.isprintable() or any(c.isspace() for c in url):
        raise refuse(f"must not contain white space or control characters, got {url!r}")
    import httpx  # here, not at the top: every CLI command imports this module, few parse a URL

    try:  # parsed as httpx, which sends it, parses it: the host checked is the host reached
        parts = httpx.URL(url)
        scheme, host, port, userinfo = parts.scheme, parts.host.lower(), parts.port, parts.userinfo
    except (httpx.InvalidURL, ValueError) as error:  # (an IDNA error is a ValueError)
        raise refuse(f"{url!r} is not a valid URL ({error})") from error
    if scheme not in ("http", "https") or not host:
        raise refuse(f"must be an absolute http:// or https:// URL, got {url!r}")
    if port is not None and not 1 <= port <= 65535:
        raise refuse(f"{url!r} has an invalid port ({port}; 1-65535)")
    if userinfo:
        raise refuse("must not carry credentials (user:password@); the webhook is signed instead")
    if host not in allow_hosts:
        raise refuse(
            f"host {host!r} is not in the fleet's webhook allow-list {sorted(allow_hosts)} "
            "(the fleet file's [webhooks] allow_hosts)"
        )
    if api_key_id is None:
        raise refuse(
            "this server's API is open (no API keys), and a webhook is signed with the secret of "
            "the API key that submits the job; configure api_keys and webhook_secrets"
        )
    if api_key_id not in secrets:
        raise refuse(
            f"the API key (id {api_key_id}) that submitted it has no webhook secret, and every webhook is "
            "signed; the operator sets webhook_secrets (HOMEFLEET_WEBHOOK_SECRETS) for it"
        )


def check_output_pixels(width: int, height: int, limits: FamilyLimits, field: str = "image") -> None:
    """Refuse a job whose output (from its input image: an edit keeps the size, the x4 upscaler
    multiplies each side by 4) exceeds ``max_pixels``.

    Raises:
        Rejected: reason ``invalid_size``, naming the field, the output size and the limit.
    """
    if width * height > limits.max_pixels:
        raise Rejected(
            f"params.{field}: the output would be {width} x {height} = {width * height} pixels; the limit "
            f"(max_pixels) is {limits.max_pixels}; send a smaller image",
            reason="invalid_size",
        )


def image_size(path: Path) -> tuple[int, int]:
    """(width, height) in pixels as viewers show the image (its EXIF orientation applied,
    :func:`app.store.media.upright_size`, as the worker turns it before drawing), read from the
    image header only.

    Raises:
        Rejected: the stored file is not a readable image (reason ``input_corrupt``; uploads are
            decoded completely since they are checked, app/store/media.py).
    """
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as image:
            return upright_size(image)
    except (OSError, UnidentifiedImageError, Image.DecompressionBombError) as error:
        raise Rejected(
            f"params.image: the uploaded file is not a readable image ({error}); upload it again",
            reason="input_corrupt",
        ) from error


def model_max_frames(folder: Path) -> int | None:
    """The most frames a video model's motion modules take: ``motion_max_seq_length`` in its
    ``motion_adapter`` (else ``unet``) config.json (AnimateDiff: 32; :func:`config_value`), or
    None when its config names no such limit (or cannot be read: the worker's file check, R5,
    reports that)."""
    for component in ("motion_adapter", "unet"):
        limit = config_value(folder / component / "config.json", "motion_max_seq_length")
        if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0:
            return limit
    return None


class PromptTokenizers:
    """Each model's own tokenizer (``<model folder>/tokenizer``; a text model's: its folder), loaded lazily with
    transformers and cached per model. A model without one counts no tokens (None)."""

    def __init__(self, folder_of: Callable[[str], Path]) -> None:
        self.folder_of = folder_of
        self._cache: dict[str, Any] = {}
        self._ends: dict[str, list[int]] = {}
        self._lock = threading.Lock()

    def tokenizer(self, model_id: str) -> Any:
        """The model's tokenizer (cached), or None when it has none."""
        with self._lock:
            if model_id not in self._cache:
                self._cache[model_id] = self._load(model_id)
            return self._cache[model_id]

    def decoder(self, model_id: str, stops: Sequence[str] = (), hold: bool = True) -> TokenDecoder | None:
        """A :class:`TokenDecoder` of the model's tokenizer and end ids (its folder's
        ``generation_config.json``, :func:`folder_end_token_ids`), or None when it has no tokenizer.

        Raises:
            Conflict: as :meth:`tokenizer`.
        """
        tokenizer = self.tokenizer(model_id)
        if tokenizer is None:
            return None
        with self._lock:
            if model_id not in self._ends:
                folder = self.folder_of(model_id)
                try:
                    self._ends[model_id] = folder_end_token_ids(folder, tokenizer) if is_text_folder(folder) else []
                except (OSError, ValueError) as error:  # an unreadable generation_config.json: the EOS alone
                    log.warning("model %s: generation_config.json unreadable (%s); its EOS alone ends", model_id, error)
                    self._ends[model_id] = end_token_ids(tokenizer)
            ends = self._ends[model_id]
        return TokenDecoder(tokenizer, stops, hold=hold, ends=ends)

    def has_chat_template(self, model_id: str) -> bool:
        """Whether the model's tokenizer has a chat template (it takes chat messages). A tokenizer
        that cannot be loaded counts as none (a chat through it could not be templated)."""
        try:
            tokenizer = self.tokenizer(model_id)
        except Conflict:
            return False
        return bool(getattr(tokenizer, "chat_template", None))

    def counter(self, model_id: str) -> Callable[[str], int] | None:
        """``text -> number of tokens`` (with start/end tokens, untruncated), or None."""
        tokenizer = self.tokenizer(model_id)
        if tokenizer is None:
            return None
        return lambda text: len(tokenizer(text, truncation=False)["input_ids"])

    def _load(self, model_id: str) -> Any:
        """Raises Conflict (409, reason ``tokenizer_unloadable``) when the model's tokenizer files
        cannot be loaded (registration refuses such a folder; one registered before that check
        did not): every job of it would fail, so none is queued."""
        folder = self.folder_of(model_id)
        text = is_text_folder(folder)  # a transformers folder: its tokenizer lies beside config.json
        if not text and not (folder / "tokenizer").is_dir():
            return None
        try:
            return load_tokenizer(folder if text else folder / "tokenizer")
        except (OSError, ValueError, TypeError, KeyError, AttributeError, ImportError) as error:
            raise Conflict(
                f"model {model_id!r}: its tokenizer cannot be loaded ({type(error).__name__}: {error}); "
                "register the model again from a folder holding its tokenizer files",
                reason="tokenizer_unloadable",
            ) from error
