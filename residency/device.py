"""What residency needs of a device, as an interface (docs/design.md, "Residency", R15, R18): its memory kind
and memory figures, emptying its allocator cache, placing a pipeline on it, and its memory
guard. The adapters (CPU, CUDA, MPS) live with the worker (``tasks/devices.py``); the policies
and the model cache here see only this protocol, so they are tested on any host.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any, Protocol


class MemoryKind(StrEnum):
    """How a device's memory is shared: the one type for it, in the fleet config, placement's
    cost model and the residency policies."""

    unified = "unified"  # shared with the OS (CPU, Apple MPS): a protected set + LRU eviction (R15)
    dedicated = "dedicated"  # a card's own memory (CUDA): exactly one checkpoint resident (R15)


class Device(Protocol):
    """What the residency policy needs to know of, and do to, a device.

    All figures are bytes. ``capacity_bytes`` is the total the device offers to models;
    ``available_bytes`` what can still be allocated now; ``allocated_bytes`` what this
    process holds (for C05: back to the post-start baseline after each unload).
    """

    name: str
    memory_kind: MemoryKind

    def capacity_bytes(self) -> int: ...

    def available_bytes(self) -> int: ...

    def allocated_bytes(self) -> int: ...

    def empty_cache(self) -> None: ...

    def place(self, pipeline: Any) -> Any:
        """Move a pipeline just loaded (on the CPU) onto this device, where its jobs run;
        returns the pipeline to use."""
        ...

    def guard(self) -> None:
        """Apply the backend's memory guard once at worker start (only MPS has one, R18)."""
        ...
