"""Per-family limits (R22): what a model family allows in one job (pixels, sides, steps,
frames, images per request, prompt tokens and characters, uploads). Settings hold them
(``HOMEFLEET_LIMITS``); ``app/jobs/validation.py`` checks submissions against them.

Per-key quotas: what one API key may have in the fleet (jobs queued or running,
GPU-seconds in the last hour), :class:`KeyQuota`. Settings hold them
(``HOMEFLEET_API_KEY_QUOTAS``); ``app/jobs/quotas.py`` checks submissions against them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field

from app.core.digest import bytes_digest
from app.core.families import FAMILIES

DEFAULT_FAMILY = "default"

MAX_MODEL_ID = 64
"""A model id's characters at most (the API's ``model`` field, ``params.expand_prompt``)."""


MAX_IDEMPOTENCY_KEY = 255
"""Characters of an ``Idempotency-Key`` at most (and at least 1), on every route that takes one (R20)."""


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
    max_adapters: int = Field(4, ge=0)  # LoRA adapters per image job (`params.adapters`)
    upload_media_types: list[str] = Field(default_factory=lambda: ["image/png", "image/jpeg", "image/webp"])
    # text models (TGI's router): None = from the model's config.json (max_position_embeddings)
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
    """A text model's limits in tokens (as TGI's router enforces them): the prompt
    at most ``max_input_tokens``, prompt + ``max_new_tokens`` at most ``max_total_tokens``."""

    max_input_tokens: int
    max_total_tokens: int


def token_limits(
    family: FamilyLimits, max_positions: int, max_input_tokens: int | None = None, max_total_tokens: int | None = None
) -> TokenLimits:
    """The token limits of one text model: the model's own (``max_input_tokens`` /
    ``max_total_tokens``: the fleet file's ``[models.<id>]``), else its family's (settings), else
    ``max_positions`` (its config's ``max_position_embeddings``) total and one token less for the
    prompt. The prompt limit never exceeds the total's less one new token."""
    total = max_total_tokens or family.max_total_tokens or max_positions
    given = max_input_tokens or family.max_input_tokens or total - 1
    return TokenLimits(max_input_tokens=min(given, total - 1), max_total_tokens=total)


GPU_WINDOW_S = 3600
"""The GPU-seconds quota's rolling window (seconds): ``max_gpu_seconds_per_hour`` counts the
jobs that ended this long ago at most."""

KEY_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,31}$"
"""A quota's name: the key id its keys' jobs are journaled under (never holds ``:``, which the
digest id of an unnamed key does)."""

UNNAMED_KEY_PREFIX = "key:"
UNNAMED_KEY_HEX = 12


class KeyQuota(BaseModel):
    """The quota of the API keys that start with ``key_prefix``, under a name
    (``HOMEFLEET_API_KEY_QUOTAS='{"ci": {"key_prefix": "ci-", "max_queued_jobs": 3}}'``). The
    jobs of all its keys count together. A limit left out (None) is not checked; a quota with
    neither limit only names its keys (``homefleet keys``). A field that is not one of these
    is refused (a misspelt limit would otherwise be ignored).

    Attributes:
        key_prefix: how its keys begin (at least one character; may be a whole key).
        max_queued_jobs: jobs queued or running at once (>= 1).
        max_gpu_seconds_per_hour: seconds of load + run of the jobs that ended in the last
            :data:`GPU_WINDOW_S` seconds (> 0).
    """

    model_config = ConfigDict(extra="forbid")

    key_prefix: str = Field(min_length=1, max_length=256)
    max_queued_jobs: int | None = Field(None, ge=1)
    max_gpu_seconds_per_hour: float | None = Field(None, gt=0, allow_inf_nan=False)


def key_id(quotas: Mapping[str, KeyQuota], key: str) -> str:
    """The id a job submitted with API key ``key`` is journaled under (never the key itself):
    the name of the quota whose ``key_prefix`` it starts with, else ``key:`` and the first
    :data:`UNNAMED_KEY_HEX` hex digits of its BLAKE3 digest (e.g. ``key:3f2a9c01b4de``)."""
    for name, quota in quotas.items():
        if key.startswith(quota.key_prefix):
            return name
    return UNNAMED_KEY_PREFIX + bytes_digest(key.encode()).partition(":")[2][:UNNAMED_KEY_HEX]


def check_key_quotas(quotas: Mapping[str, KeyQuota], keys: list[str]) -> None:
    """Refuse quotas that would apply to nothing or to a key twice.

    Raises:
        ValueError: a quota's ``key_prefix`` starts none of ``keys``, or a key starts with the
            prefixes of two quotas (naming both); the message never shows a key.
    """
    for name, quota in quotas.items():
        if not any(key.startswith(quota.key_prefix) for key in keys):
            raise ValueError(
                f"api_key_quotas[{name!r}]: no key of api_keys starts with its key_prefix "
                f"({len(keys)} keys configured); a quota for no key would limit nothing"
            )
    for index, key in enumerate(keys):
        named = [name for name, quota in quotas.items() if key.startswith(quota.key_prefix)]
        if len(named) > 1:
            raise ValueError(
                f"api_keys[{index}] starts with the key_prefix of {len(named)} quotas "
                f"({', '.join(repr(n) for n in named)}); give each key one quota at most"
            )
