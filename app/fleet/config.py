"""The fleet config: one TOML file listing the machines that run jobs.

Example (``app/fleet/fleet.default.toml`` is the embedded default)::

    [[machines]]
    name = "cuda1"
    backend = "cuda"  # cpu | cuda | mps
    memory_kind = "dedicated"  # unified | dedicated
    memory_bytes = 24_000_000_000
    families = ["sd1", "sdxl"]
    token = "…"  # the worker's secret for the internal API

The server itself is machine ``server`` and must be listed (R9).

A host with several devices (docs/operations.md, "Several devices on one host") declares them on
its one entry, as a list of ``"<backend>:<index>"`` or as a count (``devices = 2``: indices 0 and 1)::

    [[machines]]
    name = "box"
    backend = "cuda"
    devices = ["cuda:0", "cuda:1"]
    memory_bytes = 24_000_000_000  # per device
    ...

Each device becomes a machine of its own, named ``<host>:<index>`` (``box:0``, ``box:1``,
``app/core/names.py``), with the entry's settings, its own queue, heartbeat, residency and
model folder, and ``host``/``device`` set. The devices of a host share the entry's token.

Working memory per job beyond the weights (R10/R11's memory filter, the job record's
estimate): coefficients per kind, and per family where a family differs; every table and
field is optional (absent: the embedded defaults of ``routing/estimate.py``)::

    [working_memory.txt2img]  # every family; bytes = base_bytes + bytes_per_pixel x size
    base_bytes = 500_000_000
    bytes_per_pixel = 1500.0  # per output pixel x frame x batch

    [families.sdxl.working_memory.txt2img]
    bytes_per_pixel = 2600.0  # base_bytes: from [working_memory.txt2img]

Timing guesses per model until the first measurement (R13; absent: the per-family figures of
``routing/estimate.py``, which are for real models on the seed fleet)::

    [models.sdxl - base]
    step_s = 0.6  # seconds per step at 1024x1024 on a speed-1.0 machine
    load_s = 2.8  # seconds of a cold load at 2.5 GB/s

``python -m bench.memory`` measures them and prints such tables.

Where a job's webhook may go (absent: nowhere, every ``webhook_url`` is refused)::

    [webhooks]
    allow_hosts = ["hooks.example", "10.0.0.5"]  # host names or IP addresses, exact match
"""

from __future__ import annotations

import difflib
import secrets
import tomllib
from collections.abc import Iterable
from enum import StrEnum
from importlib import resources
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from app.core.config import WORKER_TOKEN_MIN_CHARS
from app.core.errors import ConfigError
from app.core.kinds import KINDS
from app.core.names import HOST_NAME, MAX_DEVICES, device_machine, split_machine
from residency.device import MemoryKind
from routing.estimate import DEFAULT_WORKING, WorkingCoefficients, WorkingMemory
from routing.placement import SERVER


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
    # Set on the machines a host entry's ``devices`` expands to (``box:0``: host
    # ``box``, device 0); None on a single-device entry.
    host: str | None = None
    device: int | None = Field(default=None, ge=0, lt=MAX_DEVICES)

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        split_machine(value)  # ValueError saying what a machine name is
        return value

    @model_validator(mode="after")
    def _device(self) -> Machine:
        host, device = split_machine(self.name)
        if device is None and (self.host is not None or self.device is not None):
            raise ValueError(f"machine {self.name!r} has host/device set but is not named '<host>:<index>'")
        if device is not None and (self.host, self.device) != (host, device):
            raise ValueError(
                f"machine {self.name!r} names device {device} of host {host!r}: declare the host's "
                f'devices on its entry instead, name = {host!r} and devices = ["{self.backend}:{device}", ...]'
            )
        return self

    @property
    def host_name(self) -> str:
        """The host this machine runs on: ``host`` for a device of a multi-device entry, else its name."""
        return self.host or self.name


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
    # a text model's token limits, over its family's and its config.json's
    max_input_tokens: int | None = Field(default=None, ge=1)
    max_total_tokens: int | None = Field(default=None, ge=2)


