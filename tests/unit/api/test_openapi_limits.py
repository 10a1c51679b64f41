"""The OpenAPI document states the limits a schema can state (R22, docs/api.md "What the
OpenAPI document promises"), so that a schema-valid body is accepted: each ``JobCreate`` kind
lists only the models that run it, every ``target`` the fleet's machines, OpenAI's ``size`` the
sizes the limits allow, integers beyond a float's precision exact bounds, a stream's schema
one event. Checked on FastAPI's own document of the real app, as ``documented`` rewrites it."""

from __future__ import annotations

import copy
from typing import Any

import jsonschema
import pytest
from fastapi import FastAPI

from app.api.openapi import MAX_LISTED_SIZES, documented, size_schema
from app.api.routes import images, public, text, tgi
from app.core.kinds import MAX_SEED
from app.core.limits import FamilyLimits

LIMITS = {"default": FamilyLimits(max_pixels=32 * 32, max_steps=2, max_frames=2, max_batch=2, max_prompt_chars=64)}
MODELS = {"tiny-sd": ["txt2img", "img2img", "inpaint"], "tiny-pix2pix": ["edit"], "tiny-llama": ["text"]}


@pytest.fixture(scope="module")
def document() -> dict[str, Any]:
    app = FastAPI()
    app.include_router(images.router)
    app.include_router(tgi.router)
    app.include_router(public.router)
    app.include_router(text.router)
    return documented(copy.deepcopy(app.openapi()), ["server", "m1"], LIMITS, MODELS)


def test_each_kind_lists_only_the_models_that_run_it_and_a_kind_no_model_runs_is_left_out(
    document: dict[str, Any],
) -> None:
    variants = {v["properties"]["kind"]["const"]: v for v in document["components"]["schemas"]["JobCreate"]["oneOf"]}
    assert set(variants) == {"txt2img", "img2img", "inpaint", "edit", "text"}  # no upscale or video model registered
    assert variants["edit"]["properties"]["model"]["enum"] == ["tiny-pix2pix"]
    assert variants["inpaint"]["properties"]["model"]["enum"] == ["tiny-sd"]
    assert variants["text"]["properties"]["model"]["enum"] == ["tiny-llama"]
    assert "expanded_by" not in variants["txt2img"]["properties"]["params"]["properties"]  # the server sets it
    assert "user_message" not in variants["text"]["properties"]["params"]["properties"]  # as it does a chat's


def test_every_target_and_body_model_names_what_can_run(document: dict[str, Any]) -> None:
    schemas = document["components"]["schemas"]
    for body in ("Completion", "ChatCompletion", "Generate", "ImageGeneration"):
        target = schemas[body]["properties"]["target"]
        assert target["enum"] == ["m1", "server", "auto"], body
    assert schemas["ImageGeneration"]["properties"]["model"]["anyOf"][0]["enum"] == ["tiny-sd"]
    assert schemas["Completion"]["properties"]["model"]["anyOf"][0]["enum"] == ["tiny-llama"]


def test_seeds_are_bounded_by_exact_integers_and_top_p_by_the_text_kind(document: dict[str, Any]) -> None:
    seed = document["components"]["schemas"]["Completion"]["properties"]["seed"]["anyOf"][0]
    assert seed["maximum"] == MAX_SEED and isinstance(seed["maximum"], int) and "exclusiveMaximum" not in seed
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(2**63 + 190, seed)  # a float bound 9.223372036854776e18 let it through
    top_p = document["components"]["schemas"]["Parameters"]["properties"]["top_p"]["anyOf"][0]
    assert (top_p["minimum"], top_p["maximum"]) == (0.001, 1.0)


def test_openai_sizes_are_listed_when_few_and_patterned_when_many() -> None:
    few = size_schema(LIMITS["default"])["anyOf"][0]
    assert "32x32" in few["enum"] and "8x128" in few["enum"] and "auto" in few["enum"]
    assert "40x32" not in few["enum"] and "12x8" not in few["enum"]
    many = size_schema(FamilyLimits())["anyOf"][0]
    assert "enum" not in many and many["pattern"].startswith("^(auto|")


@pytest.mark.parametrize(
    ("multiple_of", "min_side", "max_pixels"),
    [(8, 8, 1024), (8, 16, 128 * 128), (64, 64, 2**20), (16, 8, 300 * 300), (8, 8, 256 * 256)],
)
def test_the_listed_sizes_are_every_allowed_size_in_order_and_only_those(
    multiple_of: int, min_side: int, max_pixels: int
) -> None:
    """The list stops counting once it is too long (the broadest limits allow millions of sizes:
    enumerating them made every /openapi.json take seconds); when short, it is exactly the sizes
    a brute force over every side finds, width first."""
    limits = FamilyLimits(multiple_of=multiple_of, min_side=min_side, max_pixels=max_pixels)
    low = max(min_side, multiple_of)
    low += (-low) % multiple_of
    sides = range(low, max_pixels // low + 1, multiple_of)
    expected = [f"{w}x{h}" for w in sides for h in sides if w * h <= max_pixels]
    named = size_schema(limits)["anyOf"][0]
    if len(expected) <= MAX_LISTED_SIZES:
        assert named["enum"] == [*expected, "auto"]
    else:
        assert "enum" not in named and "pattern" in named


def test_a_stream_documents_one_event(document: dict[str, Any]) -> None:
    stream = document["paths"]["/generate_stream"]["post"]["responses"]["200"]["content"]["text/event-stream"]
    event = {"data": '{"token": {"id": 1}}', "event": "message"}
    jsonschema.validate(event, stream["schema"])
