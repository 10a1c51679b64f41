"""Many Redis reads in one command: a small Lua script runs ``GET``/``SMEMBERS``/``HGETALL``/
``EXISTS`` over a list of keys server-side and returns every reply at once.

A pipeline of the same reads costs one round trip but still one parsed reply per command on
the client; for placement's snapshot of a fleet (7 reads per machine, read at every
submission under the fleet lock) that per-command cost dominated the submission time
(bench/placement.py, submit_vs_bare). The script also reads all keys at one instant.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import redis

READS = frozenset({"GET", "SMEMBERS", "HGETALL", "EXISTS"})

# KEYS: the keys; ARGV[i]: the read command for KEYS[i]. Replies come back in order; a missing
# string is false (nil on the client). Scripts reply in RESP2, so HGETALL is a flat list.
_SCRIPT = """
local out = {}
for i, key in ipairs(KEYS) do
  out[i] = redis.call(ARGV[i], key)
end
return out
"""


class MultiRead:
    """Reads ``(command, key)`` pairs in one server-side call (see the module docstring)."""

    def __init__(self, client: redis.Redis) -> None:
        self._script = client.register_script(_SCRIPT)

    def __call__(self, reads: Sequence[tuple[str, str]]) -> list[Any]:
        """Replies to ``reads`` in order: GET -> str | None, SMEMBERS -> set[str], HGETALL ->
        dict[str, str], EXISTS -> bool.

        Raises:
            ValueError: a command is not one of :data:`READS`.
        """
        if not reads:
            return []
        commands = [command for command, _ in reads]
        unknown = set(commands) - READS
        if unknown:
            raise ValueError(f"MultiRead reads only {sorted(READS)}; got {sorted(unknown)}")
        replies = self._script(keys=[key for _, key in reads], args=commands)
        return [_shape(command, reply) for command, reply in zip(commands, replies, strict=True)]


def _shape(command: str, reply: Any) -> Any:
    if command == "SMEMBERS":
        return set(reply or ())
    if command == "HGETALL":
        flat = reply or []
        return dict(zip(flat[::2], flat[1::2], strict=True))
    if command == "EXISTS":
        return bool(reply)
    return reply
