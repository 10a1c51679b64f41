"""R22 at registration: a model's own default that every job would be refused for (a size off the
family's multiple, steps that are no integer, n past max_batch, a prompt that is no string) is
refused by ``models add`` with ``invalid_default`` naming ``defaults.<param>``, and nothing is
registered; it used to register, and then every job not setting the param was refused for a
value its client never sent."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from app.context import ServerContext
from app.core.errors import NotFound, Rejected


@pytest.mark.parametrize(
    ("defaults", "param", "said"),
    [
        ({"steps": "abc"}, "defaults.steps", "default `steps` must be an integer, got 'abc'"),
        ({"steps": 0}, "defaults.steps", "default `steps` must be"),
        ({"width": 63}, "defaults.width", "default `width` must be a multiple of 8"),
        ({"height": -8}, "defaults.height", "default `height` must be a multiple of 8"),
        ({"n": 0}, "defaults.n", "default `n` must be"),
        ({"negative_prompt": 5}, "defaults.negative_prompt", "default `negative_prompt` must be a string"),
        ({"width": 4096, "height": 4096}, "defaults.width", "default `width` x `height` must be at most"),
    ],
)
def test_a_default_every_job_would_be_refused_for_is_refused_at_registration(
    ctx: ServerContext, tiny_models_dir: Path, defaults: dict[str, Any], param: str, said: str
) -> None:
    with pytest.raises(Rejected) as refused:
        ctx.registry.add(tiny_models_dir / "tiny-sd", "tiny-sd-bad", defaults=defaults)
    assert (refused.value.reason, refused.value.param) == ("invalid_default", param)
    assert refused.value.message.startswith(said), refused.value.message
    with pytest.raises(NotFound):
        ctx.registry.get("tiny-sd-bad")  # nothing registered: the id stays free


def test_defaults_within_the_limits_register(ctx: ServerContext, tiny_models_dir: Path) -> None:
    good = {"steps": 4, "width": 32, "height": 32, "n": 2, "negative_prompt": "blurry", "guidance_scale": 4}
    assert ctx.registry.add(tiny_models_dir / "tiny-sd", "tiny-sd-good", defaults=good).defaults == good
