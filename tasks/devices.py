"""The worker's device adapters, one per backend, behind ``residency.device.Device`` (docs/design.md, "Residency",
R15, R18), and the detection of this machine's device.

- ``cpu``: system RAM via psutil, treated as unified memory; *available* memory counts
  reclaimable page cache as free (psutil's ``virtual_memory().available``).
- ``cuda``: dedicated memory; real capacity and free bytes from ``torch.cuda.mem_get_info``,
  ``torch.cuda.empty_cache`` after an unload; one checkpoint at a time.
- ``mps``: unified memory; capacity = ``torch.mps.recommended_max_memory()`` (the Metal
  recommended working set), in use = ``torch.mps.driver_allocated_memory()`` (includes the
  allocator's cache), ``torch.mps.empty_cache``, and the memory guard.

R18: the MPS adapter is the ONLY place in Homefleet where torch's per-process memory fraction
is set (``torch.mps.set_per_process_memory_fraction``). CUDA is never capped: on a 24 GB card a
leftover process-wide cap once made the next large model fail to load with gigabytes free.
``tests/unit/tasks/test_devices.py`` reads the code base to keep it that way.

Adapters take the ``torch`` module as an argument, so that the CUDA and MPS adapters can be
tested on a CPU host against a fake torch module with the same attributes (the only fake the
tests use: no CUDA or MPS device exists here).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import MutableMapping
from types import ModuleType
from typing import Any

from app.core.names import split_machine
from residency.device import Device, MemoryKind

log = logging.getLogger(__name__)

#: Fraction of the recommended working set the MPS allocator may use (torch's own default
#: high watermark is 1.7 x the recommended working set; Homefleet caps it at the working set).
MPS_MEMORY_FRACTION = 1.0


def limit_threads(threads: int | None) -> None:
    """Size torch's CPU thread pool of this process to ``threads`` (None: leave torch's default,
    one per core). Called in each pool process, where pipelines run."""
    if threads is None:
        return
    import torch

    torch.set_num_threads(threads)


def bind_device(machine: str, environ: MutableMapping[str, str] | None = None) -> int | None:
    """Bind this process to its machine's device, before torch is imported: for a
    device of a multi-device host (``box:1``), set ``CUDA_VISIBLE_DEVICES`` to its index
    (``"1"``: the host's physical index, as ``nvidia-smi`` numbers them), so that torch sees
    that one card, as ``cuda:0``. A machine without a device index (``box``) leaves the
    environment alone. Returns the index, or None. ``environ``: ``os.environ`` by default.

    An index set already to another value is replaced, with a warning: the machine's name says
    which card it drives. A name that is no machine name (``app/core/names.py``) binds nothing:
    the server refuses it (``check_token``). Called by ``tasks/worker.py`` ``start_worker``
    first of all.
    """
    environ = os.environ if environ is None else environ
    try:
        _, index = split_machine(machine)
    except ValueError:
        return None
    if index is None:
        return None
    before = environ.get("CUDA_VISIBLE_DEVICES")
    if before is not None and before != str(index):
        log.warning("%s: CUDA_VISIBLE_DEVICES was %r; set to %d, this machine's device", machine, before, index)
    if "torch" in sys.modules:
        log.warning("%s: torch was imported before the device was bound; CUDA may see every card", machine)
    environ["CUDA_VISIBLE_DEVICES"] = str(index)
    log.info("%s: bound to device %d (CUDA_VISIBLE_DEVICES=%d)", machine, index, index)
    return index


def detect_device() -> str:
    """``cuda`` when torch sees a CUDA device, else ``mps`` when it sees Apple's, else ``cpu``."""
    import torch

    if torch.cuda.is_available():
        return "cuda"
    if torch.backends.mps.is_available():
        return "mps"
    return "cpu"


class CpuDevice:
    """System RAM as unified memory (psutil)."""

    name = "cpu"
    memory_kind = MemoryKind.unified

    def __init__(self, psutil_module: Any | None = None) -> None:
        if psutil_module is None:
            import psutil as psutil_module
        self.psutil: Any = psutil_module

    def capacity_bytes(self) -> int:
        return int(self.psutil.virtual_memory().total)

    def available_bytes(self) -> int:
        """Free RAM counting reclaimable page cache (``virtual_memory().available``)."""
        return int(self.psutil.virtual_memory().available)

    def allocated_bytes(self) -> int:
        """Resident set size of this process."""
        return int(self.psutil.Process().memory_info().rss)

    def empty_cache(self) -> None:
        """Nothing to empty: freed CPU tensors go back to the C allocator."""

    def place(self, pipeline: Any) -> Any:
        """Loaded on the CPU already: as is."""
        return pipeline

    def guard(self) -> None:
        """No guard on the CPU backend."""


class CudaDevice:
    """Dedicated GPU memory: one checkpoint, real capacity, explicit cache emptying; never capped (R18)."""

    name = "cuda"
    memory_kind = MemoryKind.dedicated

    def __init__(self, torch_module: ModuleType | Any) -> None:
        self.torch = torch_module

    def capacity_bytes(self) -> int:
        return int(self.torch.cuda.mem_get_info()[1])

    def available_bytes(self) -> int:
        return int(self.torch.cuda.mem_get_info()[0])

    def allocated_bytes(self) -> int:
        return int(self.torch.cuda.memory_allocated())

    def empty_cache(self) -> None:
        self.torch.cuda.empty_cache()

    def place(self, pipeline: Any) -> Any:
        return pipeline.to("cuda")

    def guard(self) -> None:
        """Deliberately nothing: dedicated memory is managed by capacity, not by a cap (R18)."""


class MpsDevice:
    """Apple unified memory: recommended working set, driver-allocated bytes, and the memory guard."""

    name = "mps"
    memory_kind = MemoryKind.unified

    def __init__(self, torch_module: ModuleType | Any, fraction: float = MPS_MEMORY_FRACTION) -> None:
        self.torch = torch_module
        self.fraction = fraction

    def capacity_bytes(self) -> int:
        return int(self.torch.mps.recommended_max_memory())

    def available_bytes(self) -> int:
        return max(0, self.capacity_bytes() - self.allocated_bytes())

    def allocated_bytes(self) -> int:
        """Driver-allocated bytes, including the allocator's cache."""
        return int(self.torch.mps.driver_allocated_memory())

    def empty_cache(self) -> None:
        self.torch.mps.empty_cache()

    def place(self, pipeline: Any) -> Any:
        return pipeline.to("mps")

    def guard(self) -> None:
        """The memory guard (R18): cap the MPS allocator at ``fraction`` of the recommended working set."""
        self.torch.mps.set_per_process_memory_fraction(self.fraction)


def device_for(backend: str, torch_module: ModuleType | Any | None = None) -> Device:
    """The adapter of ``backend`` (``cpu``, ``cuda`` or ``mps``).

    Raises:
        ValueError: unknown backend.
    """
    if backend == "cpu":
        return CpuDevice()
    if torch_module is None:
        import torch as torch_module
    if backend == "cuda":
        return CudaDevice(torch_module)
    if backend == "mps":
        return MpsDevice(torch_module)
    raise ValueError(f"device backend must be one of cpu, cuda, mps; got {backend!r}")
