"""A fleet-file entry with several devices: one machine per device, ``<host>:<index>``,
with the entry's settings and token; a bad ``devices`` is a config error naming the field."""

from __future__ import annotations

import tomllib
from typing import Any

import pytest
from pydantic import ValidationError

from app.api.auth import machine_of
from app.cli.main import settings_problem
from app.core.errors import Unauthorized
from app.core.names import device_machine, split_machine
from app.fleet.config import Fleet, with_fresh_tokens

SERVER = {
    "name": "server",
    "backend": "cpu",
    "memory_kind": "unified",
    "memory_bytes": 8_000_000_000,
    "families": ["sd1"],
    "token": "server-token-0123456789",
}
BOX_TOKEN = "box-token-0123456789abcdef"


def box(**changes: Any) -> dict[str, Any]:
    entry = {
        "name": "box",
        "backend": "cuda",
        "memory_kind": "dedicated",
        "memory_bytes": 24_000_000_000,
        "families": ["sd1", "sdxl"],
        "token": BOX_TOKEN,
        "speed": 3.0,
        "load_bytes_per_s": 5e9,
        "devices": ["cuda:0", "cuda:1"],
    }
    return {**entry, **changes}


def fleet_of(*entries: dict[str, Any]) -> Fleet:
    return Fleet.model_validate({"machines": [SERVER, *entries]})


def test_two_devices_become_machines_box_0_and_box_1_with_the_hosts_settings() -> None:
    fleet = fleet_of(box())
    assert list(fleet.machines) == ["server", "box:0", "box:1"]
    for index in (0, 1):
        machine = fleet.machines[f"box:{index}"]
        assert (machine.host, machine.device, machine.host_name) == ("box", index, "box")
        assert machine.backend == "cuda" and machine.memory_kind == "dedicated"
        assert machine.memory_bytes == 24_000_000_000  # per device
        assert machine.families == frozenset({"sd1", "sdxl"})
        assert (machine.speed, machine.load_bytes_per_s, machine.token) == (3.0, 5e9, BOX_TOKEN)
    assert fleet.machines["server"].host_name == "server" and fleet.machines["server"].device is None
    assert {host: [m.name for m in members] for host, members in fleet.hosts().items()} == {
        "server": ["server"],
        "box": ["box:0", "box:1"],
    }


def test_a_count_of_devices_numbers_them_from_zero_and_a_list_keeps_its_indices() -> None:
    assert list(fleet_of(box(devices=3)).machines) == ["server", "box:0", "box:1", "box:2"]
    assert list(fleet_of(box(devices=["cuda:2", "cuda:0"])).machines) == ["server", "box:2", "box:0"]
    cpu = fleet_of(box(backend="cpu", memory_kind="unified", devices=["cpu:0", "cpu:1"]))
    assert [m.device for m in cpu.machines.values()] == [None, 0, 1]


def test_a_multi_device_fleet_round_trips_through_toml_with_one_entry_per_host() -> None:
    fleet = fleet_of(box(), {**SERVER, "name": "mac", "backend": "mps", "token": "mac-token-0123456789"})
    text = fleet.to_toml()
    assert text.count("[[machines]]") == 3
    assert 'name = "box"\ndevices = ["cuda:0", "cuda:1"]' in text
    assert Fleet.model_validate(tomllib.loads(text)) == fleet


