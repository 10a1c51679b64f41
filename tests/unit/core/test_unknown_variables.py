"""A misspelt ``HOMEFLEET_*`` variable is named with the settings it may have meant: every one
as close as the closest, so a tie never names the wrong one alone."""

from __future__ import annotations

from app.core.config import unknown_variables


def test_a_typo_equally_near_two_settings_names_both() -> None:
    [line] = unknown_variables({"HOMEFLEET_API_KEYZ": '["a"]'})
    assert line == (
        "HOMEFLEET_API_KEYZ is not a Homefleet setting; it is ignored "
        "(did you mean HOMEFLEET_API_KEY or HOMEFLEET_API_KEYS?)"
    )


def test_a_typo_nearest_one_setting_names_it_and_nothing_far_is_suggested() -> None:
    assert unknown_variables({"HOMEFLEET_MAX_QUEUED_PER_MACHIN": "3", "HOMEFLEET_DATA_DIR": "/x"}) == [
        "HOMEFLEET_MAX_QUEUED_PER_MACHIN is not a Homefleet setting; it is ignored "
        "(did you mean HOMEFLEET_MAX_QUEUED_PER_MACHINE?)"
    ]
    assert unknown_variables({"HOMEFLEET_ZZZZZZZZZZZZZZZZZZZZZZZZZZZ": "1"}) == [
        "HOMEFLEET_ZZZZZZZZZZZZZZZZZZZZZZZZZZZ is not a Homefleet setting; it is ignored"
    ]
