"""Machine names, shared by the fleet file (``app/fleet/config.py``) and the worker
(``tasks/devices.py`` ``bind_device``).

A machine is either a host entry of the fleet file (``box``: lowercase letters, digits and
``-``, starting with a letter, at most 32 characters) or one device of a host entry that
declares ``devices``: ``<host>:<index>`` (``box:0``, ``box:1``), ``index`` being the device's
index on that host (what ``nvidia-smi`` shows, and what ``CUDA_VISIBLE_DEVICES`` takes).

The ``:`` is safe everywhere a machine name goes: Redis keys (``hf:machine:box:0:heartbeat``:
nothing splits a key on ``:``), Celery queue names (``machine.box:0``) and node names
(``box:0@host``), URL paths (``/v1/machines/box:0/residency``: ``:`` is a legal path
character; clients may also send it as ``%3A``), file names on POSIX hosts
(``machines/box:0/models``) and command-line arguments.
"""

from __future__ import annotations

import re

DEVICE_SEPARATOR = ":"
#: the most devices one host entry may declare (indices 0..MAX_DEVICES - 1)
MAX_DEVICES = 64

_HOST = r"[a-z][a-z0-9-]{0,31}"
HOST_NAME = re.compile(_HOST)
MACHINE_NAME = re.compile(rf"(?P<host>{_HOST})(?:{DEVICE_SEPARATOR}(?P<device>0|[1-9][0-9]?))?")


def device_machine(host: str, index: int) -> str:
    """The machine name of device ``index`` of ``host``: ``box``, 0 -> ``box:0``."""
    return f"{host}{DEVICE_SEPARATOR}{index}"


def split_machine(name: str) -> tuple[str, int | None]:
    """``(host, device index)`` of a machine name: ``box:1`` -> ``("box", 1)``, ``box`` ->
    ``("box", None)``.

    Raises:
        ValueError: ``name`` is not a machine name (the message says what one is).
    """
    match = MACHINE_NAME.fullmatch(name)
    if match is None or (match.group("device") is not None and int(match.group("device")) >= MAX_DEVICES):
        raise ValueError(
            f"a machine name is a host name (lowercase letters, digits and '-', starting with a "
            f"letter, at most 32 characters), or a host's device '<host>:<index>' (e.g. 'box:0', "
            f"index 0..{MAX_DEVICES - 1}); got {name!r}"
        )
    device = match.group("device")
    return match.group("host"), None if device is None else int(device)
