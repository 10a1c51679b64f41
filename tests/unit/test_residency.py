"""Residency (R15, R18, C05, C09): the device adapters against a fake torch module (the only
fake allowed: no CUDA/MPS device here), the pure policies, and the model cache driving them."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from residency.cache import ModelCache, ResidencyRefused
from residency.device import CpuDevice, CudaDevice, MpsDevice, device_for
from residency.policy import DedicatedPolicy, LoadRequest, UnifiedPolicy, WarmModel

ROOT = Path(__file__).resolve().parents[2]
MB = 1_000_000


class FakeTorch:
    """A torch module with ``cuda`` and ``mps`` namespaces: allocations are tracked in bytes,
    the allocator cache keeps freed bytes until ``empty_cache``; every call is recorded."""

    def __init__(self, total_bytes: int) -> None:
        self.total_bytes = total_bytes
        self.live_bytes = 0  # held by live tensors
        self.cached_bytes = 0  # freed but kept by the caching allocator
        self.calls: list[str] = []
        self.fraction: float | None = None
        self.cuda = SimpleNamespace(mem_get_info=self._mem_get_info, empty_cache=self._empty_cache,
                                    memory_allocated=lambda: self.live_bytes)
        self.mps = SimpleNamespace(recommended_max_memory=lambda: self.total_bytes,
                                   driver_allocated_memory=lambda: self.live_bytes + self.cached_bytes,
                                   empty_cache=self._empty_cache,
                                   set_per_process_memory_fraction=self._set_fraction)

    def _mem_get_info(self) -> tuple[int, int]:
        return self.total_bytes - self.live_bytes - self.cached_bytes, self.total_bytes

    def _empty_cache(self) -> None:
        self.calls.append("empty_cache")
        self.cached_bytes = 0

    def _set_fraction(self, fraction: float) -> None:
        self.calls.append(f"set_fraction({fraction})")
        self.fraction = fraction


class FakePipeline:
    """Holds ``nbytes`` of the fake device until it is garbage collected."""

    def __init__(self, torch: FakeTorch, name: str, nbytes: int) -> None:
        self.torch, self.name, self.nbytes = torch, name, nbytes
        torch.calls.append(f"load({name})")
        torch.live_bytes += nbytes

    def to(self, device: str) -> FakePipeline:
        """As a diffusers pipeline's: moves every component onto ``device``."""
        self.device = device
        return self

    def __del__(self) -> None:
        self.torch.calls.append(f"free({self.name})")
        self.torch.live_bytes -= self.nbytes
        self.torch.cached_bytes += self.nbytes


def test_r18_memory_fraction_is_set_only_by_the_mps_adapter() -> None:
    found = subprocess.run(["grep", "-rln", "set_per_process_memory_fraction", "--include=*.py", "--include=*.sh",
                            "app", "tasks", "routing", "residency", "bench"], cwd=ROOT, capture_output=True, text=True)
    assert found.stdout.split() == ["residency/device.py"]
    source = (ROOT / "residency/device.py").read_text()
    calls = [m.start() for m in re.finditer(r"\.set_per_process_memory_fraction\(", source)]
    assert len(calls) == 1 and source.rindex("class MpsDevice", 0, calls[0]) > source.rindex("class CudaDevice")


def test_r18_cuda_guard_sets_no_fraction_and_mps_guard_does() -> None:
    torch = FakeTorch(8 * MB)
    CudaDevice(torch).guard()
    assert torch.fraction is None
    MpsDevice(torch, fraction=0.8).guard()
    assert torch.fraction == 0.8


def test_device_adapters_report_memory() -> None:
    torch = FakeTorch(100 * MB)
    torch.live_bytes, torch.cached_bytes = 30 * MB, 10 * MB
    cuda, mps = device_for("cuda", torch), device_for("mps", torch)
    assert (cuda.memory_kind, cuda.capacity_bytes(), cuda.available_bytes(), cuda.allocated_bytes()) == \
        ("dedicated", 100 * MB, 60 * MB, 30 * MB)
    # MPS: driver-allocated memory includes the allocator's cache.
    assert (mps.memory_kind, mps.capacity_bytes(), mps.available_bytes(), mps.allocated_bytes()) == \
        ("unified", 100 * MB, 60 * MB, 40 * MB)
    cpu = CpuDevice()
    assert cpu.memory_kind == "unified" and 0 < cpu.available_bytes() <= cpu.capacity_bytes()
    with pytest.raises(ValueError, match="cpu, cuda, mps"):
        device_for("tpu", torch)


