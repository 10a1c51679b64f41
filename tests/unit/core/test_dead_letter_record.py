"""A dead letter's record is bounded whatever was pushed (R8; docs/operations.md, "Dead
letters"): the message's head, its size and its digest, not the whole message."""

from __future__ import annotations

import json

from app.core.dead_letters import RAW_HEAD_CHARS, dead_letter
from app.core.digest import bytes_digest


def test_r8_a_20_mb_message_costs_a_few_kib_and_is_still_identified() -> None:
    raw = "not json {" + "x" * 20_000_000
    record = dead_letter(raw, "machine.m1", ValueError("Expecting value: line 1 column 1 (char 0)"))
    assert len(record) < RAW_HEAD_CHARS + 1024
    letter = json.loads(record)
    assert letter["raw"] == raw[:RAW_HEAD_CHARS] and letter["raw"].startswith("not json {")
    assert letter["raw_bytes"] == len(raw) and letter["raw_digest"] == bytes_digest(raw.encode())
    assert (letter["queue"], letter["error"]) == ("machine.m1", "ValueError: Expecting value: line 1 column 1 (char 0)")


def test_r8_a_short_message_is_kept_whole() -> None:
    letter = json.loads(dead_letter("not json {", None, ValueError("bad")))
    assert (letter["raw"], letter["raw_bytes"]) == ("not json {", 10)
