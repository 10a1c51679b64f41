"""The fleet config: one TOML file listing the machines that run jobs.

Example (``app/fleet/fleet.default.toml`` is the embedded default)::

    [[machines]]
    name = "cuda1"
    backend = "cuda"            # cpu | cuda | mps
    memory_kind = "dedicated"   # unified | dedicated
    memory_bytes = 24_000_000_000
    families = ["sd1", "sdxl"]
    token = "…"                 # the worker's secret for the internal API

The server itself is machine ``server`` and must be listed (R9).

Working memory per job beyond the weights (R10/R11's memory filter, the job record's
estimate): coefficients per kind, and per family where a family differs; every table and
field is optional (absent: the embedded defaults of ``routing/estimate.py``)::

    [working_memory.txt2img]    # every family; bytes = base_bytes + bytes_per_pixel x size
    base_bytes = 500_000_000
    bytes_per_pixel = 1500.0    # per output pixel x frame x batch

    [families.sdxl.working_memory.txt2img]
    bytes_per_pixel = 2600.0    # base_bytes: from [working_memory.txt2img]

Timing guesses per model until the first measurement (R13; absent: the per-family figures of
``routing/estimate.py``, which are for real models on the seed fleet)::

    [models.sdxl-base]
    step_s = 0.6                # seconds per step at 1024x1024 on a speed-1.0 machine
    load_s = 2.8                # seconds of a cold load at 2.5 GB/s

``python -m bench.memory`` measures them and prints such tables.

Where a job's webhook may go (issue 22; absent: nowhere, every ``webhook_url`` is refused)::

    [webhooks]
    allow_hosts = ["hooks.example", "10.0.0.5"]   # host names or IP addresses, exact match
"""

from __future__ import annotations

import difflib
import re
import secrets
import tomllib
from collections.abc import Iterable
from enum import StrEnum
from importlib import resources
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from app.core.errors import ConfigError
from app.core.kinds import KINDS
from residency.device import MemoryKind
from routing.estimate import DEFAULT_WORKING, WorkingCoefficients, WorkingMemory
from routing.placement import SERVER

_NAME = re.compile(r"^[a-z][a-z0-9-]{0,31}$")


class Backend(StrEnum):
    cpu = "cpu"  # system RAM, treated as unified memory
    cuda = "cuda"  # a dedicated card: one checkpoint resident (R15)
    mps = "mps"  # Apple-Silicon unified memory


class Machine(BaseModel):
    """One machine of the fleet. ``memory_bytes`` is usable memory for jobs, in bytes. A key
    that is not one of these fields is refused (``speeed = 3.0`` would otherwise leave the
    default speed in place, silently)."""

    model_config = ConfigDict(extra="forbid")

    name: str
    backend: Backend
    memory_kind: MemoryKind
    memory_bytes: int = Field(gt=0)
    families: frozenset[str]
    token: str = Field(default="", repr=False)
    # Initial timing guesses for placement (R13; docs/benchmarks.md, "Placement"): diffusion speed
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


class KindWorking(BaseModel):
    """Working-memory coefficients of one kind: ``base_bytes`` (bytes) and ``bytes_per_pixel``
    (bytes per output pixel x frame x batch). A field left out falls back (see :class:`Fleet`)."""

    model_config = ConfigDict(extra="forbid")

    base_bytes: int | None = Field(default=None, ge=0)
    bytes_per_pixel: float | None = Field(default=None, ge=0)


def _check_kinds(value: dict[str, KindWorking]) -> dict[str, KindWorking]:
    unknown = sorted(set(value) - set(KINDS))
    if unknown:
        raise ValueError(f"working_memory has no kind {unknown[0]!r}; kinds are {', '.join(KINDS)}")
    return value


class FamilyConfig(BaseModel):
    """Per-family settings: ``working_memory`` coefficients by kind, overriding the fleet's."""

    model_config = ConfigDict(extra="forbid")

    working_memory: dict[str, KindWorking] = Field(default_factory=dict)

    check_kinds = field_validator("working_memory")(_check_kinds)


class ModelGuess(BaseModel):
    """Initial timing guesses for one model (R13), replacing the per-family figures of
    ``routing/estimate.py`` (seed-fleet.md, real models at 1024x1024) until the first
    measurement. A field left out keeps that default.

    ``step_s``: seconds per diffusion step at the reference size (1024 x 1024 pixels x 1
    frame x batch 1) on a speed-1.0 machine. ``load_s``: seconds of a cold load on a machine
    that reads 2.5 GB/s (``load_bytes_per_s`` scales it per machine). ``max_input_tokens`` and
    ``max_total_tokens``: a text model's token limits (``app/core/limits.py`` ``token_limits``)."""

    model_config = ConfigDict(extra="forbid")

    step_s: float | None = Field(default=None, gt=0)
    load_s: float | None = Field(default=None, gt=0)
    # a text model's token limits (issue 20), over its family's and its config.json's
    max_input_tokens: int | None = Field(default=None, ge=1)
    max_total_tokens: int | None = Field(default=None, ge=2)


class WebhookConfig(BaseModel):
    """``[webhooks]``: ``allow_hosts``, the hosts a job's ``webhook_url`` may name (issue 22):
    host names or IP addresses, matched exactly and case-insensitively (no wildcards; any port).
    Empty: no webhook is accepted."""

    model_config = ConfigDict(extra="forbid")

    allow_hosts: list[str] = Field(default_factory=list)

    @field_validator("allow_hosts")
    @classmethod
    def _hosts(cls, value: list[str]) -> list[str]:
        hosts = []
        for host in value:
            name = host.strip().lower().removeprefix("[").removesuffix("]")
            if not name or any(c in name for c in "/@?# ") or "://" in host:
                raise ValueError(f"webhooks.allow_hosts takes host names or IP addresses (e.g. 'hooks.example'), "
                                 f"not {host!r}")
            hosts.append(name)
        return sorted(set(hosts))


