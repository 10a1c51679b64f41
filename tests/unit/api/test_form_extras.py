"""An edit's extra form fields (the openai SDK's ``extra_body`` sent as multipart) rebuilt as
the SDK encoded them (openai-python ``_qs.py``, brackets): plain values parsed as JSON where
they are, lists, objects and lists of objects by their bracketed names (R22: nothing dropped)."""

from __future__ import annotations

from typing import Any

import pytest
from openai._qs import Querystring
from starlette.datastructures import FormData

from app.api.routes.images import form_extras
from app.core.errors import Rejected


def as_the_sdk_sends(extra_body: dict[str, Any]) -> FormData:
    """The form fields the openai SDK (its own serializer) makes of ``extra_body``, in the order
    httpx sends them: equal names grouped, as ``_serialize_multipartform`` groups them."""
    grouped: dict[str, list[str]] = {}
    for name, value in Querystring().stringify_items(extra_body, array_format="brackets"):
        grouped.setdefault(name, []).append(value)
    return FormData([(name, value) for name, values in grouped.items() for value in values])


@pytest.mark.parametrize(
    "extra_body",
    [
        {"steps": 2, "negative_prompt": "blurry", "guidance_scale": 1.5},
        {"adapters": [{"id": "a", "scale": 0.5}, {"id": "b", "scale": -1}]},
        {"adapters": [{"id": "a"}, {"id": "b"}, {"id": "c"}]},
        {"tags": [1, 2, 3]},
        {"options": {"x": 1, "y": "z"}},
        # text fields stay text whatever they look like (a form carries every value as text)
        {"negative_prompt": "42", "format": "null", "target": "123"},
        {"adapters": [{"id": "2077", "scale": 0.5}, {"id": "12", "scale": 1}]},
    ],
)
def test_what_the_sdk_encodes_comes_back_as_it_was(extra_body: dict[str, Any]) -> None:
    assert form_extras(as_the_sdk_sends(extra_body)) == extra_body


def test_a_list_of_objects_with_uneven_fields_is_refused_naming_it() -> None:
    with pytest.raises(Rejected) as caught:
        form_extras(as_the_sdk_sends({"adapters": [{"id": "a", "scale": 0.5}, {"id": "b"}]}))
    assert (caught.value.status_code, caught.value.reason, caught.value.param) == (422, "invalid_params", "adapters")
    assert caught.value.message.startswith("adapters: the form holds 2 adapters[][id], 1 adapters[][scale]")


def test_deeper_or_clashing_names_stay_apart_to_be_refused_by_name() -> None:
    form = FormData([("a[x][y]", "1"), ("steps", "2"), ("steps[]", "3"), ("q[][k]", "1"), ("q", "4")])
    assert form_extras(form) == {"a[x][y]": 1, "steps": 2, "steps[]": 3, "q": 4, "q[][k]": [1]}
