"""bench/screen.py: Auto replayed against kept baselines and references must print what the
full random benchmark prints for the same code, and must re-simulate Auto, never read it back."""

from __future__ import annotations

import json
import re

import pytest

from bench import placement, screen
from bench.sim import POLICIES, least_queue


def test_a_screen_reproduces_the_full_run_and_then_needs_no_search(tmp_path, capsys, monkeypatch) -> None:
    full = placement.run_random(2, 7, moves=50, verbose=False)
    capsys.readouterr()
    cache = tmp_path / "kept.json"
    rows = screen.screen(7, 2, 50, outages=True, refresh=False, cache=cache)
    out = capsys.readouterr().out
    for mine, theirs in zip(rows, full, strict=True):
        assert mine["seed"] == theirs["seed"]
        for key in ("auto_mean", "auto_p95", "best_mean", "best_p95", "ref_mean", "ref_p95"):
            assert mine[key] == pytest.approx(theirs[key], rel=1e-12), key
    kept = json.loads(cache.read_text())
    assert set(kept["cases"]) == {str(r["seed"]) for r in full} and kept["commit"]
    for figure in ("mean", "p95"):
        assert re.search(rf"^{figure} +auto/best_baseline p50=[\d.]+ p95=[\d.]+ max=[\d.]+ losses=\d", out, re.M)
        assert re.search(rf"^{figure} +auto/best_baseline geometric mean over the cases [\d.]+$", out, re.M)
        assert re.search(rf"^{figure} +auto/reference +p50=[\d.]+ p95=[\d.]+ max=[\d.]+$", out, re.M)
    assert "differ from the kept Auto's: 0 of 2" in out

    def no_search(*args, **kwargs):
        raise AssertionError("a kept case was searched again")

    monkeypatch.setattr(screen, "run_case", no_search)
    # Auto replaced by least-queue: the screen simulates the policy now registered as Auto
    monkeypatch.setitem(POLICIES, "auto", least_queue)
    again = screen.screen(7, 2, 50, outages=True, refresh=False, cache=cache)
    out = capsys.readouterr().out
    for mine, theirs in zip(again, full, strict=True):
        assert (mine["auto_mean"], mine["auto_p95"]) == pytest.approx(
            (theirs["least_queue_mean"], theirs["least_queue_p95"]), rel=1e-12
        )
        assert mine["ref_mean"] <= theirs["ref_mean"] and mine["ref_p95"] <= theirs["ref_p95"]
    assert "differ from the kept Auto's: 2 of 2" in out


def test_outages_can_be_left_out() -> None:
    with_them = screen.cases(2026, 40, outages=True)
    without = screen.cases(2026, 40, outages=False)
    assert any(c.trace.offline for c in with_them)
    assert not any(c.trace.offline for c in without)
    assert [len(c.trace.jobs) for c in with_them] == [len(c.trace.jobs) for c in without]


def test_bootstrap_counts_the_cases_over_the_goal_and_brackets_the_p95() -> None:
    # 200 cases: regret 3.0 on 10, 1.0 on the rest (p95 figure); the mean figure's regret is 1 everywhere
    rows = [
        {"auto_mean": 1.0, "ref_mean": 1.0, "auto_p95": 3.0 if i < 10 else 1.0, "ref_p95": 1.0, "seed": i}
        for i in range(200)
    ]
    mean_line, p95_line = screen.bootstrap_lines(rows, 200)
    assert mean_line.startswith("mean  auto/reference cases over 2: 0 of 200; at the cases' p95 1.000")
    assert "within 1.000-1.000" in mean_line
    # 10 of 200 over the goal: the p95 (the 191st value) is 3.0; a resample holds 9 or fewer of
    # them (its p95 1.0) about as often as 10 or more, so the interval spans both
    assert p95_line.startswith("p95   auto/reference cases over 2: 10 of 200; at the cases' p95 3.000")
    assert p95_line.endswith("90 % of 200 resamples within 1.000-3.000")
    assert screen.bootstrap_lines(rows, 200) == [mean_line, p95_line]  # the resamples are seeded


def test_one_cache_file_names_one_seed() -> None:
    with pytest.raises(SystemExit):
        screen.main(["--seed", "1,3", "--cache", "kept.json"])