@pytest.mark.parametrize(
    ("devices", "message"),
    [
        ([], "machine 'box': devices must be a list"),
        ("2", "machine 'box': devices must be a list"),
        (True, "machine 'box': devices must be a list"),
        (0, r"machine 'box': devices = 0: a count of devices is 1..64"),
        (65, r"devices = 65: a count of devices is 1..64"),
        (["cuda:0", "cuda:0"], "machine 'box': devices: device 'cuda:0' is listed twice"),
        (["cpu:0"], "machine 'box': devices: each device is \"cuda:<index>\" .*got 'cpu:0'"),
        (["cuda:x"], "each device is \"cuda:<index>\" .*got 'cuda:x'"),
        (["cuda:01"], "got 'cuda:01'"),
        (["cuda:64"], "index 0..63\\); got 'cuda:64'"),
        ([0, 1], "got 0"),
    ],
)
def test_a_bad_device_list_is_a_config_error_naming_the_field(devices: object, message: str) -> None:
    with pytest.raises(ValidationError, match=message) as refused:
        fleet_of(box(devices=devices))
    assert settings_problem(refused.value).startswith("the fleet file: machine 'box': devices")  # the CLI's line


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        (box(name="box:0"), "devices: the entry's name must be a host name"),
        (box(backend="mps", memory_kind="unified", devices=["mps:0", "mps:1"]), "an Apple host has one mps device"),
        (box(host="box"), "'host' is not a fleet-file key"),
        ({**box(), "device": 0}, "'device' is not a fleet-file key"),
        (
            {key: value for key, value in box(name="box:0").items() if key != "devices"},
            r"machine 'box:0' names device 0 of host 'box': declare the host's devices on its entry",
        ),
        (
            {key: value for key, value in box(name="box:3x").items() if key != "devices"},
            "a machine name is a host name",
        ),
    ],
)
def test_device_names_come_only_from_a_hosts_devices(entry: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        fleet_of(entry)


def test_a_host_is_one_entry_whose_devices_share_its_settings() -> None:
    with pytest.raises(
        ValidationError, match=r"machine 'box' is listed twice in the fleet config \(once with devices\)"
    ):
        fleet_of(box(), {key: value for key, value in box().items() if key != "devices"})
    with pytest.raises(ValidationError, match=r"machine 'box:1' is listed twice"):
        fleet_of(box(), box(devices=["cuda:1"]))
    fleet = fleet_of(box())
    machines = {**fleet.machines, "box:1": fleet.machines["box:1"].model_copy(update={"speed": 9.0})}
    with pytest.raises(ValidationError, match="the devices of host 'box' differ in settings"):
        Fleet(machines=machines)


def test_devices_share_their_hosts_token_but_two_hosts_may_not() -> None:
    fleet = fleet_of(box())
    assert [m.name for m in fleet.machines_for_token(BOX_TOKEN)] == ["box:0", "box:1"]
    assert fleet.machines_for_token("not-a-token") == []
    with pytest.raises(ValidationError, match="two machines share a token"):
        fleet_of(box(), box(name="other"))
    fresh = with_fresh_tokens(fleet)
    assert fresh.machines["box:0"].token == fresh.machines["box:1"].token != BOX_TOKEN
    assert fresh.machines["server"].token != fresh.machines["box:0"].token


def test_the_internal_api_takes_the_hosts_token_for_the_device_a_worker_names() -> None:
    fleet = fleet_of(box())
    bearer = f"Bearer {BOX_TOKEN}"
    assert machine_of(fleet, bearer, "box:0").name == "box:0"
    assert machine_of(fleet, bearer, "box:1").name == "box:1"
    with pytest.raises(
        Unauthorized,
        match=r"the token is host 'box''s, shared by its devices box:0, box:1: name "
        "the device's machine in the X-Homefleet-Machine header",
    ):
        machine_of(fleet, bearer, None)
    with pytest.raises(
        Unauthorized, match="says it is machine 'server', but its token belongs to machine 'box:0, box:1'"
    ):
        machine_of(fleet, bearer, "server")
    with pytest.raises(Unauthorized, match="names machine 'box:2', which is not in this fleet") as unknown:
        machine_of(fleet, bearer, "box:2")
    assert unknown.value.reason == "unknown_machine"  # the worker then names --machine, not its token
    with pytest.raises(Unauthorized, match="its token belongs to machine 'server'"):
        machine_of(fleet, f"Bearer {SERVER['token']}", "box:0")


def test_machine_names_split_into_host_and_device() -> None:
    assert split_machine("box:1") == ("box", 1)
    assert split_machine("box") == ("box", None)
    assert split_machine("gpu-host:63") == ("gpu-host", 63)
    assert device_machine("box", 0) == "box:0"
    for bad in ("box:", "box:64", "box:01", "Box:0", "box:0:1", ":0", "box:-1"):
        with pytest.raises(ValueError, match="a machine name is a host name"):
            split_machine(bad)
