"""bench.tail: the causes of Auto's excess jobs over the clairvoyant reference's p95
(docs/benchmarks.md, "The tail"), on hand-built lines whose times are known: an outage, a long
job ahead, the job's own slow run, and a queue of short jobs."""

from __future__ import annotations

import re

import pytest

from bench import clairvoyant
from bench.random_cases import case_seeds, random_case
from bench.sim import BENCH, POLICIES, Simulation, load_fleet_file, lower_bounds, true_factors
from bench.tail import cause, excess, main, timeline

GB = 1_000_000_000


def problem(
    jobs: dict[int, tuple[float, float, tuple[str, ...], dict[str, float]]],
    offline: dict[str, list[tuple[float, float]]] | None = None,
) -> clairvoyant.Problem:
    """Jobs: index -> (arrival s, bound s, able machines, run seconds per machine); one model,
    warm everywhere (no load), on two machines ``fast`` and ``slow``."""
    machines = {n: ("unified", 64 * GB, frozenset({"m"})) for n in ("fast", "slow")}
    return clairvoyant.Problem(
        arrival={j: a for j, (a, _, _, _) in jobs.items()},
        bound={j: b for j, (_, b, _, _) in jobs.items()},
        choices={j: c for j, (_, _, c, _) in jobs.items()},
        model=dict.fromkeys(jobs, "m"),
        run_s={(j, n): s for j, (_, _, _, runs) in jobs.items() for n, s in runs.items()},
        working=dict.fromkeys(jobs, 0),
        load_s={(n, "m"): 5.0 for n in machines},
        offline={n: (offline or {}).get(n, []) for n in machines},
        machines=machines,
        weights={"m": GB},
    )


BOTH = ("fast", "slow")


def test_a_pinned_job_behind_a_long_job_that_had_a_choice_is_blamed_on_it() -> None:
    p = problem(
        {
            0: (0.0, 700.0, BOTH, {"fast": 700.0, "slow": 2100.0}),  # a long video, 3x its bound on slow
            1: (10.0, 10.0, ("slow",), {"slow": 10.0}),  # pinned there, waits 2,090 s
        }
    )
    line = timeline(p, {0: "slow", 1: "slow"})
    assert line[1] == ("slow", 2100.0, 2110.0)
    assert cause(p, line, 1) == "long_job_slow_choice"
    on_fast = timeline(p, {0: "fast", 1: "slow"})
    assert cause(p, on_fast, 1) == "queue_forced"  # nothing ahead: it ran at once


def test_an_outage_during_the_wait_comes_first() -> None:
    p = problem(
        {0: (0.0, 10.0, BOTH, {"fast": 10.0, "slow": 30.0}), 1: (5.0, 10.0, BOTH, {"fast": 10.0, "slow": 30.0})},
        offline={"fast": [(8.0, 500.0)]},
    )
    line = timeline(p, {0: "fast", 1: "fast"})
    assert line[1] == ("fast", 500.0, 510.0)  # job 0 ran on; job 1 waited out the outage
    assert cause(p, line, 1) == "outage"


def test_a_slow_run_of_its_own_and_a_queue_of_short_jobs() -> None:
    runs = {"fast": 10.0, "slow": 40.0}
    p = problem({j: (float(j), 10.0, BOTH, runs) for j in range(4)})
    alone = timeline(p, {0: "slow", 1: "fast", 2: "fast", 3: "fast"})
    assert cause(p, alone, 0) == "own"  # 40 s where 10 s was its bound, no wait
    assert cause(p, alone, 3) == "queue_flex"  # behind two 10 s jobs


def test_excess_jobs_are_those_the_reference_keeps_under_its_p95() -> None:
    p = problem(
        {
            0: (0.0, 700.0, BOTH, {"fast": 700.0, "slow": 2100.0}),
            1: (10.0, 10.0, ("slow",), {"slow": 10.0}),
            2: (20.0, 10.0, ("fast",), {"fast": 10.0}),
        }
    )
    reference = clairvoyant.Schedule(p, {0: "fast", 1: "slow", 2: "fast"})  # job 2 waits for the video
    found = excess(p, {0: "slow", 1: "slow", 2: "fast"}, reference, threshold=5.0)
    # Auto's job 1 waits out the video (slowdown 210; 1 in the reference); its job 2 runs at once
    assert found == {1: "long_job_slow_choice"}
    assert excess(p, {0: "fast", 1: "slow", 2: "fast"}, reference, threshold=5.0) == {}  # Auto's = the reference's


def test_the_diagnosis_prints_a_line_per_case_and_the_totals(capsys) -> None:
    case_seed = case_seeds(3, 99)[2]
    main([str(case_seed), "--moves", "20", "--no-outages"])
    out = capsys.readouterr().out
    assert re.search(
        rf"^case {case_seed} regret_p95=[\d.]+ \(auto [\d.]+, reference [\d.]+\) outages=\d+ excess_jobs=\d+", out, re.M
    )
    assert "== 1 cases, excess jobs" in out


def test_jobs_placed_where_another_schedule_put_them_replay_that_schedule() -> None:
    """The what-if behind ``--follow``: the simulator places the given jobs where told, so with
    every job with a choice placed as the reference placed it, the run is the reference."""
    case = random_case(case_seeds(3, 99)[2], load_fleet_file(BENCH / "fleet.toml"))
    factors = true_factors(case.fleet)
    bounds = lower_bounds(case.fleet, case.trace, factors)
    p = clairvoyant.problem(case.fleet, case.trace, factors, bounds, 10.0)
    auto = Simulation(case.fleet, case.trace, POLICIES["auto"], factors).run()
    _, by_p95 = clairvoyant.reference(p, [auto.placed_on], 300, 1)
    assert by_p95.placed != auto.placed_on  # the search moved some job, so following it changes the run
    placed = {j: m for j, m in by_p95.placed.items() if len(p.choices[j]) > 1}
    out = Simulation(case.fleet, case.trace, POLICIES["auto"], factors, placed=placed).run()
    assert out.placed_on == by_p95.placed
    assert clairvoyant.slowdown_figures(out.completion_s, bounds, 10.0)[1] == pytest.approx(by_p95.p95)


def test_follow_prints_each_kind_s_regret_and_their_means(capsys) -> None:
    case_seed = case_seeds(3, 99)[2]
    main([str(case_seed), "--moves", "20", "--follow"])
    out = capsys.readouterr().out
    assert re.search(
        rf"^case {case_seed} regret_p95=[\d.]+ .* following_video=[\d.]+ following_edit=[\d.]+ following_other=[\d.]+$",
        out,
        re.M,
    )
    assert re.search(r"^regret_p95 over these cases \(geometric mean\): alone=[\d.]+ following_video=[\d.]+", out, re.M)
