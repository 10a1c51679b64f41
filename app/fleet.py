"""The fleet config: one TOML file listing the machines that run jobs.

Example (``app/fleet.default.toml`` is the embedded default)::

    [[machines]]
    name = "cuda1"
    backend = "cuda"            # cpu | cuda | mps
    memory_kind = "dedicated"   # unified | dedicated
    memory_bytes = 24_000_000_000
    families = ["sd1", "sdxl"]
    token = "…"                 # the worker's secret for the internal API

The server itself is machine ``server`` and must be listed (R9).
"""

from __future__ import annotations

import re
import secrets
import tomllib
from enum import StrEnum
from importlib import resources
from pathlib import Path

from pydantic import BaseModel, Field, field_validator, model_validator

SERVER = "server"
"""The server's own machine name (R9: the default target)."""

_NAME = re.compile(r"^[a-z][a-z0-9-]{0,31}$")


class Backend(StrEnum):
    cpu = "cpu"  # system RAM, treated as unified memory
    cuda = "cuda"  # a dedicated card: one checkpoint resident (R15)
    mps = "mps"  # Apple-Silicon unified memory


class MemoryKind(StrEnum):
    unified = "unified"  # warm models share memory with the OS; protected set + LRU (R15)
    dedicated = "dedicated"  # a card's own memory; exactly one checkpoint (R15)


class Machine(BaseModel):
    """One machine of the fleet. ``memory_bytes`` is usable memory for jobs, in bytes."""

    name: str
    backend: Backend
    memory_kind: MemoryKind
    memory_bytes: int = Field(gt=0)
    families: frozenset[str]
    token: str = Field(default="", repr=False)
    # Initial timing guesses for placement (R13; shared/notes/seed-fleet.md): diffusion speed
    # relative to the seed fleet's server (1.0), and the model load rate in bytes per second.
    speed: float = Field(default=1.0, gt=0)
    load_bytes_per_s: float = Field(default=2.5e9, gt=0)

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not _NAME.match(value):
            raise ValueError(
                f"machine name must be lowercase letters, digits and '-', starting with a letter, "
                f"at most 32 characters; got {value!r}"
            )
        return value


class Fleet(BaseModel):
    """All machines, by name. Raises ``ValueError`` on duplicate names or tokens, a missing
    ``server`` machine, or (with ``require_tokens``) a machine without a token."""

    machines: dict[str, Machine]

    @model_validator(mode="before")
    @classmethod
    def _from_list(cls, data: object) -> object:
        if isinstance(data, dict) and isinstance(data.get("machines"), list):
            machines = {}
            for entry in data["machines"]:
                name = entry.get("name")
                if name in machines:
                    raise ValueError(f"machine {name!r} is listed twice in the fleet config")
                machines[name] = entry
            return {"machines": machines}
        return data

    @model_validator(mode="after")
    def _checks(self) -> Fleet:
        if SERVER not in self.machines:
            raise ValueError(f"the fleet config must list the server itself as machine {SERVER!r}")
        tokens = [m.token for m in self.machines.values() if m.token]
        if len(tokens) != len(set(tokens)):
            raise ValueError("two machines share a token; give each machine its own")
        return self

    def require_tokens(self) -> Fleet:
        """Return self; raise ``ValueError`` naming the first machine without a token."""
        for machine in self.machines.values():
            if len(machine.token) < 16:
                raise ValueError(f"machine {machine.name!r} needs a token of at least 16 characters")
        return self

    def machine_for_token(self, token: str) -> Machine | None:
        """The machine whose token equals ``token`` (constant-time compare), or None."""
        found = None
        for machine in self.machines.values():
            if machine.token and secrets.compare_digest(machine.token.encode(), token.encode()):
                found = machine
        return found

    def to_toml(self) -> str:
        """Render as TOML (tokens included), the inverse of :func:`load_fleet`."""
        lines = []
        for m in self.machines.values():
            families = ", ".join(f'"{f}"' for f in sorted(m.families))
            lines += [
                "[[machines]]",
                f'name = "{m.name}"',
                f'backend = "{m.backend}"',
                f'memory_kind = "{m.memory_kind}"',
                f"memory_bytes = {m.memory_bytes}",
                f"families = [{families}]",
                f'token = "{m.token}"',
                f"speed = {m.speed}",
                f"load_bytes_per_s = {m.load_bytes_per_s}",
                "",
            ]
        return "\n".join(lines)


def load_fleet(path: Path | None) -> Fleet:
    """Read the fleet config at ``path``, or the embedded default when ``path`` is None.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: invalid TOML or an invalid machine (the message names it).
    """
    if path is None:
        text = resources.files("app").joinpath("fleet.default.toml").read_text()
    else:
        text = Path(path).read_text()
    return Fleet.model_validate(tomllib.loads(text))


def with_fresh_tokens(fleet: Fleet) -> Fleet:
    """A copy of ``fleet`` where every machine has a new random token (32 bytes, urlsafe)."""
    machines = {
        name: m.model_copy(update={"token": secrets.token_urlsafe(32)}) for name, m in fleet.machines.items()
    }
    return Fleet(machines=machines)
