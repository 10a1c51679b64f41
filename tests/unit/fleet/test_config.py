"""The fleet config."""

from __future__ import annotations

import tomllib

import pytest
from pydantic import ValidationError

from app.fleet.config import Fleet, load_fleet, with_fresh_tokens
from tests.helpers import make_fleet


def test_embedded_default_fleet_lists_the_server_and_two_machines() -> None:
    fleet = load_fleet(None)
    assert list(fleet.machines) == ["server", "box1", "box2"]
    assert all(m.memory_bytes > 0 and m.families for m in fleet.machines.values())


def test_fresh_tokens_are_distinct_and_round_trip_through_toml() -> None:
    fleet = with_fresh_tokens(load_fleet(None)).require_tokens()
    tokens = {m.token for m in fleet.machines.values()}
    assert len(tokens) == 3
    again = Fleet.model_validate(tomllib.loads(fleet.to_toml()))
    assert again == fleet


def test_a_token_identifies_exactly_its_machine() -> None:
    fleet = make_fleet("m1")
    assert fleet.machine_for_token(fleet.machines["m1"].token).name == "m1"  # type: ignore[union-attr]
    assert fleet.machine_for_token("not-a-token") is None


@pytest.mark.parametrize(
    ("machines", "message"),
    [
        ([{"name": "m1", "backend": "cpu", "memory_kind": "unified", "memory_bytes": 1, "families": []}], "server"),
        (
            [{"name": "server", "backend": "cpu", "memory_kind": "unified", "memory_bytes": 1, "families": []}] * 2,
            "listed twice",
        ),
        (
            [{"name": "server", "backend": "tpu", "memory_kind": "unified", "memory_bytes": 1, "families": []}],
            "backend",
        ),
        (
            [{"name": "Server!", "backend": "cpu", "memory_kind": "unified", "memory_bytes": 1, "families": []}],
            "machine name",
        ),
        (
            [
                {
                    "name": "server",
                    "backend": "cpu",
                    "memory_kind": "unified",
                    "memory_bytes": 1,
                    "families": [],
                    "speeed": 3.0,
                }
            ],
            "machines.server.speeed\n  Extra inputs are not permitted",
        ),  # the default speed stayed
    ],
)
def test_invalid_fleet_configs_are_refused_with_the_reason(machines: list[dict[str, object]], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        Fleet.model_validate({"machines": machines})
