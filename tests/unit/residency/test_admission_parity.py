"""Placement predicts the worker's evictions with the worker's own admission rule (R12, R15):
``residency.policy.plan_load``, weights plus the job's working memory, used by the worker's
cache (``ModelCache.get``, given the claim's ``working_bytes``) and by ``routing.finish`` (via
``admit``, the working memory from the same cost model that journals it). Both run here on the
same state: warm set, usable bytes, protected models and job."""

from __future__ import annotations

import gc
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from residency.cache import ModelCache
from residency.device import MemoryKind
from residency.errors import ResidencyRefused
from residency.policy import admit
from routing.estimate import Estimator, MachineProfile, ModelProfile, WorkingCoefficients, WorkingMemory
from routing.finish import expected_finish, working_of
from routing.timings import job_size

MB = 1_000_000
SIZE = job_size(64 * 64)


class Cpu:
    """A unified-memory device whose free memory the cache's capacity decides."""

    memory_kind = MemoryKind.unified

    def available_bytes(self) -> int:
        raise AssertionError("the capacity decides")

    def place(self, pipeline: Any) -> Any:
        return pipeline

    def empty_cache(self) -> None:
        pass


def estimator(weights: dict[str, int], usable: int, working: int) -> Estimator:
    return Estimator(
        machines={"m": MachineProfile("m", memory_kind=MemoryKind.unified, usable_bytes=usable)},
        models={m: ModelProfile(m, "sd1", w) for m, w in weights.items()},
        working=WorkingMemory(by_kind={"txt2img": WorkingCoefficients(working, 0.0)}),
    )


def worker_evicts(
    weights: dict[str, int], warm: list[str], usable: int, protected: frozenset[str], model: str, working: int
) -> list[str]:
    """The worker's cache, capped at ``usable``, holding ``warm`` (LRU first), loading ``model``
    for a job whose claim carries ``working`` bytes: the models it evicts."""
    cache = ModelCache(lambda folder: f"pipeline {folder.name}", Cpu(), capacity_bytes=usable)
    for m in warm:
        cache.get(m, "k", Path(m), weights_bytes=weights[m])
    assert cache.warm_models() == warm and cache.loads == len(warm)
    cache.protected = protected
    cache.get(model, "k", Path(model), weights_bytes=weights[model], working_bytes=working)
    return [m for m in warm if m not in cache.warm_models()]


def placement_evicts(
    weights: dict[str, int], warm: list[str], usable: int, protected: frozenset[str], model: str, working: int
) -> list[str]:
    costs = estimator(weights, usable, working)
    assert working_of(costs, model, "txt2img", SIZE) == working  # the claim's figure
    part = expected_finish(
        "m", model, "txt2img", 1, SIZE, warm_models=warm, queue=[], extra_queued=0, protected=protected, costs=costs
    )
    return list(part.evicts)


@pytest.mark.parametrize(("protected", "evicted"), [(frozenset(), ["a"]), (frozenset({"a"}), ["b"])])
def test_r15_the_working_memory_forces_an_eviction_both_predict(protected: frozenset[str], evicted: list[str]) -> None:
    weights = {"a": 30 * MB, "b": 30 * MB, "c": 30 * MB}
    warm, usable, working = ["a", "b"], 100 * MB, 25 * MB  # 90 MB of weights fit; with the job's 25 MB they do not
    assert (
        admit(
            list(warm),
            "c",
            memory_kind="unified",
            usable_bytes=usable,
            protected=protected,
            weights_bytes=weights.__getitem__,
        )
        == []
    )  # weights-only arithmetic: no eviction
    assert worker_evicts(weights, warm, usable, protected, "c", working) == evicted
    assert placement_evicts(weights, warm, usable, protected, "c", working) == evicted


def test_r15_a_queued_jobs_working_memory_is_admitted_too() -> None:
    """Along the queue (``routing.finish.drain``): the queued job of ``c`` evicts ``a`` for its
    working memory, so the new job of ``a`` is a cold load that evicts ``b``."""
    from routing.finish import WorkItem

    weights = {"a": 30 * MB, "b": 30 * MB, "c": 30 * MB}
    costs = estimator(weights, 100 * MB, 25 * MB)
    part = expected_finish(
        "m",
        "a",
        "txt2img",
        1,
        SIZE,
        warm_models=["a", "b"],
        queue=[WorkItem("c", "txt2img", 1, SIZE)],
        extra_queued=0,
        protected=frozenset(),
        costs=costs,
    )
    assert part.cold_load_s > 0 and part.evicts == ("b",)


@pytest.fixture
def frozen_heap() -> Iterator[None]:
    """The cache's eviction runs a full ``gc.collect()`` (``ModelCache._evict``), which scans
    every object of this process: with the session's imports (torch, diffusers) ~0.1 CPU-s each,
    80 CPU-s over the cases below (docs/benchmarks.md, "The test suite"). ``gc.freeze()`` moves
    the objects alive now out of the collector's reach, so each collection scans only the
    test's own; the collection still runs, and the evictions are the same."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.usefixtures("frozen_heap")
def test_r15_worker_and_placement_evict_the_same_models_for_any_state(seed: int) -> None:
    rng = random.Random(seed)
    weights = {name: rng.randint(1, 40) * MB for name in "abcdefgh"}
    checked = refused = 0
    for _ in range(150):
        warm = rng.sample(sorted(weights), rng.randint(0, 4))
        usable = sum(weights[m] for m in warm) + rng.randint(0, 60) * MB
        model = rng.choice([m for m in weights if m not in warm])
        protected = frozenset(rng.sample(warm, rng.randint(0, len(warm))))
        working = rng.randint(0, 50) * MB
        predicted = placement_evicts(weights, warm, usable, protected, model, working)
        try:
            actual = worker_evicts(weights, warm, usable, protected, model, working)
        except ResidencyRefused:  # placement refuses such a job up front (residency_conflict)
            refused += 1
            assert predicted == [m for m in warm if m not in protected]
            continue
        assert predicted == actual, (warm, usable, protected, model, working)
        checked += 1
    assert checked > 50 and refused > 0
