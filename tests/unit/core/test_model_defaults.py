"""A model's (and a LoRA adapter's) own default params (app/core/kinds.py): checked against the
param spec of the kinds they apply to at registration, applied to a job that does not set them
(the client's value wins, then the adapter's, then the model's)."""

from __future__ import annotations

import pytest

from app.core.kinds import DefaultRefused, check_defaults, default_kinds, family_kind_spec, with_defaults


def test_an_adapters_defaults_apply_to_its_familys_kinds_that_take_adapters() -> None:
    assert default_kinds("sd1", ["adapter"]) == default_kinds("sd1", ["txt2img"])
    assert "txt2img" in default_kinds("sd1", ["adapter"]) and "upscale" not in default_kinds("sd1", ["adapter"])
    assert check_defaults("sd1", ["adapter"], {"steps": 6, "guidance_scale": 3.5}) == {"steps": 6, "guidance_scale": 3.5}


@pytest.mark.parametrize(("defaults", "name", "said"), [
    ({"stepz": 3}, "stepz", "'stepz' is not a param"),
    ({"seed": 1}, "seed", "a default may set"),  # a job's own: drawn per job (R9)
    ({"guidance_scale": 500}, "guidance_scale", "from 0 to 50, got 500"),
    ({"guidance_scale": True}, "guidance_scale", "got True"),
    ({"max_new_tokens": 0}, "max_new_tokens", "not a param of txt2img"),
])
def test_a_default_that_is_not_a_param_or_out_of_range_is_refused_naming_it(defaults: dict[str, object], name: str,
                                                                           said: str) -> None:
    with pytest.raises(DefaultRefused, match=said) as refused:
        check_defaults("sd1", ["txt2img"], defaults)
    assert refused.value.name == name


def test_the_clients_value_wins_then_the_adapters_then_the_models() -> None:
    spec = family_kind_spec("sd1", "txt2img")
    model, adapter = {"guidance_scale": 4, "steps": 9}, {"steps": 6}
    assert with_defaults(spec, {"prompt": "x"}, adapter, model) == {"prompt": "x", "guidance_scale": 4, "steps": 6}
    assert with_defaults(spec, {"prompt": "x", "guidance_scale": 7}, adapter, model)["guidance_scale"] == 7
    assert "strength" not in with_defaults(spec, {"prompt": "x"}, {"strength": 0.5})  # not txt2img's: not applied
