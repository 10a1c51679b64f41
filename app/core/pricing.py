"""The bytes a model's loaded variant holds (R10, R15): priced once at registration from the
stored folder's configs, never by loading its weights.

How: every component that is a torch module (a diffusers model or a transformers model named
in ``model_index.json``; a causal LM's root folder) is built from its config on the **meta**
device, with the torch default dtype set to the variant's precision as diffusers' and
transformers' ``from_pretrained`` set it. Then each of its tensors (parameters and buffers,
tied ones once) is priced at the dtype the library's loader gives it:

- diffusers: a floating tensor of the checkpoint at the precision, or fp32 where the model's
  ``_keep_in_fp32_modules`` names one of its modules (any precision; e.g. Wan's
  ``time_embedder``, ``norm*``, ``scale_shift_table``); any other tensor as built.
- transformers: the tensor as built (so an explicitly fp32 buffer such as a rotary
  ``inv_freq`` stays fp32), or fp32 where the model's own dtype plan
  (``_get_dtype_plan``: ``_keep_in_fp32_modules`` at fp16, ``_keep_in_fp32_modules_strict``
  at fp16 and bf16; e.g. T5's ``wo`` at fp16) matches it.
- a quantized component (the denoiser, :data:`app.core.variants.DENOISERS`, or a causal LM):
  the library's own torchao quantizer decides which weights it quantizes
  (``check_if_quantized_param`` / ``param_needs_quantization``: ``nn.Linear`` weights outside
  its ``modules_to_not_convert`` and keep-in-fp32 modules), and each is quantized on the meta
  device by torchao itself: its bytes are the inner tensors' (int8 ``qdata`` + fp32 per-row
  ``scale`` for int8 weight-only).

Components that are no torch module (schedulers, tokenizers, processors) hold no tensors. A
LoRA adapter folder (no ``model_index.json``, no ``config.json``) is priced at its header's
element count times the precision's bytes. The worker's residency (``tasks/loading.py``) and
the server's placement use the figure stored at registration (``ModelRecord.weights_bytes``),
carried to workers in the manifest.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from app.core.variants import DENOISERS, PRECISION_BYTES, TORCH_DTYPES, Variant, quantization_spec

COMPONENT_LIBRARIES = ("diffusers", "transformers")
"""The packages a pipeline's components may come from (besides ``diffusers.pipelines``' modules)."""


def loaded_bytes(folder: Path, variant: Variant) -> int:
    """Bytes the pipeline (or causal LM) in ``folder`` holds once loaded as ``variant``: the sum
    of :func:`component_bytes`. Reads configs and safetensors headers only.

    Raises:
        OSError: a config or weights file cannot be read.
        ValueError: a component's class is unknown to its library, or the folder is neither a
            diffusers folder, a transformers folder nor a LoRA adapter.
    """
    return sum(component_bytes(folder, variant).values())


def component_bytes(folder: Path, variant: Variant) -> dict[str, int]:
    """Bytes per component (``""`` for a causal LM or an adapter folder) held once ``folder``
    is loaded as ``variant`` (module docstring). Raises as :func:`loaded_bytes`."""
    folder = Path(folder)
    if (folder / "model_index.json").is_file():
        index = json.loads((folder / "model_index.json").read_text())
        found: dict[str, int] = {}
        for name, entry in sorted(index.items()):
            if name.startswith("_") or not isinstance(entry, list) or len(entry) != 2 or None in entry:
                continue
            library, class_name = entry
            quantization = variant.quantization if name in DENOISERS else None
            held = _module_bytes(folder / name, library, class_name, variant.precision, quantization)
            if held is not None:
                found[name] = held
        return found
    if (folder / "config.json").is_file():
        return {"": _module_bytes(folder, "transformers", None, variant.precision, variant.quantization) or 0}
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(
            f"{folder} is neither a diffusers folder (model_index.json), a transformers folder "
            "(config.json) nor a LoRA adapter (*.safetensors)"
        )
    from safetensors import safe_open

    elements = 0
    for path in files:
        with safe_open(str(path), framework="pt") as handle:  # the header only
            elements += sum(math.prod(handle.get_slice(name).get_shape()) for name in handle.keys())  # noqa: SIM118
    return {"": int(elements * PRECISION_BYTES[variant.precision])}


def _module_bytes(
    folder: Path, library: str, class_name: str | None, precision: str, quantization: str | None
) -> int | None:
    """Bytes of one component, or None when its class is no torch module. A class that is a
    transformers model (``PreTrainedModel``) is priced as transformers loads it, one that is a
    diffusers model (``ModelMixin``) as diffusers does, whichever module names it (Stable
    Diffusion 1.5's ``safety_checker`` is ``["stable_diffusion", "StableDiffusionSafetyChecker"]``,
    a transformers model in a diffusers pipeline module)."""
    import torch

    if class_name is None:  # a causal LM: the class transformers' Auto class picks, as tasks/pipelines.py loads it
        dtype = getattr(torch, TORCH_DTYPES[precision])
        return _transformers_bytes(folder, None, dtype, quantization)
    cls = component_class(library, class_name, folder)
    if not (isinstance(cls, type) and issubclass(cls, torch.nn.Module)):
        return None
    from diffusers import ModelMixin
    from transformers import PreTrainedModel

    dtype = getattr(torch, TORCH_DTYPES[precision])
    if issubclass(cls, PreTrainedModel):
        return _transformers_bytes(folder, cls, dtype, quantization)
    if issubclass(cls, ModelMixin):
        return _diffusers_bytes(folder, cls, dtype, quantization)
    raise ValueError(
        f"{folder.name}: {library}.{class_name} is a torch module but neither a diffusers nor a "
        "transformers model, so it cannot be priced"
    )


def component_class(library: str, class_name: str, folder: Path | None = None) -> Any:
    """The class a ``model_index.json`` names for a component (``folder``) as ``[library, class_name]``,
    found as ``DiffusionPipeline.from_pretrained`` finds it: ``library`` is a module of
    ``diffusers.pipelines`` (``"stable_diffusion"``) when one has that name, else an importable
    package of :data:`COMPONENT_LIBRARIES`; no other package is imported. A component that
    ships its own code (``folder/<library>.py``) is not run.

    Raises:
        ValueError: naming the component, the library and the class, when none is found.
    """
    from diffusers import pipelines

    where = folder.name if folder is not None else library
    if folder is not None and (folder / f"{library}.py").is_file():
        raise ValueError(
            f"{folder.name}: model_index.json names {library}.{class_name}, code the model folder ships "
            f"({folder.name}/{library}.py); Homefleet does not run a model's own code"
        )
    if library in COMPONENT_LIBRARIES:
        module = importlib.import_module(library)
    elif library.isidentifier() and hasattr(pipelines, library):
        module = getattr(pipelines, library)
    else:  # any other name would import whatever package of that name is installed
        raise ValueError(
            f"{where}: model_index.json names library {library!r} ({class_name}); a component comes from "
            f"{' or '.join(COMPONENT_LIBRARIES)} or a diffusers pipeline module (such as 'stable_diffusion')"
        )
    cls = getattr(module, class_name, None)
    if cls is None:
        raise ValueError(f"{where}: {library} has no class {class_name!r} (model_index.json)")
    return cls


@contextlib.contextmanager
def _skeleton_context(dtype: Any) -> Iterator[None]:
    """Build on the meta device with ``dtype`` as the default dtype, as the loaders do."""
    import torch

    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            yield
    finally:
        torch.set_default_dtype(previous)


class MissingTensors(ValueError):
    """A component's safetensors weights lack parameters its config builds (R1): the loader
    would leave them unloaded (diffusers: a job fails on a meta tensor) or initialise them at
    random (transformers: the model runs and answers garbage)."""


def _stored_headers(folder: Path) -> list[tuple[Path, dict[str, Any]]]:
    """The safetensors headers of ``folder``'s own weights files (tensor name -> entry), in
    file order; a file whose header cannot be read is left out (it is refused where weights are
    read, reason ``model_unreadable``)."""
    from app.core.errors import IntegrityFailure
    from app.core.safetensors import safetensors_header

    headers = []
    for path in sorted(folder.glob("*.safetensors")):
        try:
            headers.append((path, safetensors_header(path)))
        except IntegrityFailure:
            continue
    return headers


def check_fit(folder: Path, model: Any, loaded_name: Any) -> None:
    """Check that the safetensors weights in ``folder`` (its own files, headers only) describe
    ``model`` (built from ``folder``'s config on the meta device): every tensor both have has
    the same shape, and every parameter of the model is stored. A config that does not
    describe the weights (emptied, or another model size's) is built with other shapes, priced
    wrongly and fails every load; a weights file missing a tensor fails every diffusers job or
    gives a transformers model a layer of random weights.

    ``loaded_name`` maps the stored tensor names to the names the library's loader gives them
    (old checkpoint formats are renamed on load): ``loaded_name(names) -> set[str]``. A
    parameter counts as stored when it, or a parameter tied to it (one tensor under several
    names), has a loaded name. A folder with no safetensors header (``.bin`` weights only), or
    none of whose loaded names the model builds (a format the loader does not know), is not
    checked for completeness: the loader reports it.

    Raises:
        ValueError: naming the component, the file, the first tensor that differs and both
            shapes.
        MissingTensors: naming the component, how many parameters it lacks and the first few.
    """
    headers = _stored_headers(folder)
    shapes = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}
    for path, header in headers:
        for name, entry in sorted(header.items()):
            found = tuple(entry.get("shape") or ())
            expected = shapes.get(name)
            if expected is not None and expected != found:
                raise ValueError(
                    f"{folder.name}/{path.name} holds {name} of shape {list(found)}, but "
                    f"{folder.name}'s config builds it as {list(expected)}: the config does not describe "
                    "these weights (emptied, edited, or another model size's)"
                )
    stored = {name for _, header in headers for name in header if name != "__metadata__"}
    loaded = loaded_name(stored) if stored else set()
    if not loaded & set(shapes):
        return
    names_of: dict[int, list[str]] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(parameter), []).append(name)
    missing = sorted(names[0] for names in names_of.values() if not loaded.intersection(names))
    if missing:
        files, several = _files_meant_to_hold(folder, missing, [path for path, _ in headers])
        raise MissingTensors(
            f"{files} lack{'' if several else 's'} {len(missing)} of the "
            f"{len(names_of)} weights {folder.name}'s config builds ({', '.join(missing[:3])}"
            f"{', ...' if len(missing) > 3 else ''}): the file is incomplete or of another model; "
            "download it again"
        )


def _files_meant_to_hold(folder: Path, names: list[str], files: list[Path]) -> tuple[str, bool]:
    """The weights files of ``folder`` that should hold ``names``, as a refusal names them, and
    whether they are several: the shards a shard index (``*.index*.json``, its ``weight_map``)
    assigns them to (three at most), else the one file, else how many files there are with the
    first and the last."""
    weight_map: dict[str, str] = {}
    for index in sorted(folder.glob("*.index*.json")):
        try:
            found = json.loads(index.read_text()).get("weight_map")
        except (OSError, ValueError, AttributeError):  # a damaged index is refused where it is read
            continue
        if isinstance(found, dict):
            weight_map.update({k: v for k, v in found.items() if isinstance(v, str)})
    shards = sorted({weight_map[name] for name in names if name in weight_map})
    if shards and all(name in weight_map for name in names):
        shown = ", ".join(f"{folder.name}/{shard}" for shard in shards[:3])
        return shown + (f" and {len(shards) - 3} more shards" if len(shards) > 3 else ""), len(shards) > 1
    if len(files) == 1:
        return f"{folder.name}/{files[0].name}", False
    return f"the {len(files)} weights files {folder.name}/{files[0].name} ... {files[-1].name}", True


def _diffusers_loaded_names(model: Any) -> Any:
    """Stored tensor names -> the names diffusers' loader gives them (old attention blocks'
    ``query``/``key``/``value``/``proj_attn`` renamed, ``ModelMixin._fix_state_dict_keys_on_load``)."""

    def loaded_name(stored: set[str]) -> set[str]:
        names: dict[str, Any] = dict.fromkeys(sorted(stored))
        model._fix_state_dict_keys_on_load(names)
        return set(names)

    return loaded_name


def _transformers_loaded_names(model: Any) -> Any:
    """Stored tensor names -> the names transformers' loader gives them: its weight conversions
    for the model (``get_model_conversion_mapping``: renamings, merged experts, the base model's
    prefix added or dropped, ``core_model_loading.rename_source_key``), and names the model
    declares it may lack (``_keys_to_ignore_on_load_missing``) taken as stored."""
    import re

    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    mapping = get_model_conversion_mapping(model)
    renamings = [entry for entry in mapping if isinstance(entry, WeightRenaming)]
    converters = [entry for entry in mapping if isinstance(entry, WeightConverter)]
    built = model.state_dict()
    prefix = model.base_model_prefix
    optional = [re.compile(pattern) for pattern in (model._keys_to_ignore_on_load_missing or ())]

    def loaded_name(stored: set[str]) -> set[str]:
        names = set()
        for name in sorted(stored):
            renamed, _ = rename_source_key(name, renamings, converters, prefix, built)
            if renamed not in built and name in built:  # as the loader: only the prefix, then
                renamed, _ = rename_source_key(name, [], [], base_model_prefix=prefix, meta_state_dict=built)
            names.add(renamed)
        return names | {name for name in built if any(pattern.search(name) for pattern in optional)}

    return loaded_name


def _diffusers_bytes(folder: Path, cls: Any, dtype: Any, quantization: str | None) -> int:
    import torch

    config = cls.load_config(folder)
    with _skeleton_context(dtype):
        model = cls.from_config(config)
    check_fit(folder, model, _diffusers_loaded_names(model))
    keep = list(cls._keep_in_fp32_modules or [])  # torchao's quantizer keeps them (use_keep_in_fp32_modules)
    quantizer = None
    if quantization is not None:
        from diffusers import TorchAoConfig
        from diffusers.quantizers import DiffusersAutoQuantizer

        quantizer = DiffusersAutoQuantizer.from_config(
            TorchAoConfig(_torchao_config(quantization)), pre_quantized=False
        )
        quantizer.preprocess_model(model, device_map=None, keep_in_fp32_modules=list(keep))
    persistent = set(model.state_dict())

    def held(name: str, tensor: Any) -> int:
        if name not in persistent or not torch.is_floating_point(tensor):
            return _bytes(tensor)  # a buffer computed at init, or an integer tensor: as built
        if any(part in name.split(".") for part in keep):
            return int(tensor.numel() * 4)  # fp32
        if quantizer is not None and quantizer.check_if_quantized_param(model, tensor, name, {}, param_device=None):
            return _quantized_bytes(tuple(tensor.shape), dtype, quantization)
        return int(tensor.numel() * dtype.itemsize)

    return _sum(model, held)


def _transformers_bytes(folder: Path, cls: Any, dtype: Any, quantization: str | None) -> int:
    import transformers
    from transformers.core_model_loading import build_glob_alternation

    config = transformers.AutoConfig.from_pretrained(folder, local_files_only=True)
    with _skeleton_context(dtype):
        if cls is None:
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
        else:
            model = cls._from_config(config, dtype=dtype)
    check_fit(folder, model, _transformers_loaded_names(model))
    plan = model._get_dtype_plan(dtype)
    fp32 = build_glob_alternation(list(plan))[0] if plan else None
    quantizer = None
    if quantization is not None:
        from transformers import TorchAoConfig
        from transformers.quantizers import AutoHfQuantizer

        quantizer = AutoHfQuantizer.from_config(
            TorchAoConfig(quant_type=_torchao_config(quantization)), pre_quantized=False
        )
        quantizer.preprocess_model(model, dtype=dtype)

    def held(name: str, tensor: Any) -> int:
        if quantizer is not None and quantizer.param_needs_quantization(model, name):
            return _quantized_bytes(tuple(tensor.shape), dtype, quantization)
        if fp32 is not None and fp32.search(name):
            return int(tensor.numel() * 4)
        return _bytes(tensor)  # as built (the loader keeps a tensor built in another dtype, e.g. inv_freq)

    return _sum(model, held)


def _torchao_config(quantization: str) -> Any:
    import torchao.quantization

    backend, config_class = quantization_spec(quantization)
    if backend != "torchao":
        raise ValueError(f"quantization backend {backend!r} is not priced; priced: torchao")
    return getattr(torchao.quantization, config_class)()


_QUANTIZED: dict[tuple[tuple[int, ...], str, str], int] = {}


def _quantized_bytes(shape: tuple[int, ...], dtype: Any, quantization: str | None) -> int:
    """Bytes of a linear weight of ``shape`` quantized by torchao (its inner tensors), found
    by quantizing a meta ``nn.Linear`` of that shape."""
    import torch
    from torchao.quantization import quantize_

    assert quantization is not None
    key = (shape, str(dtype), quantization)
    if key not in _QUANTIZED:
        out_features, in_features = shape
        linear = torch.nn.Linear(in_features, out_features, bias=False, device="meta", dtype=dtype)
        quantize_(linear, _torchao_config(quantization))
        _QUANTIZED[key] = _bytes(linear.weight)
    return _QUANTIZED[key]


def _bytes(tensor: Any) -> int:
    """Bytes a tensor holds: a tensor subclass (torchao's ``Int8Tensor``) its inner tensors'."""
    import torch

    if type(tensor) not in (torch.Tensor, torch.nn.Parameter) and hasattr(tensor, "__tensor_flatten__"):
        names, _ = tensor.__tensor_flatten__()
        return sum(_bytes(inner) for name in names if (inner := getattr(tensor, name, None)) is not None)
    return int(tensor.numel() * tensor.element_size())


def _sum(model: Any, held: Any) -> int:
    """Sum of ``held(name, tensor)`` over the model's parameters and buffers, each tensor once."""
    seen: set[int] = set()
    total = 0
    for name, tensor in (*model.named_parameters(), *model.named_buffers()):
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        total += held(name, tensor)
    return total