class WebhookConfig(BaseModel):
    """``[webhooks]``: ``allow_hosts``, the hosts a job's ``webhook_url`` may name:
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
                raise ValueError(
                    f"webhooks.allow_hosts takes host names or IP addresses (e.g. 'hooks.example'), not {host!r}"
                )
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
    webhooks: WebhookConfig = Field(default_factory=WebhookConfig)  # where a job's webhook may go

    check_kinds = field_validator("working_memory")(_check_kinds)

    @model_validator(mode="before")
    @classmethod
    def _from_list(cls, data: object) -> object:
        if isinstance(data, dict) and isinstance(data.get("machines"), list):
            machines = {}
            for entry in data["machines"]:
                for device in expand_devices(entry):
                    name = device.get("name") if isinstance(device, dict) else None
                    if name in machines:
                        raise ValueError(f"machine {name!r} is listed twice in the fleet config")
                    machines[name] = device
            return {**data, "machines": machines}
        return data

    @model_validator(mode="after")
    def _checks(self) -> Fleet:
        if SERVER not in self.machines:
            raise ValueError(f"the fleet config must list the server itself as machine {SERVER!r}")
        for host, members in self.hosts().items():
            if len(members) > 1 and any(m.device is None for m in members):
                raise ValueError(f"machine {host!r} is listed twice in the fleet config (once with devices)")
            settings = {m.model_dump_json(exclude={"name", "device"}) for m in members}
            if len(settings) > 1:  # one entry in the file (to_toml): its devices share its settings
                raise ValueError(f"the devices of host {host!r} differ in settings; a host's devices take its entry's")
        hosts_of: dict[str, set[str]] = {}
        for m in self.machines.values():
            if m.token:
                hosts_of.setdefault(m.token, set()).add(m.host_name)
        if any(len(hosts) > 1 for hosts in hosts_of.values()):  # a host's devices share its entry's token
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
                raise ValueError(
                    f"{where} names family {name!r}, which no machine runs (families: {', '.join(sorted(known))}){hint}"
                )

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
            if len(machine.token) < WORKER_TOKEN_MIN_CHARS:
                raise ValueError(
                    f"machine {machine.name!r} needs a token of at least {WORKER_TOKEN_MIN_CHARS} characters"
                )
        return self

    def machine_for_token(self, token: str) -> Machine | None:
        """The first machine whose token equals ``token`` (constant-time compare), or None."""
        found = self.machines_for_token(token)
        return found[0] if found else None

    def machines_for_token(self, token: str) -> list[Machine]:
        """Every machine whose token equals ``token`` (constant-time compare, every machine
        compared): one machine, or the devices of one host (which share its token); [] for none."""
        found = []
        for machine in self.machines.values():
            if machine.token and secrets.compare_digest(machine.token.encode(), token.encode()):
                found.append(machine)
        return found

    def hosts(self) -> dict[str, list[Machine]]:
        """The machines grouped by host (``Machine.host_name``), hosts and devices in fleet order."""
        grouped: dict[str, list[Machine]] = {}
        for machine in self.machines.values():
            grouped.setdefault(machine.host_name, []).append(machine)
        return grouped

    def to_toml(self) -> str:
        """Render as TOML (tokens included), the inverse of :func:`load_fleet`."""
        lines = []
        for host, members in self.hosts().items():
            m = members[0]  # a host's devices have its entry's settings
            families = ", ".join(f'"{f}"' for f in sorted(m.families))
            devices = ", ".join(f'"{d.backend}:{d.device}"' for d in members)
            lines += [
                "[[machines]]",
                f'name = "{host}"',
                *([f"devices = [{devices}]"] if m.device is not None else []),
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
            lines += [
                f'[models."{model_id}"]',
                *(f"{name} = {value}" for name, value in guess.model_dump().items() if value is not None),
                "",
            ]
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
            raise ConfigError(
                f"the fleet file {path} cannot be read ({error.strerror or error}); "
                'set HOMEFLEET_FLEET_FILE to a fleet TOML file (docs/operations.md, "The fleet file")'
            ) from error
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(
            f"the fleet file {path or 'app/fleet/fleet.default.toml'} is not valid TOML: {error}"
        ) from error
    return Fleet.model_validate(data)


def with_fresh_tokens(fleet: Fleet) -> Fleet:
    """A copy of ``fleet`` where every host has a new random token (32 bytes, urlsafe), shared
    by its devices."""
    tokens = {host: secrets.token_urlsafe(32) for host in fleet.hosts()}
    machines = {name: m.model_copy(update={"token": tokens[m.host_name]}) for name, m in fleet.machines.items()}
    return fleet.model_copy(update={"machines": machines})


def expand_devices(entry: object) -> list[object]:
    """The machines one fleet-file entry stands for: itself, or with ``devices`` one per device,
    named ``<host>:<index>`` with ``host`` and ``device`` set and the entry's other settings.
    ``devices`` is a list of ``"<backend>:<index>"`` (the entry's backend, distinct indices
    0..63) or a count (1..64: indices 0..count-1).

    Raises:
        ValueError: a bad ``devices`` (naming the machine, the field and what it takes), or
            ``host``/``device`` written in the file (they are derived from ``devices``).
    """
    if not isinstance(entry, dict):
        return [entry]  # pydantic says what is wrong with it
    name = entry.get("name")
    for derived in ("host", "device"):
        if derived in entry:
            raise ValueError(
                f"machine {name!r}: {derived!r} is not a fleet-file key; declare a host's devices on "
                f'its entry, devices = ["cuda:0", "cuda:1"] or devices = 2'
            )
    if "devices" not in entry:
        return [entry]
    devices = entry["devices"]
    backend = entry.get("backend")
    where = f"machine {name!r}: devices"
    if not isinstance(name, str) or HOST_NAME.fullmatch(name) is None:
        raise ValueError(
            f"{where}: the entry's name must be a host name (lowercase letters, digits and '-', "
            f"starting with a letter, at most 32 characters; its devices are named '<host>:<index>'); "
            f"got {name!r}"
        )
    if isinstance(devices, int) and not isinstance(devices, bool):
        if not 1 <= devices <= MAX_DEVICES:
            raise ValueError(f"{where} = {devices}: a count of devices is 1..{MAX_DEVICES}")
        indices = list(range(devices))
    elif isinstance(devices, list) and devices:
        indices = []
        for item in devices:
            device_backend, _, index = item.partition(":") if isinstance(item, str) else ("", "", "")
            if (
                device_backend != backend
                or not index.isdigit()
                or int(index) >= MAX_DEVICES
                or str(int(index)) != index
            ):
                raise ValueError(
                    f'{where}: each device is "{backend}:<index>" (the entry\'s backend, index '
                    f"0..{MAX_DEVICES - 1}); got {item!r}"
                )
            if int(index) in indices:
                raise ValueError(f"{where}: device {item!r} is listed twice")
            indices.append(int(index))
    else:
        raise ValueError(
            f'{where} must be a list of "<backend>:<index>" (e.g. ["cuda:0", "cuda:1"]) or a '
            f"count (e.g. 2); got {devices!r}"
        )
    if backend == Backend.mps and len(indices) > 1:
        raise ValueError(f"{where}: an Apple host has one mps device; got {len(indices)}")
    rest = {key: value for key, value in entry.items() if key != "devices"}
    return [{**rest, "name": device_machine(name, index), "host": name, "device": index} for index in indices]