class Fleet(BaseModel):
    """All machines, by name, the working-memory coefficients (fleet-wide per kind in
    ``working_memory``, per family in ``families``) and per-model timing guesses (``models``).
    Raises ``ValueError`` on duplicate names or tokens, a missing ``server`` machine, an
    unknown kind or a negative coefficient (naming the field), or (with ``require_tokens``) a
    machine without a token."""

    model_config = ConfigDict(extra="forbid")  # a misspelt table (``[model.x]``) is refused, not ignored

    machines: dict[str, Machine]
    working_memory: dict[str, KindWorking] = Field(default_factory=dict)
    families: dict[str, FamilyConfig] = Field(default_factory=dict)
    models: dict[str, ModelGuess] = Field(default_factory=dict)
    webhooks: WebhookConfig = Field(default_factory=WebhookConfig)  # where a job's webhook may go (issue 22)

    check_kinds = field_validator("working_memory")(_check_kinds)

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
            return {**data, "machines": machines}
        return data

    @model_validator(mode="after")
    def _checks(self) -> Fleet:
        if SERVER not in self.machines:
            raise ValueError(f"the fleet config must list the server itself as machine {SERVER!r}")
        tokens = [m.token for m in self.machines.values() if m.token]
        if len(tokens) != len(set(tokens)):
            raise ValueError("two machines share a token; give each machine its own")
        self.check_family_names(self.families, "the families table")
        return self

    @property
    def family_names(self) -> frozenset[str]:
        """Every model family some machine of the fleet runs."""
        return frozenset().union(*(m.families for m in self.machines.values()))

    def check_family_names(self, names: Iterable[str], where: str, also: Iterable[str] = ()) -> None:
        """Raise ``ValueError`` naming the first of ``names`` that no machine runs and is not in
        ``also``: a misspelt family (``sdx1``) would otherwise configure nothing, silently.
        ``where`` says which setting named it, for the message."""
        known = self.family_names | frozenset(also)
        for name in names:
            if name not in known:
                close = difflib.get_close_matches(name, sorted(known), n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise ValueError(f"{where} names family {name!r}, which no machine runs "
                                 f"(families: {', '.join(sorted(known))}){hint}")

    def working(self) -> WorkingMemory:
        """The coefficients for :class:`routing.estimate.Estimator`, every field resolved:
        a family's field, else the fleet's for that kind, else the embedded default."""
        by_kind = {kind: _resolve(self.working_memory.get(kind), DEFAULT_WORKING[kind]) for kind in KINDS}
        by_family = {
            family: {kind: _resolve(override, by_kind[kind]) for kind, override in config.working_memory.items()}
            for family, config in self.families.items()
        }
        return WorkingMemory(by_kind, by_family)

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
        for kind, coefficients in sorted(self.working_memory.items()):
            lines += [f"[working_memory.{kind}]", *_coefficient_lines(coefficients), ""]
        for family, config in sorted(self.families.items()):
            for kind, coefficients in sorted(config.working_memory.items()):
                lines += [f'[families."{family}".working_memory.{kind}]', *_coefficient_lines(coefficients), ""]
        for model_id, guess in sorted(self.models.items()):
            lines += [f'[models."{model_id}"]', *(f"{name} = {value}" for name, value in guess.model_dump().items()
                                                   if value is not None), ""]
        if self.webhooks.allow_hosts:
            hosts = ", ".join(f'"{host}"' for host in self.webhooks.allow_hosts)
            lines += ["[webhooks]", f"allow_hosts = [{hosts}]", ""]
        return "\n".join(lines)


def _resolve(override: KindWorking | None, fallback: WorkingCoefficients) -> WorkingCoefficients:
    if override is None:
        return fallback
    base = fallback.base_bytes if override.base_bytes is None else override.base_bytes
    per_pixel = fallback.bytes_per_pixel if override.bytes_per_pixel is None else override.bytes_per_pixel
    return WorkingCoefficients(base, per_pixel)


def _coefficient_lines(coefficients: KindWorking) -> list[str]:
    lines = []
    if coefficients.base_bytes is not None:
        lines.append(f"base_bytes = {coefficients.base_bytes}")
    if coefficients.bytes_per_pixel is not None:
        lines.append(f"bytes_per_pixel = {coefficients.bytes_per_pixel}")
    return lines


def load_fleet(path: Path | None) -> Fleet:
    """Read the fleet config at ``path``, or the embedded default when ``path`` is None.

    Raises:
        ConfigError: ``path`` cannot be read or is not TOML (reason ``invalid_config``, the
            message names the file and the fault).
        ValueError: an invalid machine or model entry (pydantic's message names it).
    """
    if path is None:
        text = resources.files("app.fleet").joinpath("fleet.default.toml").read_text()
    else:
        try:
            text = Path(path).read_text()
        except OSError as error:
            raise ConfigError(f"the fleet file {path} cannot be read ({error.strerror or error}); "
                              "set HOMEFLEET_FLEET_FILE to a fleet TOML file (docs/operations.md, \"The fleet file\")") from error
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"the fleet file {path or 'app/fleet/fleet.default.toml'} is not valid TOML: {error}") from error
    return Fleet.model_validate(data)


def with_fresh_tokens(fleet: Fleet) -> Fleet:
    """A copy of ``fleet`` where every machine has a new random token (32 bytes, urlsafe)."""
    machines = {
        name: m.model_copy(update={"token": secrets.token_urlsafe(32)}) for name, m in fleet.machines.items()
    }
    return fleet.model_copy(update={"machines": machines})
