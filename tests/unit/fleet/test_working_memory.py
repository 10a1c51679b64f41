"""Working-memory coefficients from the fleet config (R10, R11's memory filter): fleet-wide per
kind, overridden per family, embedded defaults when absent; validated with the field named."""

from __future__ import annotations

import tomllib

import pytest
from pydantic import ValidationError

from app.fleet.config import Fleet, load_fleet
from routing.estimate import DEFAULT_WORKING, Estimator, ModelProfile, WorkingCoefficients
from tests.helpers import FAMILIES, make_fleet

_BASE = make_fleet()
MACHINES = _BASE.model_copy(
    update={
        "machines": {
            "server": _BASE.machines["server"].model_copy(update={"families": FAMILIES | {"sdxl", "sd-upscale"}})
        }
    }
).to_toml()  # the families the tables below name


def fleet_of(extra: str) -> Fleet:
    return Fleet.model_validate(tomllib.loads(MACHINES + "\n" + extra))


def test_r11_absent_tables_keep_the_embedded_defaults() -> None:
    working = load_fleet(None).working()
    for kind, coefficients in DEFAULT_WORKING.items():
        assert working.coefficients("sd1", kind) == coefficients


def test_r11_fleet_wide_kind_then_family_override_field_by_field() -> None:
    fleet = fleet_of("""
[working_memory.txt2img]
base_bytes = 7_000_000
bytes_per_pixel = 300.0

[families.sdxl.working_memory.txt2img]
bytes_per_pixel = 2600.0

[families.sdxl.working_memory.video]
base_bytes = 900_000_000
""")
    working = fleet.working()
    assert working.coefficients("sd1", "txt2img") == WorkingCoefficients(7_000_000, 300.0)
    assert working.coefficients("sdxl", "txt2img") == WorkingCoefficients(7_000_000, 2600.0)  # base: fleet-wide
    assert working.coefficients("sdxl", "video") == WorkingCoefficients(
        900_000_000, DEFAULT_WORKING["video"].bytes_per_pixel
    )
    assert working.coefficients("sdxl", "edit") == DEFAULT_WORKING["edit"]
    assert working.bytes("sdxl", "txt2img", 64 * 64) == 7_000_000 + 2600 * 64 * 64


def test_r11_config_round_trips_through_toml() -> None:
    fleet = fleet_of("""
[working_memory.upscale]
bytes_per_pixel = 12.5

[families."sd-upscale".working_memory.upscale]
base_bytes = 3

[models."tiny-sd"]
step_s = 400.0

[models.sdxl]
step_s = 0.6
load_s = 2.8
""")
    assert fleet.models["tiny-sd"].load_s is None and fleet.models["sdxl"].load_s == 2.8
    assert Fleet.model_validate(tomllib.loads(fleet.to_toml())) == fleet


@pytest.mark.parametrize(
    ("extra", "text"),
    [
        ("[working_memory.painting]\nbase_bytes = 1", "working_memory has no kind 'painting'; kinds are txt2img"),
        (
            "[families.sdx1.working_memory.txt2img]\nbase_bytes = 1",
            "the families table names family 'sdx1', which no machine runs",
        ),
        ("[working_memory.txt2img]\nbase_bytes = -1", "working_memory.txt2img.base_bytes"),
        (
            "[families.sd1.working_memory.edit]\nbytes_per_pixel = -0.5",
            "families.sd1.working_memory.edit.bytes_per_pixel",
        ),
        ("[families.sd1.working_memory.edit]\nbytes_per_pixle = 1.0", "bytes_per_pixle"),
        ("[models.sdxl]\nstep_s = 0", "models.sdxl.step_s"),  # R13's timing guesses: seconds > 0
        ("[models.sdxl]\nload_seconds = 3", "models.sdxl.load_seconds"),
        ("[model.sdxl]\nstep_s = 0.6", "model\n  Extra inputs are not permitted"),  # [models.x] misspelt
    ],
)
def test_r11_invalid_coefficients_are_refused_naming_the_field(extra: str, text: str) -> None:
    with pytest.raises(ValidationError) as refused:
        fleet_of(extra)
    assert text in str(refused.value)


def test_r10_estimator_prices_weights_plus_the_family_s_working_memory() -> None:
    fleet = fleet_of("[families.sdxl.working_memory.txt2img]\nbase_bytes = 10\nbytes_per_pixel = 2.0\n")
    models = {"a": ModelProfile("a", "sdxl", 1000), "b": ModelProfile("b", "sd1", 1000)}
    estimator = Estimator(models=models, working=fleet.working())
    memory = estimator.memory("a", "txt2img", 100)
    assert (memory.weights_bytes, memory.working_bytes, memory.total_bytes) == (1000, 210, 1210)
    assert estimator.job_bytes("a", "txt2img", 100) == 1210  # placement's signature, unchanged
    assert estimator.job_bytes("b", "txt2img", 100) == 1000 + DEFAULT_WORKING["txt2img"].bytes(100)
    assert estimator.job_bytes("unknown", "txt2img", 100) == 0
