"""Ids minted from the names people's files have (R1): accents folded, the rest made dashes."""

from __future__ import annotations

from app.store.registry import _mint_id


def test_r1_an_id_is_minted_from_any_name() -> None:
    assert _mint_id("My LoRA (v2) – Ünïcode", set()) == "my-lora-v2-unicode"
    assert _mint_id("日本語", set()) == "model"
    assert (
        _mint_id("stable-diffusion-v1-5", {"stable-diffusion-v1-5", "stable-diffusion-v1-5-2"})
        == "stable-diffusion-v1-5-3"
    )
    assert len(_mint_id("x" * 200, set())) == 56
