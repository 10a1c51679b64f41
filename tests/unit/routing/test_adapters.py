"""LoRA adapters in placement: an adapter must be verified on the machine like the
model (R4), and its load onto the warm pipeline is priced on every job that names it (R12)."""

from __future__ import annotations

import pytest

from routing.errors import Refused
from routing.estimate import GB, Estimator, MachineProfile, ModelProfile
from routing.placement import JobRequest, MachineView, dry_run, place
from routing.timings import ADAPTER_KIND, LearnedTimings, Timing

MODEL, ADAPTER = "tiny-sd", "sd-lora"


def view(name: str, verified: set[str], warm: tuple[str, ...] = (MODEL,)) -> MachineView:
    return MachineView(
        name=name, online=True, families=frozenset({"sd1"}), verified_models=frozenset(verified), warm_models=warm
    )


def costs(learned: LearnedTimings | None = None) -> Estimator:
    machines = {
        n: MachineProfile(n, speed=1.0, load_bytes_per_s=rate, usable_bytes=100 * GB)
        for n, rate in (("server", 1 * GB), ("m1", 1 * GB), ("slow", 0.1 * GB))
    }
    models = {
        MODEL: ModelProfile(MODEL, "sd1", 2 * GB, step_s=1.0),
        ADAPTER: ModelProfile(ADAPTER, "sd1", GB // 2, kind=ADAPTER_KIND),
    }
    return Estimator(machines, models, learned or LearnedTimings())


def job(target: str, adapters: tuple[str, ...] = (ADAPTER,)) -> JobRequest:
    return JobRequest(MODEL, "sd1", "txt2img", target, steps=4, size=512 * 512, adapters=adapters)


def test_r4_an_adapter_not_verified_on_the_target_is_refused_like_a_model() -> None:
    fleet = {"m1": view("m1", {MODEL})}
    with pytest.raises(Refused) as caught:
        place(job("m1"), fleet, costs())
    assert caught.value.reason == "model_not_verified"
    assert (
        str(caught.value)
        == f"adapter {ADAPTER!r} is not verified on machine 'm1'; run `homefleet sync m1 {ADAPTER}` first"
    )
    assert place(job("m1", adapters=()), fleet, costs()).machine == "m1"


def test_auto_skips_a_machine_without_the_adapter() -> None:
    fleet = {"m1": view("m1", {MODEL}), "slow": view("slow", {MODEL, ADAPTER})}
    decision = place(job("auto"), fleet, costs())
    assert decision.machine == "slow" and decision.excluded["m1"][0] == "model_not_verified"


def test_r12_the_adapter_load_is_priced_on_a_warm_base_by_its_bytes_then_by_what_was_learned() -> None:
    fleet = {"m1": view("m1", {MODEL, ADAPTER}), "slow": view("slow", {MODEL, ADAPTER})}
    rows = dry_run(job("auto"), fleet, costs())["machines"]
    assert rows["m1"]["cold_load_s"] == 0.0  # the base is warm
    assert rows["m1"]["adapter_load_s"] == pytest.approx(0.5)  # 0.5 GB at 1 GB/s
    assert rows["slow"]["adapter_load_s"] == pytest.approx(5.0)  # at 0.1 GB/s
    plain = dry_run(job("m1", adapters=()), fleet, costs())["machines"]["m1"]
    assert plain["adapter_load_s"] == 0.0
    assert rows["m1"]["finish_s"] == pytest.approx(plain["finish_s"] + 0.5)
    learned = LearnedTimings({("m1", ADAPTER, ADAPTER_KIND): Timing(load_s=0.02, step_s=0.0)})
    assert dry_run(job("m1"), fleet, costs(learned))["machines"]["m1"]["adapter_load_s"] == pytest.approx(0.02)


def test_r10_the_adapters_weights_count_in_the_jobs_memory() -> None:
    machines = {"m1": MachineProfile("m1", usable_bytes=3_200_000_000)}  # the job alone: ~2.9 GB
    models = {
        MODEL: ModelProfile(MODEL, "sd1", 2 * GB, step_s=1.0),
        ADAPTER: ModelProfile(ADAPTER, "sd1", GB // 2, kind=ADAPTER_KIND),
    }
    fleet = {"m1": view("m1", {MODEL, ADAPTER})}
    estimator = Estimator(machines, models)
    assert place(job("m1", adapters=()), fleet, estimator).machine == "m1"
    with pytest.raises(Refused) as caught:
        place(job("m1"), fleet, estimator)
    assert caught.value.reason == "too_large"
