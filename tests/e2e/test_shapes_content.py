"""Results show what was asked, through the real API and a real worker: the trained
demo models (``shapes-filled``, ``shapes-outlined``; app/devtools/demo_models) run on machine
m2 of the shared fleet, and each result's pixels are read (:func:`app.devtools.shapes.inspect`):
its dominant colour, its background, its shape and the model's style must be the prompt's.

The residency rule checked by content (R5: a resident model is keyed by its own
manifest): a job naming model B while model A is warm on that machine runs B, so its picture
is in B's style (outlined), never A's (filled); and A, asked again while both are warm (R15:
unified memory keeps warm models while there is headroom), still draws filled, and B outlined.

The edit model (``shapes-recolour``) recolours an uploaded shape through an ``edit`` job.

The trained LoRA adapter (``shapes-blue-lora``) paints the filled model's shape blue
at scale 1 and leaves the prompt's colour at scale 0, shape and background kept.
"""

from __future__ import annotations

import io
import json

import pytest
from PIL import Image

from app.devtools.shapes import Reading, caption, draw, inspect_png
from app.devtools.train_colour_lora import COLOUR_LORA, LORA_COLOUR
from app.devtools.train_recolour import EDIT_SAMPLING, RECOLOUR_MODEL
from app.devtools.train_shapes import MODEL_NAMES, SAMPLING
from tests.e2e.conftest import SHAPES_MACHINE, RunningFleet
from tests.helpers import wait_for

pytestmark = pytest.mark.e2e

FILLED, OUTLINED = MODEL_NAMES["filled"], MODEL_NAMES["outlined"]


def draw_on_m2(
    fleet: RunningFleet, model: str, colour: str, shape: str, background: str, seed: int, **extra: object
) -> tuple[str, Reading]:
    job = fleet.client.submit(
        model,
        "txt2img",
        {"prompt": caption(colour, shape, background), "seed": seed, **SAMPLING, **extra},
        target=SHAPES_MACHINE,
    )
    done = fleet.client.wait(job["id"], timeout_s=180)
    assert (done["state"], done["machine"]) == ("succeeded", SHAPES_MACHINE), done
    png = fleet.client.download(job["id"])
    assert png.startswith(b"\x89PNG") and done["result"]["media_type"] == "image/png"
    return job["id"], inspect_png(png)


def warm(fleet: RunningFleet) -> list[str]:
    return json.loads(fleet.ctx.redis.get(fleet.ctx.keys.warm(SHAPES_MACHINE)) or "[]")


# Seeds the models draw right in-process (tests/unit/devtools/test_shapes.py measures how often
# they do: the filled model's squares often come out rounded, read as circles); through the
# API and a worker the picture must read the same.
@pytest.mark.parametrize(
    ("colour", "shape", "background", "seed"),
    [
        ("red", "circle", "black", 11),
        ("yellow", "triangle", "gray", 13),
    ],
)
def test_a_result_shows_the_prompts_colour_shape_and_background(
    fleet: RunningFleet, colour: str, shape: str, background: str, seed: int
) -> None:
    _, seen = draw_on_m2(fleet, FILLED, colour, shape, background, seed)
    assert (seen.colour, seen.shape, seen.background, seen.style) == (colour, shape, background, "filled"), seen


def test_b13_a_job_for_model_b_while_a_is_warm_draws_in_bs_style(fleet: RunningFleet) -> None:
    _, seen_a = draw_on_m2(fleet, FILLED, "green", "circle", "black", 10)
    assert (seen_a.colour, seen_a.style) == ("green", "filled"), seen_a
    wait_for(lambda: FILLED in warm(fleet), timeout_s=10, what="shapes-filled warm on m2")

    second, seen_b = draw_on_m2(fleet, OUTLINED, "green", "circle", "black", 10)  # same prompt, same seed
    assert (seen_b.colour, seen_b.style, seen_b.background) == ("green", "outlined", "black"), seen_b
    assert fleet.ctx.journal.get(second).cold_load is True  # B was loaded, not A's pipeline reused

    third, seen_again = draw_on_m2(fleet, FILLED, "orange", "triangle", "gray", 12)
    assert (seen_again.colour, seen_again.style, seen_again.shape) == ("orange", "filled", "triangle"), seen_again
    assert fleet.ctx.journal.get(third).cold_load is False  # A stayed warm beside B, and still draws A's style
    fourth, seen_b_again = draw_on_m2(fleet, OUTLINED, "orange", "triangle", "gray", 12)
    assert (seen_b_again.colour, seen_b_again.style) == ("orange", "outlined"), seen_b_again
    assert fleet.ctx.journal.get(fourth).cold_load is False


def test_an_edit_job_recolours_the_uploaded_shape(fleet: RunningFleet) -> None:
    """``shapes-recolour`` through the API: an uploaded red circle on black, "make it blue",
    comes back a blue circle on black, the input's size (32 x 32)."""
    buffer = io.BytesIO()
    draw("red", "circle", "black", "filled").save(buffer, format="PNG")
    uploaded = fleet.client.upload(buffer.getvalue())
    job = fleet.client.submit(
        RECOLOUR_MODEL,
        "edit",
        {"image": uploaded["id"], "prompt": "make it blue", "seed": 1, **EDIT_SAMPLING},
        target=SHAPES_MACHINE,
    )
    done = fleet.client.wait(job["id"], timeout_s=180)
    assert (done["state"], done["machine"]) == ("succeeded", SHAPES_MACHINE), done
    png = fleet.client.download(job["id"])
    with Image.open(io.BytesIO(png)) as image:
        assert image.size == (32, 32)
    seen = inspect_png(png)
    assert (seen.colour, seen.shape, seen.background) == ("blue", "circle", "black"), seen


# Seeds read right in-process with and without the adapter (training-colour-lora.json: 10 of 12
# check prompts come out blue at scale 1, all 12 in their own colour at scale 0).
@pytest.mark.parametrize(
    ("colour", "shape", "background", "seed"),
    [
        ("red", "circle", "black", 11),
        ("yellow", "triangle", "gray", 13),
    ],
)
def test_the_colour_adapter_paints_the_shape_blue_and_keeps_the_rest(
    fleet: RunningFleet,
    colour: str,
    shape: str,
    background: str,
    seed: int,
) -> None:
    _, plain = draw_on_m2(fleet, FILLED, colour, shape, background, seed)
    job_id, adapted = draw_on_m2(
        fleet, FILLED, colour, shape, background, seed, adapters=[{"id": COLOUR_LORA, "scale": 1.0}]
    )
    _, zero = draw_on_m2(fleet, FILLED, colour, shape, background, seed, adapters=[{"id": COLOUR_LORA, "scale": 0.0}])
    assert (plain.colour, plain.shape, plain.background) == (colour, shape, background), plain
    assert (adapted.colour, adapted.shape, adapted.background, adapted.style) == (
        LORA_COLOUR,
        shape,
        background,
        "filled",
    ), adapted
    assert zero == plain  # scale 0: the base model's picture
    done = fleet.client.get(job_id)
    assert done["cold_load"] is False and done["provenance"]["adapters"][0]["id"] == COLOUR_LORA