def _warm(*names: str, size: int = 10 * MB) -> list[WarmModel]:
    return [WarmModel(n, n, size) for n in names]


def test_r15_unified_admits_by_headroom_and_evicts_lru_unprotected() -> None:
    policy = UnifiedPolicy()
    assert policy.plan(_warm("a", "b"), LoadRequest("c", 10 * MB, 15 * MB)).evict == ()
    plan = policy.plan(_warm("a", "b", "c"), LoadRequest("d", 25 * MB, 5 * MB, frozenset({"a"})))
    assert plan.refused is None and plan.evict == ("b", "c")  # a is protected; b before c (LRU)


def test_r15_unified_refuses_a_load_that_needs_a_protected_model() -> None:
    plan = UnifiedPolicy().plan(_warm("a", "b"), LoadRequest("c", 25 * MB, 5 * MB, frozenset({"a"})))
    assert plan.refused == "residency_protected" and plan.evict == ()
    assert "'c'" in plan.message and "(a, 10000000 bytes)" in plan.message


def test_r15_dedicated_keeps_one_checkpoint() -> None:
    assert DedicatedPolicy().plan(_warm("a"), LoadRequest("b", 1, 10**12)).evict == ("a",)


def _cache(torch: FakeTorch, device: Any, **kwargs: Any) -> ModelCache:
    return ModelCache(lambda folder: FakePipeline(torch, folder.name, 10 * MB), device, **kwargs)


def test_c05_dedicated_drops_every_reference_and_empties_the_cache_before_each_load() -> None:
    torch = FakeTorch(100 * MB)
    device = CudaDevice(torch)
    cache = _cache(torch, device)
    baseline = device.allocated_bytes()
    for name in ("A", "B", "C", "A"):  # J1(A), J2(B), J3(C), J4(A)
        cache.get(name, "k", Path(name), weights_bytes=10 * MB)
        assert device.allocated_bytes() == baseline + 10 * MB  # one checkpoint, no creep
    assert torch.calls == ["load(A)", "free(A)", "empty_cache", "load(B)", "free(B)", "empty_cache", "load(C)",
                           "free(C)", "empty_cache", "load(A)"]
    cache.unload()
    assert device.allocated_bytes() == baseline and device.available_bytes() == 100 * MB


def test_c09_no_reload_thrash() -> None:
    torch = FakeTorch(100 * MB)
    cache = _cache(torch, CudaDevice(torch))
    cache.get("A", "k", Path("A"))
    loads = []
    for name in ("B", "B", "B", "A", "B", "A"):
        loads.append(cache.get(name, "k", Path(name))[2])
    assert loads == [True, False, False, True, True, True]
    assert [c for c in torch.calls if c.startswith("load")] == ["load(A)", "load(B)", "load(A)", "load(B)", "load(A)"]


def test_r15_unified_cache_keeps_a_protected_model_and_refuses_to_evict_it() -> None:
    torch = FakeTorch(100 * MB)
    cache = _cache(torch, MpsDevice(torch), capacity_bytes=25 * MB)
    cache.protected = frozenset({"A"})
    for name in ("A", "B", "C"):
        cache.get(name, "k", Path(name), weights_bytes=10 * MB)
    assert cache.warm_models() == ["A", "C"]  # B (LRU, unprotected) evicted for C
    with pytest.raises(ResidencyRefused, match="protected") as refusal:
        cache.get("D", "k", Path("D"), weights_bytes=20 * MB)
    assert refusal.value.reason == "residency_protected" and cache.warm_models() == ["A", "C"]
    cache.get("V", "k", Path("V"))
    assert cache.unload_unprotected(keep="V") == ["C"] and cache.warm_models() == ["A", "V"]  # before video V (R17)


@pytest.mark.parametrize(("adapter", "device"), [(CudaDevice, "cuda"), (MpsDevice, "mps")])
def test_r7_a_pipeline_runs_on_the_device_it_was_loaded_for(adapter: Any, device: str) -> None:
    """Pipelines load on the CPU (tasks.pipelines.load_pipeline); the cache hands out the
    one its device adapter moved onto the GPU, so jobs never run on a CUDA or MPS box's CPU."""
    torch = FakeTorch(100 * MB)
    cache = _cache(torch, adapter(torch))
    pipeline, _load_s, cold = cache.get("A", "k", Path("A"), weights_bytes=10 * MB)
    assert cold and pipeline.device == device
    assert cache.get("A", "k", Path("A"), weights_bytes=10 * MB)[0] is pipeline  # warm: the same, still there

