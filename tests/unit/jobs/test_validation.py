"""R22 limits and R23's placement filter as pure unit tests (no Redis, no HTTP)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from pydantic import ValidationError

from app.core.config import Settings
from app.core.errors import Overloaded, Rejected, from_core
from app.core.limits import FamilyLimits, limits_for
from app.jobs.validation import check_submission, check_upload
from routing.errors import Full
from routing.placement import AUTO, JobRequest, MachineView, dry_run, place

MODEL = "tiny-sd"


def view(name: str, backlog: int = 0, max_queued: int | None = 2) -> MachineView:
    return MachineView(
        name=name,
        online=True,
        families=frozenset({"sd1"}),
        verified_models=frozenset({MODEL}),
        backlog=backlog,
        max_queued=max_queued,
    )


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"width": 65}, "`width` must be a multiple of 8 and at least 8 pixels, got 65"),
        ({"height": 4}, "`height` must be a multiple of 8 and at least 8 pixels, got 4"),
        (
            {"width": 1032, "height": 1024},
            "`width` x `height` must be at most 1048576 pixels, got 1032 x 1024 = 1056768",
        ),
        ({"steps": 0}, "`steps` must be between 1 and 150, got 0"),
        ({"steps": True}, "`steps` must be an integer, got True"),
        ({"steps": 1e308}, "`steps` must be an integer, got 1e+308"),  # not a 309-digit number
        ({"steps": 151.0}, "`steps` must be between 1 and 150, got 151"),  # a whole float counts as its integer
        ({"frames": 65}, "`frames` must be between 1 and 64, got 65"),  # the video kind's own name
        ({"prompt": "x " * 3000}, "`prompt` must be at most 4096 characters (max_prompt_chars), got 6000"),
        ({"n": 5}, "`n` must be between 1 and 4 (max_batch), got 5"),
        ({"negative_prompt": 3}, "`negative_prompt` must be a string, got int"),
        ({"user_message": ["hi"]}, "`user_message` must be a string, got list"),  # a chat's, as the page shows it
        ({"user_message": "x" * 4097}, "`user_message` must be at most 4096 characters (max_prompt_chars), got 4097"),
    ],
)
def test_r22_check_submission_names_field_value_and_limit(params: dict[str, object], message: str) -> None:
    with pytest.raises(Rejected) as refused:
        check_submission({"prompt": "x", **params}, FamilyLimits())
    assert refused.value.message.startswith(message)
    assert refused.value.reason.startswith("invalid_")


def test_r22_txt2img_needs_a_prompt() -> None:
    for params, got in (
        ({}, "none was given"),
        ({"prompt": ""}, "it is empty"),
        ({"prompt": " \n"}, "only whitespace"),
    ):
        with pytest.raises(Rejected, match="`prompt` is required for kind txt2img") as refused:
            check_submission(params, FamilyLimits(), kind="txt2img")
        assert got in refused.value.message and "None" not in refused.value.message
    check_submission({}, FamilyLimits(), kind="upscale")


def test_r22_limits_at_the_bound_pass_and_tokens_use_the_given_counter() -> None:
    limits = FamilyLimits(max_prompt_tokens=5)
    check_submission({"prompt": "abc", "width": 1024, "height": 1024, "steps": 150, "n": 4}, limits, count_tokens=len)
    with pytest.raises(Rejected, match=r"at most 5 tokens .* got 6"):
        check_submission({"prompt": "abcdef"}, limits, count_tokens=len)
    check_submission({"prompt": "abc", "user_message": "abcdef"}, limits, count_tokens=len)  # shown, not tokenized


def test_r22_limits_for_falls_back_to_default_then_builtin() -> None:
    small = FamilyLimits(max_steps=3)
    assert limits_for({"sd1": small, "default": FamilyLimits(max_steps=9)}, "sd1").max_steps == 3
    assert limits_for({"default": FamilyLimits(max_steps=9)}, "wan").max_steps == 9
    assert limits_for({}, "wan").max_steps == 150


def test_r22_check_upload_bounds_bytes_and_media_type() -> None:
    limits = FamilyLimits(max_upload_bytes=10)
    check_upload(10, "image/png", limits)
    with pytest.raises(Rejected, match=r"`image` must be at most 10 bytes \(max_upload_bytes\), got 11"):
        check_upload(11, "image/png", limits)
    with pytest.raises(
        Rejected,
        match=r"`image` must be one of image/png, image/jpeg, image/webp \(upload_media_types\), got 'text/plain'",
    ):
        check_upload(1, "text/plain", limits)


def test_r23_a_pinned_full_machine_is_overloaded_and_auto_skips_it() -> None:
    fleet = {"m1": view("m1", backlog=2), "m2": view("m2", backlog=1)}
    with pytest.raises(Full) as full:
        place(JobRequest(MODEL, "sd1", "txt2img", "m1"), fleet)
    assert full.value.reason == "queue_full" and "max_queued_per_machine = 2" in full.value.message
    assert isinstance(from_core(full.value), Overloaded) and from_core(full.value).status_code == 429
    assert place(JobRequest(MODEL, "sd1", "txt2img", AUTO), fleet).machine == "m2"
    decision = dry_run(JobRequest(MODEL, "sd1", "txt2img", AUTO), fleet)
    assert decision["machines"]["m1"]["reason"] == "queue_full"  # type: ignore[index]
    fleet["m2"] = replace(fleet["m2"], backlog=2)
    with pytest.raises(Full):
        place(JobRequest(MODEL, "sd1", "txt2img", AUTO), fleet)


def test_r23_no_limit_set_means_no_queue_full() -> None:
    assert (
        place(JobRequest(MODEL, "sd1", "txt2img", "m1"), {"m1": view("m1", backlog=99, max_queued=None)}).machine
        == "m1"
    )


def test_r22_a_misspelt_family_limit_is_refused_at_start_not_ignored(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOMEFLEET_LIMITS", '{"sd1": {"max_pixelz": 5}}')
    with pytest.raises(ValidationError, match="max_pixelz"):
        Settings()
    monkeypatch.setenv("HOMEFLEET_LIMITS", '{"sd1": {"max_pixels": 4096}}')
    assert Settings().limits["sd1"].max_pixels == 4096


def test_integer_valued_floats_are_integers_for_every_integer_param() -> None:
    """JSON Schema's ``integer`` admits ``255.0`` (the fuzz run's schema-valid bodies had
    ``"noise_level": 255.0`` and ``"seed": 782.0`` refused): the seed and every integer number of a
    kind are taken as integers, as the sizes were; a fraction stays what it is."""
    from app.jobs.validation import INTEGER_PARAMS, integer_params

    assert {"seed", "noise_level", "max_new_tokens", "width", "steps"} <= set(INTEGER_PARAMS)
    converted = integer_params({"seed": 782.0, "noise_level": 255.0, "max_new_tokens": 16.0, "steps": 2.5})
    assert converted == {"seed": 782, "noise_level": 255, "max_new_tokens": 16}
    assert all(type(value) is int for value in converted.values())
