"""Placement rules R9–R13 as pure unit tests (routing/ takes plain data and raises its own refusals)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from app.core.errors import MachineUnavailable, from_core
from app.core.kinds import job_request
from routing.demand import (
    Demand,
    Pressure,
    able_with_pinned,
    pinned_class,
    pressure,
    scarcity_s,
)
from routing.errors import Refused, Unavailable
from routing.estimate import GB, Estimator, MachineProfile, ModelProfile
from routing.finish import EVICTION_WEIGHT, StepReport, WorkItem, remaining_s
from routing.placement import JobRequest, MachineView, dry_run, place
from routing.timings import REFERENCE_SIZE, LearnedTimings, Timing

MODEL = "tiny-sd"
REF = REFERENCE_SIZE


def view(
    name: str,
    *,
    online: bool = True,
    families: set[str] | None = None,
    verified: set[str] | None = None,
    backlog: int = 0,
    queue: tuple[WorkItem, ...] = (),
    warm: tuple[str, ...] = (),
    commitments: frozenset[str] = frozenset(),
    oom: dict[tuple[str, str], int] | None = None,
) -> MachineView:
    return MachineView(
        name=name,
        online=online,
        families=frozenset(families if families is not None else {"sd1", "wan"}),
        verified_models=frozenset(verified if verified is not None else {MODEL, "big", "other", "video"}),
        backlog=backlog or len(queue),
        queue=queue,
        warm_models=warm,
        commitments=commitments,
        oom_sizes=oom or {},
    )


def machines(*views: MachineView) -> dict[str, MachineView]:
    return {v.name: v for v in views}


def request(target: str, model: str = MODEL, kind: str = "txt2img", size: int = REF, steps: int = 10) -> JobRequest:
    family = "wan" if kind == "video" else "sd1"
    return JobRequest(model_id=model, family=family, kind=kind, target=target, steps=steps, size=size)


def costs(**usable: int) -> Estimator:
    """Machines m1..m3 and server (unified unless named 'cuda*'), models of known weight."""
    names = {"server", "m1", "m2", "m3", "cuda1", *usable}
    profiles = {
        n: MachineProfile(
            n,
            speed=1.0,
            load_bytes_per_s=1 * GB,
            memory_kind="dedicated" if n.startswith("cuda") else "unified",
            usable_bytes=usable.get(n, 100 * GB),
        )
        for n in names
    }
    models = {
        MODEL: ModelProfile(MODEL, "sd1", 2 * GB, step_s=1.0),
        "other": ModelProfile("other", "sd1", 10 * GB, step_s=1.0),
        "big": ModelProfile("big", "sd1", 60 * GB, step_s=1.0),
        "video": ModelProfile("video", "wan", 5 * GB, step_s=1.0, kind="video"),
    }
    return Estimator(profiles, models)


def test_r9_default_target_is_server() -> None:
    fleet = machines(view("server", backlog=5), view("m1"))
    assert place(JobRequest(model_id=MODEL, family="sd1", kind="txt2img"), fleet).machine == "server"


def test_r10_explicit_target_is_kept_even_when_busy() -> None:
    fleet = machines(view("server"), view("m1", backlog=9), view("m2"))
    assert place(request("m1"), fleet, costs()).machine == "m1"


def test_r10_unknown_machine_is_refused_naming_it() -> None:
    with pytest.raises(Refused) as refused:
        place(request("nope"), machines(view("server"), view("m1")))
    assert refused.value.reason == "unknown_machine"
    assert "'nope'" in refused.value.message and "m1" in refused.value.message


def test_r10_pinned_offline_machine_is_an_error_even_when_others_are_idle() -> None:
    with pytest.raises(Unavailable) as refused:
        place(request("m1"), machines(view("server"), view("m1", online=False), view("m2")), costs())
    assert isinstance(from_core(refused.value), MachineUnavailable) and from_core(refused.value).status_code == 503
    assert refused.value.reason == "machine_unavailable"
    assert "m1" in refused.value.message


# (target view, request, reason, words the message must hold)
REFUSALS = [
    (view("m1", families={"sdxl"}), request("m1"), "family_not_supported", ["m1", MODEL, "sdxl"]),
    (view("m1", verified=set()), request("m1"), "model_not_verified", ["m1", MODEL, "homefleet sync m1"]),
    (view("m1"), request("m1", model="big"), "too_large", ["m1", "big", "GiB usable"]),
    (
        view("m1", commitments=frozenset({"other"})),
        request("m1", model="big"),
        "residency_conflict",
        ["m1", "committed"],
    ),
    (
        view("cuda1", commitments=frozenset({"other"})),
        request("cuda1"),
        "residency_conflict",
        ["cuda1", "one checkpoint"],
    ),
    (
        view("m1", commitments=frozenset({MODEL})),
        request("m1", model="video", kind="video"),
        "video_on_reserved_machine",
        ["m1", "video", "R17"],
    ),
    (view("m1", oom={(MODEL, "txt2img"): REF}), request("m1"), "remembered_oom", ["m1", "out of memory", str(REF)]),
]


@pytest.mark.parametrize(
    ("target_view", "job", "reason", "words"), REFUSALS, ids=[r[2] + "-" + r[0].name for r in REFUSALS]
)
def test_r10_unsupported_explicit_target_is_refused_with_its_reason(
    target_view: MachineView, job: JobRequest, reason: str, words: list[str]
) -> None:
    estimator = costs(m1=50 * GB)
    with pytest.raises(Refused) as refused:
        place(job, machines(view("server"), target_view), estimator)
    assert refused.value.reason == reason
    for word in words:
        assert word in refused.value.message


def test_r21_remembered_oom_refuses_only_that_size_or_larger() -> None:
    fleet = machines(view("server"), view("m1", oom={(MODEL, "txt2img"): REF}))
    assert place(request("m1", size=REF // 2), fleet, costs()).machine == "m1"
    with pytest.raises(Refused, match="out of memory"):
        place(request("m1", size=REF * 2), fleet, costs())


def test_r11_auto_excludes_each_machine_with_its_named_reason() -> None:
    estimator = costs(m2=62 * GB, m3=50 * GB)
    fleet = machines(
        view("server", online=False),
        view("m1", verified=set()),
        view("m2", commitments=frozenset({"big"})),
        view("m3", families={"sdxl"}),
        view("cuda1"),
    )
    decision = place(request("auto"), fleet, estimator)
    assert decision.machine == "cuda1"
    assert {n: r for n, (r, _) in decision.excluded.items()} == {
        "server": "machine_unavailable",
        "m1": "model_not_verified",
        "m2": "residency_conflict",
        "m3": "family_not_supported",
    }
    big = place(request("auto", model="big"), machines(view("m3"), view("server")), estimator)
    assert big.machine == "server" and big.excluded["m3"][0] == "too_large"
    video = place(
        request("auto", model="video", kind="video"),
        machines(view("m1", commitments=frozenset({MODEL})), view("m2")),
        estimator,
    )
    assert video.machine == "m2" and video.excluded["m1"][0] == "video_on_reserved_machine"
    oom = place(request("auto"), machines(view("m1", oom={(MODEL, "txt2img"): 1}), view("m2", backlog=3)), estimator)
    assert oom.machine == "m2" and oom.excluded["m1"][0] == "remembered_oom"


def test_r11_a_machine_without_the_family_is_refused_for_it_even_when_the_model_is_not_verified_there() -> None:
    # The sync that model_not_verified would suggest is refused for the family: say so first.
    fleet = machines(view("m1", families={"sdxl"}, verified=set()))
    with pytest.raises(Refused) as refused:
        place(request("m1"), fleet)
    assert refused.value.reason == "family_not_supported" and "sync" not in refused.value.message


def test_r11_auto_never_picks_an_offline_or_unverified_machine() -> None:
    fleet = machines(
        view("server", online=False),
        view("m1", verified=set()),
        view("m2", families={"sdxl"}),
        view("m3", backlog=7),
    )
    decision = place(request("auto"), fleet, costs())
    assert decision.machine == "m3"
    assert {n: r for n, (r, _) in decision.excluded.items()} == {
        "server": "machine_unavailable",
        "m1": "model_not_verified",
        "m2": "family_not_supported",
    }


def test_r11_auto_with_no_machine_left_is_refused_with_every_reason() -> None:
    # The offline server could not run the model once back either (family): nothing to wait for.
    with pytest.raises(Refused) as refused:
        place(request("auto"), machines(view("server", online=False, families={"sdxl"}), view("m1", verified=set())))
    assert not isinstance(refused.value, Unavailable)
    assert refused.value.reason == "no_machine"
    # the reason that lasts first: bringing the server back would not help
    assert "server: family_not_supported (and machine_unavailable)" in refused.value.message
    assert "m1: model_not_verified" in refused.value.message


def test_r11_auto_whose_able_machines_are_all_temporarily_out_is_unavailable_naming_each() -> None:
    # Every machine that could run the job is offline, draining or syncing: a 503 to retry (as a
    # pinned target gets, R10), not a 422; m3 can never run it and does not change that.
    fleet = machines(
        view("server", online=False),
        replace(view("m1"), draining=True),
        replace(view("m2"), syncing=True),
        view("m3", verified=set()),
    )
    with pytest.raises(Unavailable) as refused:
        place(request("auto"), fleet, costs())
    error = from_core(refused.value)
    assert isinstance(error, MachineUnavailable) and error.status_code == 503
    assert refused.value.reason == "machine_unavailable"  # mixed reasons
    for named in ("server: machine_unavailable", "m1: machine_draining", "m2: machine_syncing"):
        assert named in refused.value.message
    assert "m3: model_not_verified" in refused.value.message  # the whole picture, after the retryable ones


def test_r11_auto_with_one_shared_temporary_reason_answers_that_reason() -> None:
    fleet = machines(replace(view("server"), draining=True), replace(view("m1"), draining=True))
    with pytest.raises(Unavailable) as refused:
        place(request("auto"), fleet, costs())
    assert refused.value.reason == "machine_draining"


def test_r12_ties_go_to_fewer_queued_then_name() -> None:
    fleet = machines(view("server", backlog=2), view("m2", backlog=1), view("m1", backlog=1))
    assert place(request("auto"), fleet).machine == "m1"


def test_r12_a_warm_model_beats_a_shorter_queue_when_the_load_costs_more() -> None:
    # m1: one 10 s job of the same model ahead, model warm. m2: idle but a 60 s cold load.
    item = WorkItem("big", "txt2img", 10, REF)
    fleet = machines(view("m1", queue=(item,), warm=("big",)), view("m2"))
    decision = place(request("auto", model="big"), fleet, costs())
    assert decision.machine == "m1"
    assert decision.candidates["m1"].cold_load_s == 0 and decision.candidates["m2"].cold_load_s == pytest.approx(60)
    assert decision.candidates["m1"].work_ahead_s == pytest.approx(10)


def test_r12_a_cold_load_counts_only_for_itself_when_its_model_has_recent_demand() -> None:
    # As above, but Auto's demand data says jobs of "big" come and go: the 60 s load also warms
    # m2 for them, so the job is ranked as if the model were warm there (COLD_LOAD_CREDIT).
    item = WorkItem("big", "txt2img", 10, REF)
    fleet = machines(view("m1", queue=(item,), warm=("big",)), view("m2"))
    demand = {m: Pressure(0.0, 0.0, {"big": 0.1}) for m in fleet}
    decision = place(request("auto", model="big"), fleet, costs(), demand)
    assert decision.machine == "m2"
    cold = decision.candidates["m2"]
    assert cold.load_credit_s == pytest.approx(60) and cold.finish_s == pytest.approx(70)
    assert cold.score_s == pytest.approx(10)  # its run alone: the load counts in the finish, not the rank
    # A model without recent demand (its first job): nothing else uses the load, it counts in full.
    other = {m: Pressure(0.0, 0.0, {"other": 0.1}) for m in fleet}
    decision = place(request("auto", model="big"), fleet, costs(), other)
    assert decision.machine == "m1" and decision.candidates["m2"].load_credit_s == 0


def test_r12_equal_scores_go_to_the_earlier_finish() -> None:
    # m2 warm, m1 cold, nothing queued: with the credit both score the run alone; m2 finishes
    # first (the name would have picked m1).
    fleet = machines(view("m2", warm=("big",)), view("m1"))
    demand = {m: Pressure(0.0, 0.0, {"big": 0.1}) for m in fleet}
    decision = place(request("auto", model="big"), fleet, costs(), demand)
    assert decision.candidates["m1"].score_s == pytest.approx(decision.candidates["m2"].score_s)
    assert decision.machine == "m2"


def test_r12_residency_is_simulated_along_the_queue() -> None:
    # The model is not warm now, but a queued job loads it first: only that job pays the load.
    queued = (WorkItem("other", "txt2img", 10, REF),)
    part = place(request("m1", model="other"), machines(view("m1", queue=queued)), costs()).breakdown
    assert part.cold_load_s == 0
    assert part.work_ahead_s == pytest.approx(10 + 10)  # its load (10 GB at 1 GB/s) + 10 steps x 1 s
    # Dedicated memory: a job of another model in between evicts it again.
    between = (WorkItem("other", "txt2img", 10, REF), WorkItem(MODEL, "txt2img", 10, REF))
    part = place(
        request("cuda1", model="other"), machines(view("cuda1", queue=between, warm=("other",))), costs()
    ).breakdown
    assert part.cold_load_s == pytest.approx(10)
    assert part.evicts == (MODEL,) and part.eviction_s == pytest.approx(EVICTION_WEIGHT * 2)


def test_r12_running_job_counts_only_its_remaining_time() -> None:
    running = (WorkItem(MODEL, "txt2img", 10, REF, elapsed_s=4.0),)
    part = place(request("m1"), machines(view("m1", queue=running, warm=(MODEL,))), costs()).breakdown
    assert part.work_ahead_s == pytest.approx(6.0)
    assert part.queued == 1


def test_r12_a_running_job_still_loading_its_model_counts_the_rest_of_its_load() -> None:
    # A worker reports a model warm once loaded: a running job whose model is not warm yet is
    # loading it (2 GB at 1 GB/s), then runs 10 steps of 1 s; 4 s have passed.
    running = (WorkItem(MODEL, "txt2img", 10, REF, elapsed_s=4.0),)
    part = place(request("m1"), machines(view("m1", queue=running)), costs()).breakdown
    assert part.work_ahead_s == pytest.approx(2.0 + 10.0 - 4.0)
    assert part.cold_load_s == 0  # the next job of the same model finds it loaded


def test_r12_a_running_job_s_step_reports_correct_its_estimate_slow_or_fast() -> None:
    """10 steps of 1 s expected. Measured at 3 s a step, 5 steps done, 1 s into the sixth: 14 s
    left (15 - 1), where 4 s past the estimate would have counted 5 % of it (0.5 s). At 0.5 s a
    step: 2.5 s. One step report: the estimate's rate; a step under way for longer than that
    rate is taken as at least that long. Claimed, no step yet: the whole run is ahead."""
    reports = {
        "slow": StepReport(5, 10, since_s=1.0, step_s=3.0),
        "fast": StepReport(5, 10, since_s=0.0, step_s=0.5),
        "once": StepReport(2, 10, since_s=0.5),
        "stuck": StepReport(2, 10, since_s=6.0),
        "claimed": StepReport(0, 0, since_s=14.0),
        "unreported": None,
    }
    ahead = {
        name: place(
            request("m1"),
            machines(
                view("m1", queue=(WorkItem(MODEL, "txt2img", 10, REF, elapsed_s=14.0, report=report),), warm=(MODEL,))
            ),
            costs(),
        ).breakdown.work_ahead_s
        for name, report in reports.items()
    }
    assert ahead == pytest.approx(
        {"slow": 14.0, "fast": 2.5, "once": 7.5, "stuck": 42.0, "claimed": 10.0, "unreported": 0.5}
    )
    assert remaining_s(10.0, 0.0, 14.0, StepReport(10, 10, since_s=0.0, step_s=1.0)) == 0.0  # its last step done
    assert remaining_s(10.0, 2.0, 1.0, StepReport(0, 0, since_s=1.0)) == pytest.approx(11.0)  # loading: the rest of it
    assert remaining_s(10.0, 2.0, 4.0) == pytest.approx(8.0)  # no report: as before, load included
    assert StepReport(3, 10, 1.0, 2.0).aged(0.5) == StepReport(3, 10, 1.5, 2.0)


def test_r12_eviction_of_warm_models_is_charged_at_their_reload_cost() -> None:
    # 30 GB usable: 'other' (10 GB) and tiny-sd (2 GB) are warm; a 25 GB model fits only without 'other'.
    estimator = costs(m1=30 * GB)
    estimator.models = {**estimator.models, "mid": ModelProfile("mid", "sd1", 25 * GB, step_s=1.0)}
    fleet = machines(view("m1", warm=("other", MODEL), verified={"mid"}))
    part = place(request("m1", model="mid"), fleet, estimator).breakdown
    assert part.evicts == ("other",)  # least recently used first, until it fits
    assert part.eviction_s == pytest.approx(EVICTION_WEIGHT * 10)  # its reload: 10 GB at 1 GB/s, weighted
    protected = machines(view("m1", warm=("other", MODEL), verified={"mid"}, commitments=frozenset({"other"})))
    with pytest.raises(Refused) as refused:
        place(request("m1", model="mid"), protected, estimator)
    assert refused.value.reason == "residency_conflict"


def test_r12_auto_prices_an_eviction_by_what_the_evicted_models_jobs_would_lose() -> None:
    # cuda1 holds one checkpoint: a tiny-sd job there evicts the warm one. m1 runs it without
    # evicting anything but 10 s later (queued work); every job takes 10 s (10 steps of 1 s).
    estimator = costs()
    fleet = machines(
        view("cuda1", warm=("other",)), view("m1", warm=(MODEL,), queue=(WorkItem(MODEL, "txt2img", 10, REF),))
    )
    demand = Demand()
    for i in range(20):  # 'other' is in demand: jobs of 100 s (speed-1.0 seconds)
        demand.add("other", 100.0, now_s=float(i))
    weights = pressure(demand.rates(20.0), {"other": frozenset({"cuda1", "m1"})}, {"cuda1": 1.0, "m1": 1.0})
    assert weights["cuda1"].reload_weight == {"other": pytest.approx(1 / 100)}
    job = request("auto", steps=10)
    # Without demand data the reload is charged at EVICTION_WEIGHT x 10 s: cuda1 (12 s + 30 s) loses to m1 (20 s).
    assert place(job, fleet, estimator).machine == "m1"
    part = place(job, fleet, estimator, weights).candidates["cuda1"]
    # Priced in the 100 s jobs' slowdown: 10 s of reload is a tenth of one, worth 1 s of a 10 s job, weighted.
    assert part.evicts == ("other",) and part.eviction_s == pytest.approx(EVICTION_WEIGHT * 10 * 10 / 100)
    idle = pressure(Demand().rates(20.0), {}, {"cuda1": 1.0, "m1": 1.0})
    nobody = place(job, fleet, estimator, idle)
    assert nobody.candidates["cuda1"].eviction_s == 0  # a model nobody asked for lately costs nothing to evict
    assert nobody.machine == "cuda1"  # 2 s load + 10 s run beats waiting 10 s on m1


def test_r13_an_evicted_model_is_priced_at_its_own_learned_reload() -> None:
    # cuda1 holds the video model; a txt2img job evicts it. Its reload was measured under its
    # own kind (video): 40 s, not the 5 s its weights would take at 1 GB/s.
    estimator = costs()
    estimator.learned = LearnedTimings({("cuda1", "video", "video"): Timing(load_s=40.0, step_s=1.0)})
    assert estimator.reload_s("cuda1", "video") == 40.0 and estimator.reload_s("m1", "video") == 5.0
    part = place(request("cuda1"), machines(view("cuda1", warm=("video",))), estimator).breakdown
    assert part.evicts == ("video",) and part.eviction_s == pytest.approx(EVICTION_WEIGHT * 40.0)


def test_r12_auto_keeps_flexible_work_off_the_only_home_of_a_busy_model() -> None:
    # 'big' fits only the server; recent demand for it keeps the server busy.
    demand = Demand()
    for i in range(50):
        demand.add("big", 300.0, now_s=float(i))
    rates = demand.rates(50.0)
    weights = pressure(rates, {"big": frozenset({"server"})}, {"server": 1.0, "m1": 1.0})
    assert weights["server"].utilisation > 0.5 and weights["m1"] == Pressure(0.0, 0.0)
    fleet = machines(view("server", warm=(MODEL,)), view("m1"))
    job = request("auto", steps=30)  # 30 s on either machine; m1 adds a 2 s cold load
    assert place(job, fleet, costs()).machine == "server"  # warm, no charge: finishes first
    decision = place(job, fleet, costs(), weights)
    assert decision.machine == "m1"
    assert decision.candidates["server"].scarcity_s > 0 == decision.candidates["m1"].scarcity_s
    assert scarcity_s(30.0, weights["server"], 30.0) == pytest.approx(decision.candidates["server"].scarcity_s)


def test_r12_dry_run_lists_every_machine_with_its_reason_or_breakdown() -> None:
    fleet = machines(view("server", online=False), view("m1", verified=set()), view("m2"), view("m3", backlog=2))
    body = dry_run(request("auto"), fleet, costs())
    assert body["machine"] == "m2"
    rows = body["machines"]
    assert isinstance(rows, dict) and set(rows) == {"server", "m1", "m2", "m3"}
    assert rows["server"]["reason"] == "machine_unavailable" and rows["m1"]["reason"] == "model_not_verified"
    assert rows["m3"]["eligible"] and rows["m3"]["work_ahead_s"] > 0
    assert set(rows["m2"]) >= {"finish_s", "work_ahead_s", "cold_load_s", "run_s", "eviction_s", "queued"}
    refused = dry_run(request("m1"), fleet, costs())
    assert refused["machine"] is None and refused["error"]["reason"] == "model_not_verified"  # type: ignore[index]


def test_r13_learned_timings_replace_the_guess_then_follow_an_ema() -> None:
    learned = LearnedTimings()
    estimator = costs()
    estimator.learned = learned
    guess = estimator.guess("m1", MODEL, "txt2img")
    assert guess == Timing(load_s=2.0, step_s=1.0)
    learned.observe("m1", MODEL, "txt2img", guess=guess, run_s=20.0, steps=10, size=REF, load_s=5.0)
    assert estimator.timing("m1", MODEL, "txt2img") == Timing(
        load_s=5.0, step_s=2.0, samples=1, load_samples=1, anchor_size=REF, anchor_step_s=2.0
    )
    learned.observe("m1", MODEL, "txt2img", guess=guess, run_s=6.0, steps=10, size=REF * 3 // 4)  # warm: load kept
    after = estimator.timing("m1", MODEL, "txt2img")
    assert after.load_s == 5.0 and after.step_s == pytest.approx(0.7 * 2.0 + 0.3 * 0.8) and after.samples == 2
    assert estimator.run_s("m1", MODEL, "txt2img", 10, REF) == pytest.approx(10 * after.step_s)
    learned.observe("m1", MODEL, "txt2img", guess=guess, run_s=6.0, steps=10, size=REF * 3 // 4, load_s=9.0)
    assert estimator.timing("m1", MODEL, "txt2img").load_s == pytest.approx(0.7 * 5.0 + 0.3 * 9.0)  # EMA from now on


def test_r13_two_large_misses_in_a_row_replace_the_figure_one_is_folded_in() -> None:
    """A machine that becomes 100x slower (a GPU fallen back to its CPU) and is then repaired:
    the moving average alone took a dozen runs to follow the repair, while Auto sends no job to a
    machine priced 100x too slow to learn from. Two runs in a row more than SHIFT_RATIO off
    the estimate, the same way, make the latest run the figure; one alone (an outlier) moves it
    by EMA_WEIGHT only, and a run within the ratio ends the streak."""
    from routing.timings import EMA_WEIGHT, SHIFT_RATIO, run_seconds

    learned = LearnedTimings()
    guess = Timing(load_s=2.0, step_s=1.0)

    def run(run_s: float) -> Timing:
        return learned.observe("m1", MODEL, "txt2img", guess=guess, run_s=run_s, steps=27, size=REF)

    assert run_seconds(run(5.4), 27, REF) == pytest.approx(5.4)  # the first run replaces the guess
    outlier = run(600.0)  # the machine busy with something else once
    assert run_seconds(outlier, 27, REF) == pytest.approx((1 - EMA_WEIGHT) * 5.4 + EMA_WEIGHT * 600.0)
    assert outlier.misses == 1
    assert run(600.0).misses == 0 and run_seconds(learned.get("m1", MODEL, "txt2img"), 27, REF) == pytest.approx(600.0)
    repaired = run(5.4)
    assert repaired.misses == -1 and run_seconds(repaired, 27, REF) > 400.0  # one fast run: folded in
    assert run_seconds(run(5.4), 27, REF) == pytest.approx(5.4)  # the second: the figure again
    # a large miss, then a run within the ratio of the new estimate: the streak ends, nothing replaced
    assert run(5.4 * SHIFT_RATIO * 1.2).misses == 1
    kept = run(5.4 * SHIFT_RATIO)
    assert kept.misses == 0 and run_seconds(kept, 27, REF) < 5.4 * SHIFT_RATIO
    assert learned.get("m1", MODEL, "txt2img").samples == 7


def test_r13_small_images_neither_move_nor_replace_a_figure_learned_at_a_scaling_size() -> None:
    """Thumbnails beside full-size jobs (a user pass, the tiny sd1 pipeline on CPU): a 30-step
    256x256 job ran 45 s, then two 3-step 64x64 ones 0.3 and 0.5 s. A 64x64 step costs a
    256x256 step at most (MIN_SCALED_SIZE), here a tenth of it: the two counted as large misses
    and the next 256x256 job was priced 2.7 s (it ran 38 s). They now leave the figure alone;
    and a figure taught by small images only is replaced by the first run at a scaling size
    (the README's 4-step 64x64 job, then a 256x256 one priced 1.6 s that ran 135 s)."""
    from routing.timings import MIN_SCALED_SIZE, run_seconds

    learned, guess = LearnedTimings(), Timing(load_s=1.0, step_s=1.0)

    def run(run_s: float, steps: int, side: int) -> Timing:
        return learned.observe("m", "x", "txt2img", guess=guess, run_s=run_s, steps=steps, size=side * side)

    full = run(45.0, 30, 256)
    for run_s in (0.3, 0.5, 0.4):
        thumbnail = run(run_s, 3, 64)
        assert thumbnail.step_s == full.step_s and thumbnail.misses == 0 and thumbnail.samples == 1
    assert run_seconds(thumbnail, 30, MIN_SCALED_SIZE) == pytest.approx(45.0)
    assert run_seconds(run(40.0, 30, 256), 30, MIN_SCALED_SIZE) == pytest.approx(0.7 * 45.0 + 0.3 * 40.0)

    fresh = LearnedTimings()
    fresh.observe("m", "x", "txt2img", guess=guess, run_s=0.4, steps=4, size=64 * 64)  # replaces the guess
    taught = fresh.observe("m", "x", "txt2img", guess=guess, run_s=135.0, steps=30, size=256 * 256)
    assert run_seconds(taught, 30, 256 * 256) == pytest.approx(135.0) and taught.misses == 0


def test_r13_thumbnails_price_thumbnails_and_only_floor_the_larger_sizes() -> None:
    """A machine that has run only 3-step 64x64 jobs (0.15 s each; a user pass): before, its
    figure came from them, priced as 256x256 steps, so a 30-step 256x256 job there was priced
    1.6 s (it ran 29 s) and Auto piled such jobs on it while a measured machine sat idle; and a
    thumbnail was priced as a 256x256 step, 7.2 s against 0.14 s. Thumbnails now have their own
    figure; for larger images they only raise the guess, never lower it."""
    from routing.timings import MIN_SCALED_SIZE, run_seconds

    learned, guess = LearnedTimings(), Timing(load_s=3.0, step_s=25.0 * 16)  # 25 s a 256x256 step
    for run_s in (0.15, 0.18):
        thumbs = learned.observe("m", "x", "txt2img", guess=guess, run_s=run_s, steps=3, size=64 * 64)
    assert run_seconds(thumbs, 3, 64 * 64) == pytest.approx(3 * (0.7 * 0.05 + 0.3 * 0.06))  # their own figure
    assert run_seconds(thumbs, 30, 256 * 256) == pytest.approx(30 * 25.0)  # still the guess, not 1.6 s
    assert run_seconds(thumbs, 2, 4 * 64 * 64, batch=4) == pytest.approx(4 * run_seconds(thumbs, 2, 64 * 64))
    cheap = Timing(load_s=3.0, step_s=0.01)  # a guess far too low: a thumbnail's step is a floor
    floored = LearnedTimings().observe("m", "x", "txt2img", guess=cheap, run_s=3.0, steps=3, size=64 * 64)
    assert run_seconds(floored, 1, MIN_SCALED_SIZE) == pytest.approx(1.0)
    big = learned.observe("m", "x", "txt2img", guess=guess, run_s=29.0, steps=30, size=256 * 256)
    assert run_seconds(big, 30, 256 * 256) == pytest.approx(29.0)  # the first measured run at that size: the figure
    assert run_seconds(big, 3, 64 * 64) == pytest.approx(run_seconds(thumbs, 3, 64 * 64))  # thumbnails' kept


def test_r13_a_text_timing_rescales_after_two_large_misses() -> None:
    """Text timings (per new token and per prompt token): two runs in a row more than SHIFT_RATIO
    slower scale both figures to the latest run, as the first run scales the guess."""
    from routing.timings import run_seconds

    learned = LearnedTimings()
    guess = Timing(load_s=0.0, step_s=0.01, prompt_s=0.001)
    learned.observe("m", "gpt", "text", guess=guess, run_s=0.5, steps=40, size=100)  # 0.01 s x 40 + 0.001 x 100 = 0.5
    first = learned.observe("m", "gpt", "text", guess=guess, run_s=50.0, steps=40, size=100)
    assert first.misses == 1 and run_seconds(first, 40, 100, "text") < 40.0
    second = learned.observe("m", "gpt", "text", guess=guess, run_s=50.0, steps=40, size=100)
    assert second.misses == 0 and run_seconds(second, 40, 100, "text") == pytest.approx(50.0)
    assert second.step_s / second.prompt_s == pytest.approx(first.step_s / first.prompt_s, rel=0.02)


def test_r13_the_first_cold_load_replaces_the_guessed_load_even_after_warm_runs() -> None:
    """A model already warm when timings began: its first runs measure steps only, and the
    guessed load time must not then be averaged with the first real load as if measured."""
    learned = LearnedTimings()
    estimator = costs()
    estimator.learned = learned
    guess = estimator.guess("m1", MODEL, "txt2img")
    for _ in range(3):
        learned.observe("m1", MODEL, "txt2img", guess=guess, run_s=10.0, steps=10, size=REF)  # warm
    assert estimator.timing("m1", MODEL, "txt2img").load_s == guess.load_s  # still the guess, not measured
    learned.observe("m1", MODEL, "txt2img", guess=guess, run_s=10.0, steps=10, size=REF, load_s=30.0)
    measured = estimator.timing("m1", MODEL, "txt2img")
    assert (measured.load_s, measured.load_samples, measured.samples) == (30.0, 1, 4)


def test_r12_pinned_demand_weighs_only_on_its_machine() -> None:
    demand = Demand()
    demand.add(MODEL, 20.0, now_s=0.0)
    demand.add(pinned_class(MODEL, "m1"), 20.0, now_s=0.0)
    rates = demand.rates(0.0)
    able = able_with_pinned({MODEL: frozenset({"m1", "m2"})}, rates)
    assert able[pinned_class(MODEL, "m1")] == frozenset({"m1"})
    weights = pressure(rates, able, {"m1": 1.0, "m2": 1.0})
    # The flexible job is shared half and half; the pinned one lands on m1 alone.
    assert weights["m1"].utilisation == pytest.approx(3 * weights["m2"].utilisation)
    # A flexible job suffers half of a delay on either machine (it can take the other one):
    # m2 gets 0.5 x 0.5 of its rate, m1 the same plus all of the pinned rate.
    assert weights["m1"].weight_per_s == pytest.approx(5 * weights["m2"].weight_per_s)


def test_r6_a_syncing_machine_is_refused_when_pinned_and_skipped_by_auto() -> None:
    syncing = MachineView(
        name="m1", online=True, families=frozenset({"sd1"}), verified_models=frozenset({MODEL}), syncing=True
    )
    fleet = machines(view("server", backlog=3), syncing)
    with pytest.raises(Unavailable) as refused:  # temporary, like an offline or draining machine: 503
        place(request("m1"), fleet)
    assert refused.value.reason == "machine_syncing" and "'m1'" in refused.value.message
    placed = place(request("auto"), fleet)
    assert placed.machine == "server" and {m: r for m, (r, _) in placed.excluded.items()} == {"m1": "machine_syncing"}


def test_r4_a_model_present_but_not_advertised_is_refused_when_pinned_and_skipped_by_auto() -> None:
    fleet = machines(view("server", backlog=3), view("m1", verified=set()))
    with pytest.raises(Refused) as refused:
        place(request("m1"), fleet)
    assert refused.value.reason == "model_not_verified" and "homefleet sync m1 tiny-sd" in refused.value.message
    placed = place(request("auto"), fleet)
    assert placed.machine == "server" and {m: r for m, (r, _) in placed.excluded.items()} == {
        "m1": "model_not_verified"
    }


def test_r10_video_is_priced_by_its_frames() -> None:
    one = job_request("v", "animatediff", "video", "server", {"width": 64, "height": 64, "frames": 1})
    eight = job_request("v", "animatediff", "video", "server", {"width": 64, "height": 64})
    sixteen = job_request("v", "animatediff", "video", "server", {"width": 64, "height": 64, "frames": 16})
    assert (one.size, eight.size, sixteen.size) == (4096, 8 * 4096, 16 * 4096)  # the kind's default is 8 frames


def _pressure_per_machine(
    rates: dict[str, tuple[float, float]], able: dict[str, frozenset[str]], speed: dict[str, float]
) -> dict[str, tuple[float, float, dict[str, float]]]:
    """routing.demand.pressure's definition, machine by machine (no grouping)."""
    load, weight = dict.fromkeys(speed, 0.0), dict.fromkeys(speed, 0.0)
    reload: dict[str, dict[str, float]] = {m: {} for m in speed}
    per_model: dict[str, list[float]] = {}
    for name, (work_rate, job_rate) in rates.items():
        machines = [m for m in able.get(name, frozenset()) if m in speed]
        model = name.partition("@")[0]
        pool = [m for m in able.get(model, frozenset()) if m in speed] or machines
        if not machines or job_rate <= 0:
            continue
        total = sum(speed[m] for m in machines)
        fastest_s = work_rate / job_rate / max(speed[m] for m in pool)
        jobs = per_model.setdefault(model, [0.0, 0.0])
        jobs[0] += job_rate
        jobs[1] += job_rate * fastest_s
        for m in machines:
            load[m] += work_rate / total
            weight[m] += job_rate * speed[m] / total / max(fastest_s, 10.0) / len(machines)
    for model, (jobs_per_s, fastest_work) in per_model.items():
        for m in able.get(model, frozenset()):
            if m in speed:
                reload[m][model] = 1.0 / max(fastest_work / jobs_per_s, 10.0)
    return {m: (min(load[m], 0.95), weight[m], reload[m]) for m in speed}


@pytest.mark.parametrize("seed", range(20))
def test_r12_grouped_pressure_equals_the_per_machine_definition(seed: int) -> None:
    """pressure() works per group of machines able to take the same demand classes; on random
    fleets, demand and pinned classes it must give every machine what the definition gives."""
    import random

    rng = random.Random(seed)
    speed = {f"m{i}": rng.choice([0.45, 0.7, 1.0, 3.0]) for i in range(rng.randint(1, 40))}
    models = [f"model{i}" for i in range(rng.randint(1, 6))]
    names = [*speed, "gone"]  # a machine able in the able sets but not online (no speed)
    able = {m: frozenset(rng.sample(names, rng.randint(0, len(names)))) for m in models}
    demand = Demand()
    for i in range(rng.randint(0, 60)):
        model = rng.choice([*models, "unknown"])
        name = pinned_class(model, rng.choice(names)) if rng.random() < 0.3 else model
        demand.add(name, rng.uniform(1, 400), now_s=float(i))
    rates = demand.rates(60.0)
    able = able_with_pinned(able, rates)
    got = pressure(rates, able, speed)
    want = _pressure_per_machine(rates, able, speed)
    assert set(got) == set(want) == set(speed)
    for m, (load, weight, reload) in want.items():
        assert got[m].utilisation == pytest.approx(load)
        assert got[m].weight_per_s == pytest.approx(weight)
        assert dict(got[m].reload_weight) == pytest.approx(reload)


def test_r13_a_tiny_job_teaches_a_step_no_dearer_than_a_small_one() -> None:
    """An 8x8 and a 64x64 job whose steps took about the same time (fixed per-step work
    dominates tiny images) teach about the same step_s; scaling purely by pixels made the 8x8
    one 36 times dearer, and Auto shunned that machine (new-user pass). From 256x256 up, run
    time scales with pixels."""
    from routing.timings import MIN_SCALED_SIZE, LearnedTimings, Timing, run_seconds

    guess = Timing(load_s=1.0, step_s=1.0)
    tiny = LearnedTimings().observe("m", "x", "txt2img", guess=guess, run_s=0.30 * 10, steps=10, size=8 * 8)
    small = LearnedTimings().observe("m", "x", "txt2img", guess=guess, run_s=0.54 * 10, steps=10, size=64 * 64)
    assert 0.5 < tiny.step_s / small.step_s < 1.0
    assert run_seconds(small, 10, 8 * 8) == run_seconds(small, 10, MIN_SCALED_SIZE) == pytest.approx(5.4)
    assert run_seconds(small, 10, 4 * MIN_SCALED_SIZE) == pytest.approx(4 * 5.4)


def test_r13_two_runs_of_sizes_far_apart_teach_how_a_step_grows_with_the_size() -> None:
    """A step's seconds grow with the size to a learned power: a 256x256 and a 1024x1024 run of
    one model whose steps took 0.1 s and 3.2 s teach 1.25 (32x for 16x the pixels), and a
    512x512 job is then priced between them; linear pricing said 1.6 s at 1024x1024, half the
    truth (the tiny sd1 pipeline on the 2-core host: 1.63 and 21.6 s a step at 256x256 and
    512x512, 13x for 4x the pixels)."""
    from routing.timings import MIN_SCALED_SIZE, LearnedTimings, Timing, run_seconds

    learned, guess = LearnedTimings(), Timing(load_s=1.0, step_s=1.0)
    small = learned.observe("m", "x", "txt2img", guess=guess, run_s=0.1 * 10, steps=10, size=MIN_SCALED_SIZE)
    assert (small.size_exp, small.size_samples, small.anchor_size) == (1.0, 0, MIN_SCALED_SIZE)
    assert run_seconds(small, 10, REF) == pytest.approx(16 * 1.0)  # linear until taught otherwise
    large = learned.observe("m", "x", "txt2img", guess=guess, run_s=3.2 * 10, steps=10, size=REF)
    assert (large.size_exp, large.size_samples) == (pytest.approx(1.25), 1)
    assert run_seconds(large, 10, REF) == pytest.approx(0.7 * 32.0 + 0.3 * 32.0)  # step_s re-based on 1.25
    assert run_seconds(large, 10, 512 * 512) == pytest.approx(32.0 / 4**1.25)
    # a later pair is folded in with the EMA; the pair's exponent is bounded
    again = learned.observe("m", "x", "txt2img", guess=guess, run_s=3.2 * 0.25**1.25 * 10, steps=10, size=REF // 4)
    assert again.size_exp == pytest.approx(1.25) and again.size_samples == 2
    wild = LearnedTimings()
    wild.observe("m", "x", "txt2img", guess=guess, run_s=1.0, steps=10, size=MIN_SCALED_SIZE)
    bounded = wild.observe("m", "x", "txt2img", guess=guess, run_s=10_000.0, steps=10, size=REF)
    assert bounded.size_exp == 2.5  # a run slowed by something else cannot make it absurd


def test_r13_images_under_the_least_scaled_size_and_batches_teach_no_exponent() -> None:
    """A 64x64 step costs what a 256x256 one does (fixed costs), so it cannot teach how steps
    grow (the tiny sdxl pipeline: 0.05 s at 64x64, 20.7 s at 512x512, learned the bound 2.5 and
    priced the next 512x512 job at a third of its time); a batch of four 256x256 images costs
    four images, not one image of four times the pixels, before and after an exponent is learned."""
    from routing.timings import MIN_SCALED_SIZE, LearnedTimings, Timing, run_seconds

    learned, guess = LearnedTimings(), Timing(load_s=1.0, step_s=1.0)
    learned.observe("m", "x", "txt2img", guess=guess, run_s=0.05 * 2, steps=2, size=64 * 64)
    big = learned.observe("m", "x", "txt2img", guess=guess, run_s=20.7 * 2, steps=2, size=512 * 512)
    assert (big.size_exp, big.size_samples, big.anchor_size) == (1.0, 0, 512 * 512)  # the 64x64 run set no anchor
    one = learned.observe("m", "x", "txt2img", guess=guess, run_s=2.0, steps=2, size=MIN_SCALED_SIZE)
    four = learned.observe("m", "x", "txt2img", guess=guess, run_s=8.0, steps=2, size=4 * MIN_SCALED_SIZE, batch=4)
    assert one.size_samples == 1 and four.size_samples == 1  # n = 1 and n = 4 of one image size: no pair
    taught = four.size_exp
    assert taught != 1.0
    assert run_seconds(four, 2, 4 * MIN_SCALED_SIZE, batch=4) == pytest.approx(
        4 * run_seconds(four, 2, MIN_SCALED_SIZE)
    )
    # the one-image reading of that size would follow the exponent instead
    assert run_seconds(four, 2, 4 * MIN_SCALED_SIZE) == pytest.approx(run_seconds(four, 2, MIN_SCALED_SIZE) * 4**taught)


def test_r13_sizes_closer_than_twice_apart_leave_pricing_linear_to_the_last_bit() -> None:
    """768x768 beside 1024x1024 (1.8x) teaches no exponent: noise would decide it. Every figure
    is then the float linear pricing gave (the placement benchmark's jobs are such)."""
    from routing.timings import LearnedTimings, Timing, run_seconds

    learned, guess = LearnedTimings(), Timing(load_s=1.0, step_s=0.7)
    for size, run_s in ((REF, 31.7), (768 * 768, 13.1), (REF, 29.3), (768 * 768, 19.9)):
        timing = learned.observe("m", "x", "txt2img", guess=guess, run_s=run_s, steps=30, size=size)
    assert (timing.size_exp, timing.size_samples, timing.anchor_size) == (1.0, 0, 768 * 768)
    linear = Timing(timing.load_s, timing.step_s, timing.samples)
    for size in (768 * 768, REF, 2048 * 2048):
        assert run_seconds(timing, 30, size) == run_seconds(linear, 30, size) == timing.step_s * 30 * size / REF


def test_text_timings_are_per_token_and_learned_from_two_jobs():
    """A text job is priced step_s per new token + prompt_s per prompt token; the first
    finished job scales the guess to its measurement, the second moves both figures along its
    token counts (normalised LMS, weight EMA_WEIGHT)."""
    from routing.estimate import (
        TEXT_NEW_TOKEN_S,
        TEXT_PROMPT_TOKEN_S,
        Estimator,
        MachineProfile,
    )
    from routing.timings import EMA_WEIGHT, LearnedTimings, run_seconds

    estimator = Estimator(machines={"m": MachineProfile("m", speed=2.0)})
    guess = estimator.guess("m", "tiny-llama", "text")
    assert (guess.step_s, guess.prompt_s) == (TEXT_NEW_TOKEN_S / 2, TEXT_PROMPT_TOKEN_S / 2)
    assert estimator.run_s("m", "tiny-llama", "text", 100, 20) == pytest.approx(100 * 0.025 + 20 * 0.0025)

    learned = estimator.learned
    assert isinstance(learned, LearnedTimings)
    # job 1: 10 new tokens after 100 prompt tokens in 1.0 s; the guess said 10*0.025 + 100*0.0025 = 0.5 s
    first = learned.observe("m", "tiny-llama", "text", guess=guess, run_s=1.0, steps=10, size=100)
    assert (first.step_s, first.prompt_s, first.samples) == (pytest.approx(0.05), pytest.approx(0.005), 1)
    assert run_seconds(first, 10, 100, "text") == pytest.approx(1.0)
    # job 2: 40 new tokens after 10 prompt tokens in 3.0 s; estimate 40*0.05 + 10*0.005 = 2.05 s
    second = learned.observe("m", "tiny-llama", "text", guess=guess, run_s=3.0, steps=40, size=10)
    gain = EMA_WEIGHT * (3.0 - 2.05) / (40 * 40 + 10 * 10)
    assert second.step_s == pytest.approx(0.05 + gain * 40) == pytest.approx(0.0567059, abs=1e-7)
    assert second.prompt_s == pytest.approx(0.005 + gain * 10) == pytest.approx(0.0066765, abs=1e-7)
    assert second.samples == 2
    # the estimator reads the learned figures: 64 new tokens after 8 prompt tokens
    assert estimator.run_s("m", "tiny-llama", "text", 64, 8) == pytest.approx(64 * second.step_s + 8 * second.prompt_s)
    assert estimator.run_s("m", "tiny-llama", "text", 128, 8) > 1.9 * estimator.run_s("m", "tiny-llama", "text", 64, 8)
    # image kinds are unchanged by the text rule
    assert learned.get("m", "tiny-llama", "txt2img") is None


def test_a_text_timing_fitted_to_fast_runs_keeps_a_positive_price_per_prompt_token():
    """A CI flake: runs much faster than their estimate, with long prompts,
    once drove prompt_s to 0 (clamped LMS), so a longer prompt was priced as free. One job now
    takes at most half of a figure away: it shrinks geometrically, stays > 0, and a slower run
    brings it back."""
    from routing.timings import TOKEN_FIT_KEEP, LearnedTimings, Timing, run_seconds

    learned = LearnedTimings()
    guess = Timing(load_s=0.0, step_s=0.01, prompt_s=0.01)
    learned.observe("m", "gpt", "text", guess=guess, run_s=0.2, steps=10, size=10)  # first: scales the guess
    before = learned.get("m", "gpt", "text")
    assert before is not None and before.prompt_s == pytest.approx(0.01)
    for _ in range(20):  # 20 runs that took nothing at all, 5 new tokens after 200 prompt tokens
        after = learned.observe("m", "gpt", "text", guess=guess, run_s=0.0, steps=5, size=200)
    assert 0 < after.prompt_s <= before.prompt_s * TOKEN_FIT_KEEP
    assert 0 < after.step_s <= before.step_s
    assert run_seconds(after, 4, 10, "text") > run_seconds(after, 4, 5, "text")  # more prompt costs more
    slower = learned.observe("m", "gpt", "text", guess=guess, run_s=1.0, steps=5, size=200)
    assert slower.prompt_s > after.prompt_s and slower.step_s > after.step_s


@pytest.mark.parametrize(
    ("count", "text"),
    [
        (0, "0 B"),
        (512, "512 B"),
        (3_556_000, "3.4 MiB"),
        (1024**2, "1.0 MiB"),
        (12 * 1024**3 + 5, "12 GiB"),
        (130 * 1024**3, "130 GiB"),
        (9.96 * 1024**2, "10 MiB"),
        (2_000_000_000, "1.9 GiB"),
    ],
)
def test_memory_figures_read_in_binary_units_with_two_significant_digits(count: int, text: str) -> None:
    from routing.estimate import readable_bytes

    assert readable_bytes(count) == text


def test_r9_the_default_target_is_assumed_to_get_a_share_of_each_models_demand() -> None:
    from routing.demand import DEFAULT_PRIOR_JOBS, DEFAULT_SHARE, with_default_share

    demand = Demand()
    demand.add(MODEL, 100.0, now_s=0.0)
    demand.add(pinned_class(MODEL, "m1"), 100.0, now_s=0.0)
    demand.add("big", 50.0, now_s=0.0)
    demand.add(pinned_class("big", "server"), 50.0, now_s=0.0)  # more than the share: kept as recorded
    rates = demand.rates(0.0)
    got = with_default_share(rates, "server")
    # DEFAULT_SHARE of the model's demand over all its classes (Auto and pinned alike), faded by
    # the 4 jobs recorded: worth DEFAULT_PRIOR_JOBS jobs against them.
    share = DEFAULT_SHARE * DEFAULT_PRIOR_JOBS / (DEFAULT_PRIOR_JOBS + 4)
    work, jobs = rates[MODEL][0] + rates[pinned_class(MODEL, "m1")][0], 2 * rates[MODEL][1]
    assert got[pinned_class(MODEL, "server")] == pytest.approx((share * work, share * jobs))
    assert got[pinned_class("big", "server")] == rates[pinned_class("big", "server")]
    assert {k: v for k, v in got.items() if k in rates} == rates  # the recorded classes unchanged
    assert with_default_share(rates, "server", share=0.0) == rates
    # The prior fades as jobs are recorded that never name the default target.
    for i in range(600):
        demand.add(MODEL, 100.0, now_s=float(i))
    many = demand.rates(600.0)
    faded = with_default_share(many, "server")[pinned_class(MODEL, "server")][1] / many[MODEL][1]
    assert faded < DEFAULT_SHARE / 10


def test_r12_a_long_job_avoids_the_default_target_before_any_default_job_is_recorded() -> None:
    """The server is warm for a long video and m1, as fast, is cold: without a prior the video
    goes to the server, and the short jobs that name no target (R9) wait behind it there.
    Auto assumes the server gets a share of the recorded demand pinned there
    (routing.demand.DEFAULT_SHARE), so the video goes to m1."""
    from routing.placement import able_machines
    from routing.scarcity import Scarcity

    estimator = costs()
    catalogue = {m: (p.family, p.kind) for m, p in estimator.models.items()}
    speed = {"server": 1.0, "m1": 1.0}
    fleet = machines(view("server", warm=("video",)), view("m1"))
    demand = Demand()
    for i in range(30):
        demand.add(MODEL, 10.0, now_s=60.0 * i)  # short Auto jobs, none pinned yet
    demand.add("video", 600.0, now_s=1800.0)
    rates = demand.rates(1800.0)
    video = request("auto", model="video", kind="video", steps=100)
    unprimed = pressure(rates, able_with_pinned(able_machines(fleet, estimator, catalogue), rates), speed)
    assert place(video, fleet, estimator, unprimed).machine == "server"
    decision = place(video, fleet, estimator, Scarcity().pressure(fleet, estimator, catalogue, rates, speed))
    assert decision.machine == "m1"
    assert decision.candidates["server"].scarcity_s > decision.candidates["m1"].scarcity_s
