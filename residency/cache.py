"""The worker's model cache: loaded pipelines kept warm between jobs, under the residency
policy of the device's memory kind (R15; policies in :mod:`residency.policy`).

A resident pipeline is keyed by its model id AND its manifest digest (with the variant), so a
changed file on the server forces a verified reload (R5); a resident copy of the same model
under another key is always dropped first.

Memory: a warm model holds ``bytes`` (its weights at its variant, from the safetensors headers:
:mod:`app.core.variants`). Free memory is ``capacity_bytes - held`` when a capacity is configured
(``HOMEFLEET_MEMORY_CAP_BYTES``), else the device's ``available_bytes()``, which already
excludes what the warm models hold.
"""

from __future__ import annotations

import gc
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from residency.device import Device
from residency.errors import ResidencyRefused
from residency.policy import ResidencyPolicy, WarmModel, plan_load, policy_for

log = logging.getLogger("homefleet.residency")


@dataclass
class Resident:
    model_id: str
    manifest_key: str  # digest of the manifest the files were verified against
    pipeline: Any
    bytes: int = 0  # weights held (bytes)


class ModelCache:
    """Loads pipelines with ``loader(folder, **load_kwargs)`` and keeps them warm by policy.

    Args:
        loader: builds a pipeline from a model folder.
        device: the device adapter (``tasks/devices.py``); its ``empty_cache`` runs after every unload.
        policy: default: the policy of ``device.memory_kind``.
        capacity_bytes: a configured memory cap (bytes) instead of the device's free memory.
    """

    def __init__(
        self,
        loader: Callable[..., Any],
        device: Device,
        policy: ResidencyPolicy | None = None,
        capacity_bytes: int | None = None,
    ) -> None:
        self.loader = loader
        self.device = device
        self.policy = policy or policy_for(self.device.memory_kind)
        self.capacity_bytes = capacity_bytes
        self.protected: frozenset[str] = frozenset()  # the machine's residency commitments (R16)
        self.residents: OrderedDict[str, Resident] = OrderedDict()  # least recently used first
        self.loads = 0  # cold loads since start
        self.evictions = 0

    @property
    def resident(self) -> Resident | None:
        """The most recently used resident (None when nothing is warm)."""
        return next(reversed(self.residents.values()), None)

    def warm_models(self) -> list[str]:
        """Model ids resident, least recently used first."""
        return [r.model_id for r in self.residents.values()]

    def is_warm(self, model_id: str, manifest_key: str) -> bool:
        return self._key(model_id, manifest_key) in self.residents

    def held_bytes(self) -> int:
        return sum(r.bytes for r in self.residents.values())

    def free_bytes(self) -> int:
        if self.capacity_bytes is not None:
            return self.capacity_bytes - self.held_bytes()
        return self.device.available_bytes()

    def get(
        self,
        model_id: str,
        manifest_key: str,
        folder: Path,
        load_kwargs: dict[str, Any] | None = None,
        weights_bytes: int = 0,
        working_bytes: int = 0,
    ) -> tuple[Any, float, bool]:
        """The pipeline for ``model_id``: (pipeline, load seconds, cold).

        A warm hit is reused and becomes most recently used. Otherwise the policy decides what
        to evict to fit ``weights_bytes + working_bytes``; evicted models are dropped (every
        reference, gc, allocator cache) before the load. ``load_kwargs`` go to the loader (e.g.
        the variant's precision); they must be part of ``manifest_key``.

        Raises:
            ResidencyRefused: only evicting a protected model would make room (nothing evicted).
        """
        key = self._key(model_id, manifest_key)
        if key in self.residents:
            self.residents.move_to_end(key)
            return self.residents[key].pipeline, 0.0, False
        self._evict([k for k, r in self.residents.items() if r.model_id == model_id])  # a stale copy
        warm = [WarmModel(k, r.model_id, r.bytes) for k, r in self.residents.items()]
        plan = plan_load(
            self.policy,
            warm,
            model_id,
            weights_bytes=weights_bytes,
            working_bytes=working_bytes,
            free_bytes=self.free_bytes(),
            protected=self.protected,
        )
        if plan.refused:
            raise ResidencyRefused(plan.message, reason=plan.refused)
        self._evict(list(plan.evict))
        started = time.perf_counter()
        pipeline = self.device.place(self.loader(folder, **(load_kwargs or {})))  # onto the GPU, where it runs
        load_s = time.perf_counter() - started
        self.residents[key] = Resident(model_id, manifest_key, pipeline, weights_bytes)
        self.loads += 1
        return pipeline, load_s, True

    def unload_unprotected(self, keep: str | None = None) -> list[str]:
        """Drop every warm model outside the protected set except ``keep`` (the video's own
        model, before a video job, R17); returns their ids."""
        keys = [k for k, r in self.residents.items() if r.model_id not in self.protected and r.model_id != keep]
        dropped = [self.residents[k].model_id for k in keys]
        self._evict(keys)
        return dropped

    def drop(self, model_id: str) -> bool:
        """Drop every resident copy of ``model_id`` (e.g. a pipeline whose LoRA adapters could
        not be unloaded); True when one was resident."""
        keys = [k for k, r in self.residents.items() if r.model_id == model_id]
        self._evict(keys)
        return bool(keys)

    def unload(self) -> None:
        """Drop every resident model."""
        self._evict(list(self.residents))

    def _evict(self, keys: list[str]) -> None:
        if not keys:
            return
        for key in keys:
            resident = self.residents.pop(key)
            log.info("evicting %s (%d bytes, %s policy)", resident.model_id, resident.bytes, self.policy.name)
            del resident  # the cache held the only long-lived reference
            self.evictions += 1
        gc.collect()
        self.device.empty_cache()

    @staticmethod
    def _key(model_id: str, manifest_key: str) -> str:
        return f"{model_id}\x00{manifest_key}"
