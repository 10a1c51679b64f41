"""Per-family limits (R22): what a model family allows in one job (pixels, sides, steps,
frames, images per request, prompt tokens and characters, uploads). Settings hold them
(``HOMEFLEET_LIMITS``); ``app/jobs/validation.py`` checks submissions against them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field

from app.core.families import FAMILIES

DEFAULT_FAMILY = "default"

MAX_MODEL_ID = 64
"""A model id's characters at most (the API's ``model`` field, ``params.expand_prompt``)."""


class FamilyLimits(BaseModel):
    """Limits of one model family. Pixels are width x height of one image or frame. A key that
    is not one of these fields is refused (a misspelt limit would otherwise be ignored)."""

    model_config = ConfigDict(extra="forbid")

    multiple_of: int = Field(8, ge=1)  # width and height (the VAE downsamples by 8; diffusers' check_inputs)
    min_side: int = Field(8, ge=1)  # pixels
    max_pixels: int = Field(1024 * 1024, ge=1)  # width x height
    max_steps: int = Field(150, ge=1)
    max_frames: int = Field(64, ge=1)
    max_batch: int = Field(4, ge=1)  # images per OpenAI request (`n`: one job per image)
    max_prompt_tokens: int = Field(77, ge=1)  # CLIP text encoders: max_position_embeddings = 77
    max_prompt_chars: int = Field(4096, ge=1)  # checked before tokenizing (a huge prompt is cheap to refuse)
    max_upload_bytes: int = Field(16 * 1024 * 1024, ge=1)
    max_adapters: int = Field(4, ge=0)  # LoRA adapters per image job (`params.adapters`, issue 22)
    upload_media_types: list[str] = Field(default_factory=lambda: ["image/png", "image/jpeg", "image/webp"])
    # text models (issue 20; TGI's router): None = from the model's config.json (max_position_embeddings)
    max_input_tokens: int | None = Field(None, ge=1)  # prompt tokens (chat-templated for chat requests)
    max_total_tokens: int | None = Field(None, ge=2)  # prompt tokens + max_new_tokens: what the KV cache holds


def default_limits() -> dict[str, FamilyLimits]:
    """The built-in limits: a ``default`` entry (SD 1.x-sized), and an entry for each family
    whose own limits differ (``Family.limits`` in ``app/core/families.py``: T5 reads 512 prompt
    tokens, Qwen2.5-VL 1024, Wan takes 81 frames). Settings replace them as a whole, e.g.
    ``HOMEFLEET_LIMITS='{"default": {}, "sd1": {"max_pixels": 262144}}'``."""
    base = FamilyLimits()
    limits = {DEFAULT_FAMILY: base}
    for name, family in FAMILIES.items():
        if family.limits:
            limits[name] = base.model_copy(update=dict(family.limits))
    return limits


def limits_for(limits: Mapping[str, FamilyLimits], family: str) -> FamilyLimits:
    """The limits of ``family``, else ``default``, else the built-in defaults."""
    return limits.get(family) or limits.get(DEFAULT_FAMILY) or FamilyLimits()


@dataclass(frozen=True)
class TokenLimits:
    """A text model's limits in tokens (issue 20, as TGI's router enforces them): the prompt
    at most ``max_input_tokens``, prompt + ``max_new_tokens`` at most ``max_total_tokens``."""

    max_input_tokens: int
    max_total_tokens: int


def token_limits(family: FamilyLimits, max_positions: int, max_input_tokens: int | None = None,
                 max_total_tokens: int | None = None) -> TokenLimits:
    """The token limits of one text model: the model's own (``max_input_tokens`` /
    ``max_total_tokens``: the fleet file's ``[models.<id>]``), else its family's (settings), else
    ``max_positions`` (its config's ``max_position_embeddings``) total and one token less for the
    prompt. The prompt limit never exceeds the total's less one new token."""
    total = max_total_tokens or family.max_total_tokens or max_positions
    given = max_input_tokens or family.max_input_tokens or total - 1
    return TokenLimits(max_input_tokens=min(given, total - 1), max_total_tokens=total)
