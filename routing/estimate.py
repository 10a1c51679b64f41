"""Expected-finish estimates for placement (R12, R13): run and load seconds, memory bytes,
and residency simulated along a machine's queue.

Pure: plain data in, numbers out. The data comes from the fleet config (machine speed, load
rate, usable memory), the model files (exact weight bytes from safetensors headers, read by
``app/core/safetensors.py``) and learned timings (:mod:`routing.timings`). Whatever the residency
work (``residency/``) learns later is fed in through :class:`CostModel`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

from residency.device import MemoryKind
from routing.timings import REFERENCE_SIZE, TEXT_KIND, LearnedTimings, Timing, job_size, run_seconds

GB = 1_000_000_000
_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def readable_bytes(count: float) -> str:
    """``count`` bytes for people, in binary units with two significant digits below 100
    (``"3.4 MiB"``, ``"12 GiB"``, ``"512 B"``): the one formatting of memory figures in messages
    and dry runs, so a small model never reads "0.0 GB"."""
    value, unit = float(count), 0
    while abs(value) >= 1024 and unit < len(_UNITS) - 1:
        value, unit = value / 1024, unit + 1
    if unit == 0:
        return f"{int(value)} B"
    text = f"{value:.1f}" if abs(value) < 9.95 else f"{value:.0f}"
    return f"{text} {_UNITS[unit]}"


# Seconds per step at the reference size on a speed-1.0 machine, by family (initial guesses,
# docs/benchmarks.md, "Placement"; sd1 is quoted at 512x512 = a quarter of the reference size, the
# upscaler at 512->2048 output, video per step at 480p x 33 frames). Tiny test families get
# the sd1 figure. Overridden per model by ``ModelProfile.step_s``.
FAMILY_STEP_S: dict[str, float] = {
    "sd1": 0.25 * 4,
    "sd1-pix2pix": 0.25 * 4,
    "animatediff": 1.0,
    "sdxl": 0.6,
    "flux": 2.0,
    "qwen-image": 3.0,
    "sd-upscale": 1.5 * REFERENCE_SIZE / (2048 * 2048),
    "wan": 8.0 * REFERENCE_SIZE / (848 * 480 * 33),
}
DEFAULT_STEP_S = 1.0
# Text jobs on a speed-1.0 machine before any measurement: seconds per new token and
# per prompt token (prefill reads the prompt in one batched pass, so a prompt token costs a tenth
# of a decoded one; guesses, replaced by the first finished job, routing.timings.fit_tokens).
# ModelProfile.step_s overrides the per-new-token figure.
TEXT_NEW_TOKEN_S = 0.05
TEXT_PROMPT_TOKEN_S = 0.005
REFERENCE_LOAD_BYTES_PER_S = 2.5 * GB  # the seed fleet's unified machines (seed-fleet.md)


@dataclass(frozen=True)
class WorkingCoefficients:
    """Working memory of one job beyond its weights (activations, latents, the VAE's decode,
    the allocator's slack): ``base_bytes`` + ``bytes_per_pixel`` x size, where size is output
    pixels x frames x batch (:func:`routing.timings.job_size`)."""

    base_bytes: int
    bytes_per_pixel: float

    def bytes(self, size: int) -> int:
        """Working bytes of a job of ``size`` (pixels x frames x batch)."""
        return self.base_bytes + int(self.bytes_per_pixel * size)


# Embedded default coefficients per kind, used when the fleet config has no
# ``[working_memory.<kind>]`` table (docs/operations.md, "Residency").
#
# These are the seed fleet's guesses for real models at fp16 on a GPU, NOT a measurement of
# them. ``python -m bench.memory`` (fresh process per run, peak RSS beyond the loaded pipeline,
# least squares) measured the tiny random-weight pipelines, fp32 on this repository's 2-core
# CPU test machine, on 2026-11-30 (1 step; sizes 64-128 px, upscale 64-256 px out, video
# 64x64x4-96x96x8; 175 s):
#
#     txt2img  base_bytes = 17_350_543   bytes_per_pixel = 2735.05
#     edit     base_bytes = 18_341_343   bytes_per_pixel = 3880.06
#     upscale  base_bytes = 19_625_301   bytes_per_pixel =  755.19
#     video    base_bytes =  4_771_840   bytes_per_pixel = 3352.50
#
# Those figures describe the tiny models only: a few channels per layer, fp32, CPU kernels,
# and attention over every latent pixel, so memory grows faster than linearly with size and a
# line fitted at 64-128 px does not extrapolate. Real checkpoints at fp16 on a GPU have other
# activation sizes, attention kernels and allocator/cuDNN workspaces, which this machine cannot
# measure: the tiny-model base (~20 MB) says nothing about a real model's fixed cost. So the
# embedded defaults below stay the larger seed-fleet guesses for real models; measure on the
# target machine with its real models (``python -m bench.memory --model KIND=DIR``) and put
# the printed TOML in the fleet config.
DEFAULT_WORKING: dict[str, WorkingCoefficients] = {
    "txt2img": WorkingCoefficients(500_000_000, 1500.0),
    "edit": WorkingCoefficients(500_000_000, 2500.0),
    # txt2img's UNet plus the VAE encoder over the input (a guess like the others: edit's)
    "img2img": WorkingCoefficients(500_000_000, 2500.0),
    "inpaint": WorkingCoefficients(500_000_000, 2500.0),
    "upscale": WorkingCoefficients(500_000_000, 600.0),
    "video": WorkingCoefficients(500_000_000, 250.0),
    # text: activations and the allocator's slack; the KV cache is each model's own
    # (ModelProfile.kv_cache_bytes: config.json at its max_total_tokens), added by Estimator.memory
    "text": WorkingCoefficients(100_000_000, 0.0),
}
FALLBACK_WORKING = DEFAULT_WORKING["txt2img"]  # a kind without coefficients (none today)


@dataclass(frozen=True)
class WorkingMemory:
    """Working-memory coefficients by kind, with per-family overrides (fleet config).

    ``by_family[family][kind]`` wins over ``by_kind[kind]``, which wins over the embedded
    :data:`DEFAULT_WORKING`; a kind found nowhere gets :data:`FALLBACK_WORKING`.
    """

    by_kind: Mapping[str, WorkingCoefficients] = field(default_factory=lambda: dict(DEFAULT_WORKING))
    by_family: Mapping[str, Mapping[str, WorkingCoefficients]] = field(default_factory=dict)

    def coefficients(self, family: str, kind: str) -> WorkingCoefficients:
        """The coefficients that price a job of ``kind`` with a model of ``family``."""
        found = self.by_family.get(family, {}).get(kind) or self.by_kind.get(kind) or DEFAULT_WORKING.get(kind)
        return found or FALLBACK_WORKING

    def bytes(self, family: str, kind: str, size: int) -> int:
        """Working bytes of a job: its coefficients applied to ``size`` (pixels x frames x batch)."""
        return self.coefficients(family, kind).bytes(size)


def working_bytes(kind: str, size: int, family: str = "", working: WorkingMemory | None = None) -> int:
    """Working memory (bytes) of one job beyond its weights, for a job of ``kind`` and ``size``
    (pixels x frames x batch), by ``working`` (default: the embedded coefficients)."""
    return (working or WorkingMemory()).bytes(family, kind, size)


@dataclass(frozen=True)
class MemoryEstimate:
    """A job's memory estimate in bytes: exact weights (safetensors headers, by dtype) plus
    working memory (by kind and size, :class:`WorkingMemory`). Shown in the job record."""

    weights_bytes: int
    working_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.working_bytes


@dataclass(frozen=True)
class MachineProfile:
    """A machine's static costs (fleet config): relative speed (1.0 = the server of
    seed-fleet.md), model load rate in bytes/s, memory kind and usable bytes (0 = unknown)."""

    name: str
    speed: float = 1.0
    load_bytes_per_s: float = REFERENCE_LOAD_BYTES_PER_S
    memory_kind: MemoryKind = MemoryKind.unified
    usable_bytes: int = 0


@dataclass(frozen=True)
class ModelProfile:
    """A model's static costs: exact weight bytes (safetensors headers), family and, when
    known, seconds per step at the reference size on a speed-1.0 machine."""

    model_id: str
    family: str
    weights_bytes: int
    step_s: float | None = None
    kind: str = "txt2img"  # the kind it usually runs (for routing.demand's eligibility)
    load_s: float | None = None  # cold load at REFERENCE_LOAD_BYTES_PER_S when more than reading the bytes
    kv_cache_bytes: int = 0  # a text model's KV cache at its max_total_tokens (app/core/textgen.py), bytes


class CostModel(Protocol):
    """What placement needs to know about costs. :class:`Estimator` is the implementation;
    the residency work may provide another (same methods)."""

    def load_s(self, machine: str, model_id: str, kind: str) -> float: ...

    def run_s(self, machine: str, model_id: str, kind: str, steps: int, size: int, batch: int = 1) -> float: ...

    def weights_bytes(self, model_id: str) -> int: ...

    def reload_s(self, machine: str, model_id: str) -> float: ...

    def job_bytes(self, model_id: str, kind: str, size: int) -> int: ...

    def memory_kind(self, machine: str) -> MemoryKind: ...

    def usable_bytes(self, machine: str) -> int: ...

    @property
    def revision(self) -> int:
        """Changes whenever a figure above may have changed (e.g. a learned timing folded in):
        lets callers keep results computed from this object until then."""
        ...


@dataclass
class Estimator:
    """The :class:`CostModel` built from the fleet config, model profiles and learned timings.

    Unknown machines or models get neutral guesses (speed 1.0, 0 weight bytes), so placement
    still works before anything is known; their ranking then falls back to the queue length.
    """

    machines: Mapping[str, MachineProfile] = field(default_factory=dict)
    models: Mapping[str, ModelProfile] = field(default_factory=dict)
    learned: LearnedTimings = field(default_factory=LearnedTimings)
    working: WorkingMemory = field(default_factory=WorkingMemory)  # fleet config coefficients
    _cache: dict[tuple[str, str, str], Timing] = field(default_factory=dict, repr=False, compare=False)
    _cache_version: int = field(default=-1, repr=False, compare=False)

    @property
    def revision(self) -> int:
        """The learned timings' version: the only figures that change in place (profiles and
        machines are replaced with a new Estimator)."""
        return self.learned.version

    def guess(self, machine: str, model_id: str, kind: str) -> Timing:
        """The fleet config's timing for (machine, model, kind), before any measurement."""
        profile = self.machines.get(machine) or MachineProfile(machine)
        model = self.models.get(model_id)
        text = kind == TEXT_KIND
        prompt_s = TEXT_PROMPT_TOKEN_S / profile.speed if text else 0.0
        if model is None:
            return Timing(
                load_s=0.0, step_s=(TEXT_NEW_TOKEN_S if text else DEFAULT_STEP_S) / profile.speed, prompt_s=prompt_s
            )
        if model.step_s is not None:
            base = model.step_s
        else:
            base = TEXT_NEW_TOKEN_S if text else FAMILY_STEP_S.get(model.family, DEFAULT_STEP_S)
        load_bytes = model.weights_bytes if model.load_s is None else model.load_s * REFERENCE_LOAD_BYTES_PER_S
        return Timing(load_s=load_bytes / profile.load_bytes_per_s, step_s=base / profile.speed, prompt_s=prompt_s)

    def work_s(self, model_id: str, kind: str, steps: int, size: int) -> float:
        """Run seconds of a job on a speed-1.0 machine by the fleet config (for routing.demand)."""
        return run_seconds(self.guess("", model_id, kind), steps, size, kind)

    def timing(self, machine: str, model_id: str, kind: str) -> Timing:
        """The learned timing, else the guess (memoised until the next observation)."""
        if self._cache_version != self.learned.version:
            self._cache.clear()
            self._cache_version = self.learned.version
        key = (machine, model_id, kind)
        found = self._cache.get(key)
        if found is None:
            found = self.learned.get(machine, model_id, kind) or self.guess(machine, model_id, kind)
            self._cache[key] = found
        return found

    def load_s(self, machine: str, model_id: str, kind: str) -> float:
        return self.timing(machine, model_id, kind).load_s

    def run_s(self, machine: str, model_id: str, kind: str, steps: int, size: int, batch: int = 1) -> float:
        """Run seconds of ``steps`` steps of a job of ``size`` (``batch`` images) there
        (:func:`routing.timings.run_seconds`)."""
        return run_seconds(self.timing(machine, model_id, kind), steps, size, kind, batch)

    def weights_bytes(self, model_id: str) -> int:
        model = self.models.get(model_id)
        return model.weights_bytes if model else 0

    def reload_s(self, machine: str, model_id: str) -> float:
        """Seconds to load ``model_id`` again on ``machine`` after an eviction: its load time as
        learned under the kind it usually runs (:attr:`ModelProfile.kind`), else the guess."""
        model = self.models.get(model_id)
        return self.load_s(machine, model_id, model.kind if model else "txt2img")

    def job_bytes(self, model_id: str, kind: str, size: int) -> int:
        """Weights + working memory in bytes of a job of ``size`` (pixels x frames x batch);
        0 for an unknown model (placement then has no memory figure to filter on)."""
        return self.memory(model_id, kind, size).total_bytes

    def memory(self, model_id: str, kind: str, size: int) -> MemoryEstimate:
        """The job's estimate in bytes: the model's weights and the working memory that the
        fleet config's coefficients give for its family, ``kind`` and ``size`` (pixels x
        frames x batch); a text job's working memory adds the model's KV cache at its
        ``max_total_tokens`` (:attr:`ModelProfile.kv_cache_bytes`). All zero for an
        unknown model."""
        model = self.models.get(model_id)
        if model is None:
            return MemoryEstimate(0, 0)
        kv_cache = model.kv_cache_bytes if kind == "text" else 0
        return MemoryEstimate(model.weights_bytes, self.working.bytes(model.family, kind, size) + kv_cache)

    def memory_kind(self, machine: str) -> MemoryKind:
        profile = self.machines.get(machine)
        return profile.memory_kind if profile else MemoryKind.unified

    def usable_bytes(self, machine: str) -> int:
        profile = self.machines.get(machine)
        return profile.usable_bytes if profile else 0


__all__ = [
    "GB",
    "CostModel",
    "Estimator",
    "MachineProfile",
    "MemoryEstimate",
    "ModelProfile",
    "WorkingCoefficients",
    "WorkingMemory",
    "job_size",
    "readable_bytes",
    "working_bytes",
]
