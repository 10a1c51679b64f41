"""The worker's model cache: loaded pipelines kept warm between jobs.

This first version keeps at most one pipeline resident (the dedicated-memory policy of
R15); the unified-memory policy with a protected set comes with the residency work.
A resident pipeline is keyed by its model id AND its manifest digest, so a changed file
on the server forces a verified reload (R5).
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass
class Resident:
    model_id: str
    manifest_key: str  # digest of the manifest the files were verified against
    pipeline: Any


class ModelCache:
    """Loads pipelines with ``loader(folder)`` and keeps the last one warm."""

    def __init__(self, loader: Callable[..., Any], release: Callable[[], None] = lambda: None) -> None:
        self.loader = loader
        self.release = release  # empties the device's allocator cache after an unload
        self.resident: Resident | None = None
        self.loads = 0  # cold loads since start

    def is_warm(self, model_id: str, manifest_key: str) -> bool:
        return self.resident is not None and (self.resident.model_id, self.resident.manifest_key) == (model_id, manifest_key)

    def get(self, model_id: str, manifest_key: str, folder: Path,
            load_kwargs: dict[str, Any] | None = None) -> tuple[Any, float, bool]:
        """The pipeline for ``model_id``: (pipeline, load seconds, cold). Drops the previous
        one first (every reference, gc, allocator cache) when another model is needed.
        ``load_kwargs`` go to the loader (e.g. the variant's precision); they must be part of
        ``manifest_key`` so that another variant is never taken for the resident one."""
        if self.resident is not None and self.is_warm(model_id, manifest_key):
            return self.resident.pipeline, 0.0, False
        self.unload()
        started = time.perf_counter()
        pipeline = self.loader(folder, **(load_kwargs or {}))
        load_s = time.perf_counter() - started
        self.resident = Resident(model_id, manifest_key, pipeline)
        self.loads += 1
        return pipeline, load_s, True

    def unload(self) -> None:
        if self.resident is None:
            return
        self.resident = None
        gc.collect()
        self.release()
