"""TGI's parameters as a text job's params (app/api/routes/tgi.py): TGI's sampling rule, the
grammar passed through, unsupported parameters refused when set (not ignored)."""

from __future__ import annotations

import pytest

from app.api.routes.tgi import Generate, Parameters
from app.core.errors import Rejected


def test_greedy_unless_do_sample_or_a_temperature_or_top_p_changes_the_distribution() -> None:
    assert Parameters().job_params("x") == {"prompt": "x", "temperature": 0.0}
    assert Parameters(temperature=1.0).job_params("x")["temperature"] == 0.0  # 1.0 changes nothing: greedy
    assert Parameters(do_sample=True, seed=4).job_params("x") == {"prompt": "x", "temperature": 1.0, "seed": 4}
    assert Parameters(temperature=0.7).job_params("x")["temperature"] == 0.7
    assert Parameters(top_p=0.9).job_params("x") == {"prompt": "x", "temperature": 1.0, "top_p": 0.9}
    grammar = {"type": "regex", "value": "[0-9]+"}
    assert Parameters(grammar=grammar, max_new_tokens=5).job_params("x") == {
        "prompt": "x",
        "max_new_tokens": 5,
        "temperature": 0.0,
        "grammar": grammar,
    }


@pytest.mark.parametrize(("name", "value"), [("top_k", 5), ("repetition_penalty", 1.2), ("watermark", True)])
def test_an_unsupported_parameter_set_is_refused_naming_it(name: str, value: object) -> None:
    with pytest.raises(Rejected, match=f"parameters.{name}") as refused:
        Parameters.model_validate({name: value}).job_params("x")
    assert refused.value.reason == "unknown_param"
    Parameters.model_validate({name: None, "watermark": False, "stop": []}).job_params("x")  # unset: fine


def test_a_key_that_is_no_tgi_parameter_is_refused_naming_it_not_ignored() -> None:
    # TGI's serde drops it; a misspelt max_new_tokens would run with the default 16 tokens.
    with pytest.raises(Rejected, match=r"`parameters\.max_new_token`") as refused:
        Parameters.model_validate({"max_new_token": 3}).job_params("x")
    assert (refused.value.reason, refused.value.param) == ("unknown_param", "parameters.max_new_token")
    assert "max_new_tokens" in refused.value.message  # what it takes
    with pytest.raises(Rejected, match="paramters") as top:
        Generate.model_validate({"inputs": "x", "paramters": {"max_new_tokens": 3}}).check()
    assert (top.value.reason, top.value.param) == ("unknown_param", "paramters")


def test_stop_sequences_become_the_jobs_stop_and_a_bad_one_names_the_field() -> None:
    assert Parameters(stop=["\n", "END"]).job_params("x")["stop"] == ["\n", "END"]
    assert "stop" not in Parameters(stop=[]).job_params("x")
    with pytest.raises(Rejected, match=r"parameters\.stop") as refused:
        Parameters(stop=["a", "b", "c", "d", "e"]).job_params("x")
    assert refused.value.param == "parameters.stop" and refused.value.reason == "invalid_stop"
