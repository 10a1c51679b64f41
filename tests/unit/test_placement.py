"""Placement rules R9–R11 as pure unit tests (routing/ takes plain data)."""

from __future__ import annotations

import pytest

from app.errors import MachineUnavailable, Rejected
from routing.placement import JobRequest, MachineView, place

MODEL = "tiny-sd"


def view(name: str, *, online: bool = True, families: set[str] | None = None, verified: set[str] | None = None,
         backlog: int = 0) -> MachineView:
    return MachineView(
        name=name, online=online, families=frozenset(families if families is not None else {"sd1"}),
        verified_models=frozenset(verified if verified is not None else {MODEL}), backlog=backlog,
    )


def machines(*views: MachineView) -> dict[str, MachineView]:
    return {v.name: v for v in views}


def request(target: str) -> JobRequest:
    return JobRequest(model_id=MODEL, family="sd1", kind="txt2img", target=target)


def test_r9_default_target_is_server() -> None:
    fleet = machines(view("server", backlog=5), view("m1"))
    assert place(JobRequest(model_id=MODEL, family="sd1", kind="txt2img"), fleet).machine == "server"


def test_r10_explicit_target_is_kept_even_when_busy() -> None:
    fleet = machines(view("server"), view("m1", backlog=9), view("m2"))
    assert place(request("m1"), fleet).machine == "m1"


def test_r10_unknown_machine_is_refused_naming_it() -> None:
    with pytest.raises(Rejected) as refused:
        place(request("nope"), machines(view("server"), view("m1")))
    assert refused.value.reason == "unknown_machine"
    assert "'nope'" in refused.value.message and "m1" in refused.value.message


def test_r10_pinned_offline_machine_is_an_error_even_when_others_are_idle() -> None:
    with pytest.raises(MachineUnavailable) as refused:
        place(request("m1"), machines(view("server"), view("m1", online=False), view("m2")))
    assert refused.value.status_code == 503
    assert refused.value.reason == "machine_unavailable"
    assert "m1" in refused.value.message


@pytest.mark.parametrize(
    ("target_view", "reason"),
    [
        (view("m1", families={"sdxl"}), "family_not_supported"),
        (view("m1", verified=set()), "model_not_verified"),
    ],
)
def test_r10_unsupported_explicit_target_is_refused_with_its_reason(target_view: MachineView, reason: str) -> None:
    with pytest.raises(Rejected) as refused:
        place(request("m1"), machines(view("server"), target_view))
    assert refused.value.reason == reason
    assert "m1" in refused.value.message and MODEL in refused.value.message


def test_r11_auto_never_picks_an_offline_or_unverified_machine() -> None:
    fleet = machines(
        view("server", online=False), view("m1", verified=set()), view("m2", families={"sdxl"}), view("m3", backlog=7),
    )
    placement = place(request("auto"), fleet)
    assert placement.machine == "m3"
    assert placement.excluded == {"server": "machine_unavailable", "m1": "model_not_verified", "m2": "family_not_supported"}


def test_r11_auto_ranks_by_backlog_then_name() -> None:
    fleet = machines(view("server", backlog=2), view("m2", backlog=1), view("m1", backlog=1))
    assert place(request("auto"), fleet).machine == "m1"


def test_r11_auto_with_no_machine_left_is_refused_with_every_reason() -> None:
    with pytest.raises(Rejected) as refused:
        place(request("auto"), machines(view("server", online=False), view("m1", verified=set())))
    assert refused.value.reason == "no_machine"
    assert "server: machine_unavailable" in refused.value.message
    assert "m1: model_not_verified" in refused.value.message


def test_r6_a_syncing_machine_is_refused_when_pinned_and_skipped_by_auto() -> None:
    syncing = MachineView(name="m1", online=True, families=frozenset({"sd1"}), verified_models=frozenset({MODEL}),
                          syncing=True)
    fleet = machines(view("server", backlog=3), syncing)
    with pytest.raises(Rejected) as refused:
        place(request("m1"), fleet)
    assert refused.value.reason == "machine_syncing" and "'m1'" in refused.value.message
    placed = place(request("auto"), fleet)
    assert placed.machine == "server" and placed.excluded == {"m1": "machine_syncing"}


def test_r4_a_model_present_but_not_advertised_is_refused_when_pinned_and_skipped_by_auto() -> None:
    fleet = machines(view("server", backlog=3), view("m1", verified=set()))
    with pytest.raises(Rejected) as refused:
        place(request("m1"), fleet)
    assert refused.value.reason == "model_not_verified" and "homefleet sync m1 tiny-sd" in refused.value.message
    placed = place(request("auto"), fleet)
    assert placed.machine == "server" and placed.excluded == {"m1": "model_not_verified"}
