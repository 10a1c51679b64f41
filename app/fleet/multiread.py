"""Many Redis reads in one command: a small Lua script runs ``GET``/``SMEMBERS``/``HGETALL``/
``EXISTS`` over a list of keys server-side and returns every reply at once; ``PROGRESS`` reads
a running job's step fields (``app.fleet.running.STEP_FIELDS``, by ``HMGET``: not its text).

``HGETALL_SINCE`` reads a versioned hash only when it changed: the read names the version and
field count the caller last saw; the hash's version lives at ``<key>:version`` (a token its
writers replace in the same atomic step as each change: app/fleet/reservations.py). The reply
is ``[version]`` when both still match, else ``[version or nil, the flat hash]``. A hash
deleted or emptied behind its writers' back changes its field count; a lost version key (Redis
lost its data) reads in full.

A pipeline of the same reads costs one round trip but still one parsed reply per command on
the client; for placement's snapshot of a fleet (7 reads per machine, read at every
submission under the fleet lock) that per-command cost dominated the submission time
(bench/placement.py, submit_vs_bare). The script also reads all keys at one instant.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import redis

from app.fleet.running import STEP_FIELDS

READS = frozenset({"GET", "SMEMBERS", "HGETALL", "EXISTS", "HGETALL_SINCE", "PROGRESS"})

# KEYS: the keys; ARGV: for each key in turn its read command, then, for HGETALL_SINCE, the
# version and field count last seen. Replies come back in order; a missing string is false (nil
# on the client). Scripts reply in RESP2, so HGETALL is a flat list.
_SCRIPT = """
local out = {}
local a = 1
for i, key in ipairs(KEYS) do
  local command = ARGV[a]
  a = a + 1
  if command == 'HGETALL_SINCE' then
    local known, known_len = ARGV[a], tonumber(ARGV[a + 1])
    a = a + 2
    local version = redis.call('GET', key .. ':version')
    if version and version == known and redis.call('HLEN', key) == known_len then
      out[i] = {version}
    else
      out[i] = {version, redis.call('HGETALL', key)}
    end
  elseif command == 'PROGRESS' then
    out[i] = redis.call('HMGET', key, PROGRESS_FIELDS)
  else
    out[i] = redis.call(command, key)
  end
end
return out
""".replace("PROGRESS_FIELDS", ", ".join(f"'{name}'" for name in STEP_FIELDS))

Read = tuple[str, str] | tuple[str, str, str, int]
"""``(command, key)``, or ``("HGETALL_SINCE", key, version seen, field count seen)``."""


class MultiRead:
    """Reads ``(command, key)`` pairs (:data:`Read`) in one server-side call (see the module docstring)."""

    def __init__(self, client: redis.Redis) -> None:
        self._script = client.register_script(_SCRIPT)

    def __call__(self, reads: Sequence[Read]) -> list[Any]:
        """Replies to ``reads`` in order: GET -> str | None, SMEMBERS -> set[str], HGETALL ->
        dict[str, str], EXISTS -> bool, HGETALL_SINCE -> (version | None, dict[str, str] | None:
        None when unchanged), PROGRESS -> list of str | None, one per ``STEP_FIELDS``.

        Raises:
            ValueError: a command is not one of :data:`READS`.
        """
        if not reads:
            return []
        commands = [read[0] for read in reads]
        unknown = set(commands) - READS
        if unknown:
            raise ValueError(f"MultiRead reads only {sorted(READS)}; got {sorted(unknown)}")
        args: list[str | int] = []
        for read in reads:
            args.append(read[0])
            if read[0] == "HGETALL_SINCE":
                args += [read[2] or "", read[3]]  # type: ignore[misc]
        replies = self._script(keys=[read[1] for read in reads], args=args)
        return [_shape(command, reply) for command, reply in zip(commands, replies, strict=True)]


def _shape(command: str, reply: Any) -> Any:
    if command == "HGETALL_SINCE":
        version = reply[0] or None
        return (version, _shape("HGETALL", reply[1]) if len(reply) > 1 else None)
    if command == "SMEMBERS":
        return set(reply or ())
    if command == "HGETALL":
        flat = reply or []
        return dict(zip(flat[::2], flat[1::2], strict=True))
    if command == "EXISTS":
        return bool(reply)
    return reply
