"""LoRA adapters for one job (docs/api.md, "LoRA adapters"; R5): loaded onto the warm pipeline before the run, unloaded
after it, so the resident pipeline is the base model again and is never reloaded for them.

An adapter is a registry entry of kind ``adapter`` (``app/store/registry.py``): its files come
with the claim's :class:`~app.core.protocol.AdapterClaim` manifest and are hashed against it
before every load (R5, as a model's cold load; a mismatch withdraws the adapter, R4). Loading
uses diffusers' PEFT integration: ``load_lora_weights(folder, adapter_name=...)`` per adapter
(a kohya-layout file is converted by diffusers as it loads: ``lora_state_dict``), then
``set_adapters(names, adapter_weights=scales)``; afterwards ``unload_lora_weights()`` restores
the base modules. A pipeline whose adapters cannot be unloaded is dropped from the
model cache (the next job loads the base model cold), never reused with a stray adapter.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from app.core.errors import Rejected
from app.core.lora_files import weight_file
from app.core.protocol import AdapterClaim, Manifest
from tasks import runtime
from tasks.loading import check_files

log = logging.getLogger("homefleet.worker")


@dataclass
class Applied:
    """Adapters loaded for a job: ``load_s`` seconds their loading and ``set_adapters`` took
    (0 without adapters); ``record``: what the journaled provenance adds."""

    load_s: float = 0.0
    record: dict[str, Any] = field(default_factory=dict)


def weight_name(manifest: Manifest) -> str:
    """The safetensors file of an adapter to load (:func:`app.core.lora_files.weight_file`):
    ``pytorch_lora_weights.safetensors`` when it has one (a registered single LoRA file is
    stored so), else its first ``*.safetensors`` file (a registered adapter has at least one).

    Raises:
        ValueError: the manifest lists no top-level ``*.safetensors`` file."""
    name = weight_file(f.path for f in manifest.files)
    if name is None:
        raise ValueError(f"adapter {manifest.model_id} has no .safetensors file in its manifest")
    return name


def provenance_entries(adapters: Sequence[AdapterClaim]) -> list[dict[str, Any]]:
    """The embedded provenance of ``adapters``: each one's id, scale and files' digests, in order."""
    return [
        {"id": a.manifest.model_id, "scale": a.scale, "files": {f.path: f.digest for f in a.manifest.files}}
        for a in adapters
    ]


@contextmanager
def adapters_applied(
    rt: runtime.WorkerRuntime, model_id: str, pipeline: Any, adapters: Sequence[AdapterClaim]
) -> Iterator[Applied]:
    """``adapters`` loaded onto ``pipeline`` (the resident pipeline of ``model_id``) for the
    body, unloaded after it; nothing happens without adapters.

    Raises:
        IntegrityFailure: an adapter's files do not match its manifest (it is withdrawn; nothing is loaded).
        Rejected: the pipeline takes no LoRA (reason ``adapter_not_supported``).
        OSError, ValueError: diffusers could not load an adapter (the adapters loaded so far are unloaded).
    """
    if not adapters:
        yield Applied()
        return
    for adapter in adapters:
        check_files(rt, adapter.manifest)  # R5: hashed before every load
    if not hasattr(pipeline, "load_lora_weights"):
        raise Rejected(f"{type(pipeline).__name__} takes no LoRA adapters", reason="adapter_not_supported")
    names = [f"adapter{i}" for i in range(len(adapters))]  # peft module keys: no '.' or '-' of an id
    started = time.perf_counter()
    try:
        for name, adapter in zip(names, adapters, strict=True):
            folder = rt.settings.models_dir / adapter.manifest.model_id
            pipeline.load_lora_weights(
                str(folder), weight_name=weight_name(adapter.manifest), adapter_name=name, local_files_only=True
            )
        pipeline.set_adapters(names, adapter_weights=[a.scale for a in adapters])
        load_s = time.perf_counter() - started
        log.info("%s: adapters %s loaded in %.3f s", model_id, ", ".join(a.manifest.model_id for a in adapters), load_s)
        yield Applied(load_s, {"adapter_load_s": round(load_s, 6)})
    finally:
        _unload(rt, model_id, pipeline)


def _unload(rt: runtime.WorkerRuntime, model_id: str, pipeline: Any) -> None:
    """Unload every adapter from ``pipeline``; if that fails, drop ``model_id`` from the cache."""
    try:
        pipeline.unload_lora_weights()
    except Exception as error:  # the pipeline may hold a stray adapter: never reuse it
        log.exception(
            "%s: adapters not unloaded (%s); the model is dropped from memory", model_id, type(error).__name__
        )
        rt.cache.drop(model_id)
        rt.record_warm()
