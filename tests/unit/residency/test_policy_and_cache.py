"""Residency (R15, C05, C09): the pure policies, the one eviction model placement simulates
with them, and the model cache driving a device (the CUDA and MPS adapters against a fake torch
module: the only fake allowed, no CUDA/MPS device here)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from residency.cache import ModelCache
from residency.errors import ResidencyRefused
from residency.policy import DedicatedPolicy, LoadRequest, UnifiedPolicy, WarmModel, admit
from tasks.devices import CudaDevice, MpsDevice
from tests.helpers import FakePipeline, FakeTorch

MB = 1_000_000


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
    assert torch.calls == [
        "load(A)",
        "free(A)",
        "empty_cache",
        "load(B)",
        "free(B)",
        "empty_cache",
        "load(C)",
        "free(C)",
        "empty_cache",
        "load(A)",
    ]
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


def test_a_pipeline_with_a_stray_adapter_is_dropped_and_the_next_get_loads_it_cold() -> None:
    torch = FakeTorch(100 * MB)
    device = CudaDevice(torch)
    cache = _cache(torch, device)
    cache.get("A", "k", Path("A"), weights_bytes=10 * MB)
    assert cache.drop("A") is True and cache.warm_models() == [] and cache.drop("A") is False
    assert torch.calls[-2:] == ["free(A)", "empty_cache"]
    assert cache.get("A", "k", Path("A"))[2] is True  # cold again


@pytest.mark.parametrize(("adapter", "device"), [(CudaDevice, "cuda"), (MpsDevice, "mps")])
def test_r7_a_pipeline_runs_on_the_device_it_was_loaded_for(adapter: Any, device: str) -> None:
    """Pipelines load on the CPU (tasks.pipelines.load_pipeline); the cache hands out the
    one its device adapter moved onto the GPU, so jobs never run on a CUDA or MPS box's CPU."""
    torch = FakeTorch(100 * MB)
    cache = _cache(torch, adapter(torch))
    pipeline, _load_s, cold = cache.get("A", "k", Path("A"), weights_bytes=10 * MB)
    assert cold and pipeline.device == device
    assert cache.get("A", "k", Path("A"), weights_bytes=10 * MB)[0] is pipeline  # warm: the same, still there


@pytest.mark.parametrize("seed", range(5))
def test_r15_placement_simulates_the_workers_own_eviction(seed: int) -> None:
    """routing.finish prices a queue with ``admit``, which carries out the worker's policy: for any
    warm set, protected set and capacity, it evicts what the policy's plan evicts, in that order."""
    rng = random.Random(seed)
    sizes = {name: rng.randint(1, 40) * MB for name in "abcdefgh"}
    for _ in range(200):
        warm = rng.sample(sorted(sizes), rng.randint(0, 5))
        model = rng.choice([m for m in sizes if m not in warm])
        protected = frozenset(rng.sample(warm, rng.randint(0, len(warm))))
        usable = rng.randint(20, 120) * MB
        kind = rng.choice(["unified", "dedicated"])
        held = [WarmModel(m, m, sizes[m]) for m in warm]
        policy = UnifiedPolicy() if kind == "unified" else DedicatedPolicy()
        plan = policy.plan(held, LoadRequest(model, sizes[model], usable - sum(sizes[m] for m in warm), protected))
        after = list(warm)
        evicted = admit(
            after, model, memory_kind=kind, usable_bytes=usable, protected=protected, weights_bytes=sizes.__getitem__
        )
        if plan.refused is None:
            assert evicted == list(plan.evict)
        else:  # the worker would refuse; the simulation evicts what it may and goes on
            assert evicted == [m for m in warm if m not in protected]
        assert after[-1] == model and not set(evicted) & set(after)
