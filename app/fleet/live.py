"""The live fleet file and the join tokens of new machines (docs/operations.md, "Add a machine").

One home for the fleet's machines: the fleet file (``HOMEFLEET_FLEET_FILE``) stays the
declarative source. ``homefleet machines add|remove|rotate-token`` rewrite it here, atomically
(a temporary file in the same folder, mode 0600, fsync, rename), keeping its comments when
``tomlkit`` is installed (else it is rendered again by :meth:`app.fleet.config.Fleet.to_toml`),
and the running server reloads it (app/api/fleet_reload.py) without a restart.

A join token is what ``homefleet machines add`` prints in the join command: single use,
expiring (``join_token_ttl_s``, 15 minutes by default), stored only as its SHA-256 in Redis
(``Keys.join_token``). It is not the machine's token: the server hands that over once the join
token is redeemed (``POST /internal/v1/join``).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import secrets
import tempfile
import time
import tomllib
from collections.abc import Callable, Iterator, MutableMapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import redis

from app.core.errors import ConfigError, Unauthorized
from app.core.keys import Keys
from app.fleet.config import Backend, Fleet
from residency.device import MemoryKind

#: the fleet file holds every machine's token: readable by its owner only
FLEET_FILE_MODE = 0o600
#: a spent or expired join token is remembered this long beyond its lifetime, so that its reuse is
#: answered ``join_token_used``/``join_token_expired``, not ``join_token_unknown``
JOIN_TOKEN_MEMORY_S = 3600
#: join tokens start with this, so that one pasted in the wrong place is recognisable
JOIN_TOKEN_PREFIX = "hfj_"


def memory_kind_of(backend: Backend | str) -> MemoryKind:
    """A CUDA card's memory is dedicated; a CPU's RAM and Apple's memory are unified."""
    return MemoryKind.dedicated if Backend(backend) == Backend.cuda else MemoryKind.unified


def text_digest(text: str) -> str:
    """SHA-256 (hex) of a fleet file's text: what the server reports it loaded (``Keys.fleet_loaded``)."""
    return hashlib.sha256(text.encode()).hexdigest()


def parse(text: str, where: Path | str) -> Fleet:
    """The fleet ``text`` holds.

    Raises:
        ConfigError: not TOML (naming ``where``).
        ValueError: not a valid fleet (pydantic's message).
    """
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"the fleet file {where} is not valid TOML: {error}") from error
    return Fleet.model_validate(data)


TABLE_AFTER_TEXT = re.compile(r"([^\n])\n(\[\[?[\w.\"'-]+\]\]?[ \t]*(?:#[^\n]*)?\n)")
"""A table's header line (``[[machines]]``, ``[models.tiny-sd]``) right after a line of text:
tomlkit puts an appended ``[[machines]]`` entry against the table that follows it."""


def edit(text: str, change: Callable[[list[MutableMapping[str, Any]]], None]) -> str:
    """``text`` with ``change`` applied to its ``[[machines]]`` entries (a list it may append
    to, delete from or edit in place), comments kept when tomlkit is installed.

    Raises:
        ValueError: the result is not a valid fleet (pydantic's message).
    """
    try:
        import tomlkit
    except ImportError:  # an optional nicety: without it the file is rendered again, comments lost
        tomlkit = None  # type: ignore[assignment]
    if tomlkit is not None:
        document = tomlkit.parse(text)
        if "machines" not in document:
            document["machines"] = tomlkit.aot()
        entries = document["machines"]
        wrapped = _TomlkitEntries(entries, tomlkit)
        change(wrapped)
        new = TABLE_AFTER_TEXT.sub("\\1\n\n\\2", tomlkit.dumps(document))  # a blank line before each table
    else:
        data = tomllib.loads(text)
        change(data.setdefault("machines", []))
        new = Fleet.model_validate(data).to_toml()
    Fleet.model_validate(tomllib.loads(new))
    return new


class _TomlkitEntries(list):
    """A list view of tomlkit's array of tables whose ``append``/``del`` reach the document."""

    def __init__(self, aot: Any, tomlkit: Any) -> None:
        super().__init__(aot)
        self.aot, self.tomlkit = aot, tomlkit

    def append(self, entry: Any) -> None:
        item = self.tomlkit.item(dict(entry))
        super().append(item)
        self.aot.append(item)

    def __delitem__(self, index: Any) -> None:
        super().__delitem__(index)
        del self.aot[index]


@contextmanager
def editing(path: Path) -> Iterator[None]:
    """Hold an exclusive lock (``flock`` on ``.<name>.lock`` beside the file) for a
    read-change-write of the fleet file, so two ``homefleet machines`` commands at once do not
    lose one's change."""
    with open(path.with_name(f".{path.name}.lock"), "a") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock.fileno(), fcntl.LOCK_UN)


def write_atomically(path: Path, text: str) -> None:
    """Replace ``path`` by ``text`` in one rename: a temporary file in the same folder, mode
    0600 (:data:`FLEET_FILE_MODE`), flushed to disk first. A reader sees the old or the new text,
    never a part."""
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, FLEET_FILE_MODE)
        with os.fdopen(fd, "w") as out:
            out.write(text)
            out.flush()
            os.fsync(out.fileno())
        os.replace(name, path)
    except BaseException:
        Path(name).unlink(missing_ok=True)
        raise


def new_machine_entry(
    name: str, backend: Backend, memory_bytes: int, families: list[str], speed: float = 1.0
) -> dict[str, Any]:
    """A fleet-file entry for a new machine with a fresh token (32 random bytes, urlsafe)."""
    return {
        "name": name,
        "backend": str(backend),
        "memory_kind": str(memory_kind_of(backend)),
        "memory_bytes": memory_bytes,
        "families": sorted(families),
        "token": secrets.token_urlsafe(32),
        "speed": speed,
    }


def token_digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


class JoinTokens:
    """Single-use, expiring join tokens in Redis, stored hashed (module docstring)."""

    def __init__(self, client: redis.Redis, keys: Keys, ttl_s: float) -> None:
        self.redis, self.keys, self.ttl_s = client, keys, ttl_s

    def issue(self, machine: str, machine_token: str, ttl_s: float | None = None) -> str:
        """A new join token for ``machine``, valid ``ttl_s`` seconds (default ``join_token_ttl_s``),
        that hands over ``machine_token`` only: once the machine's token in the fleet changes
        (``rotate-token``, ``remove`` and ``add`` again, an edit by hand) it is refused
        (:meth:`require_issued_for`). The record keeps that token's SHA-256, never the token."""
        ttl = self.ttl_s if ttl_s is None else ttl_s
        token = JOIN_TOKEN_PREFIX + secrets.token_urlsafe(32)
        key = self.keys.join_token(token_digest(token))
        with self.redis.pipeline() as pipe:
            pipe.hset(
                key,
                mapping={
                    "machine": machine,
                    "expires_at": repr(time.time() + ttl),
                    "spent": 0,
                    "machine_token": token_digest(machine_token),
                },
            )
            pipe.expire(key, int(ttl) + JOIN_TOKEN_MEMORY_S)
            pipe.execute()
        return token

    def peek(self, token: str) -> str:
        """The machine ``token`` joins, if it may still be redeemed.

        Raises:
            Unauthorized: reason ``join_token_unknown`` (never issued, or long gone),
                ``join_token_used`` (redeemed already: single use) or ``join_token_expired``.
        """
        raw = self.redis.hgetall(self.keys.join_token(token_digest(token)))
        record = {_text(k): _text(v) for k, v in raw.items()}
        if "machine" not in record:
            raise Unauthorized(
                "the join token is not one this server issued (or it expired over an hour ago); "
                "`homefleet machines add` or `rotate-token` prints a new one",
                reason="join_token_unknown",
            )
        if record.get("spent", "0") != "0":
            raise Unauthorized(
                f"the join token of machine {record['machine']!r} was used already (single use); "
                f"`homefleet machines rotate-token {record['machine']}` prints a new one",
                reason="join_token_used",
            )
        if float(record["expires_at"]) < time.time():
            raise Unauthorized(
                f"the join token of machine {record['machine']!r} expired; "
                f"`homefleet machines rotate-token {record['machine']}` prints a new one",
                reason="join_token_expired",
            )
        return record["machine"]

    def require_issued_for(self, token: str, machine_token: str) -> None:
        """Refuse a join token issued before the machine's token changed: it would hand the new
        token to whoever holds an old join command (one printed before ``rotate-token``, or for a
        machine of that name since removed).

        Raises:
            Unauthorized: reason ``join_token_superseded``.
        """
        raw = self.redis.hgetall(self.keys.join_token(token_digest(token)))
        record = {_text(k): _text(v) for k, v in raw.items()}
        issued_for = record.get("machine_token")  # absent: issued by an older version, which kept none
        if issued_for is not None and issued_for != token_digest(machine_token):
            machine = record.get("machine", "?")
            raise Unauthorized(
                f"the join token of machine {machine!r} was issued before its token changed (`homefleet machines "
                f"rotate-token`, or the machine removed and added again): only the newest join command hands it "
                f"over; `homefleet machines rotate-token {machine}` prints a new one",
                reason="join_token_superseded",
            )

    def redeem(self, token: str) -> str:
        """Spend ``token`` (atomically: of two concurrent redemptions one wins); its machine.

        Raises:
            Unauthorized: as :meth:`peek`, and ``join_token_used`` for the loser of a race.
        """
        machine = self.peek(token)
        if self.redis.hincrby(self.keys.join_token(token_digest(token)), "spent", 1) != 1:
            raise Unauthorized(
                f"the join token of machine {machine!r} was used already (single use)", reason="join_token_used"
            )
        return machine


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def loaded_report(client: redis.Redis, keys: Keys) -> dict[str, Any] | None:
    """What the running server last did with the fleet file (``Keys.fleet_loaded``), or None."""
    raw = client.get(keys.fleet_loaded())
    return json.loads(raw) if raw else None


def running_fleet_note(client: redis.Redis, keys: Keys, path: Path) -> str:
    """What the running server did with the fleet file at ``path`` (its report,
    :func:`loaded_report`), for a command that cannot read that file: its refusal of this very
    text, or that it runs the file it loaded before; empty when Redis has no report (no server
    ran here) or cannot be read."""
    try:
        report = loaded_report(client, keys)
        text = path.read_text()
    except (redis.RedisError, OSError, ValueError):
        return ""
    if not report:
        return ""
    at = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(report.get("at", 0))))
    if report.get("digest") == text_digest(text) and report.get("state") == "refused":
        return (
            f"; the running server (pid {report.get('pid')}) refused this file at {at} and keeps running the "
            "fleet it loaded before: fix the file and it reloads it by itself"
        )
    return f"; the running server (pid {report.get('pid')}) keeps running the fleet it loaded before (at {at})"


def report_loaded(
    client: redis.Redis, keys: Keys, digest: str, state: str, reason: str = "", path: Path | None = None
) -> None:
    """Record that the server ``loaded`` or ``refused`` the fleet file of ``digest`` at ``path``,
    or (state ``embedded``, no digest) that it runs the embedded default fleet: what
    :func:`fleet_file_refusal` compares a command's settings with."""
    record = {"digest": digest, "state": state, "reason": reason, "at": time.time(), "pid": os.getpid()}
    if path is not None:
        record["path"] = str(path.resolve())
    client.set(keys.fleet_loaded(), json.dumps(record))


def fleet_file_refusal(client: redis.Redis, keys: Keys) -> str | None:
    """Why a command without ``HOMEFLEET_FLEET_FILE`` must not act on the embedded default fleet:
    the last server on this Redis ran a fleet file (its report, :func:`report_loaded`), whose
    machines the command would not see (it would drain, commit or forget a machine that fleet
    does not have, or list one it has not). None when no server reported, or it ran the
    embedded default fleet too, or Redis cannot be read (the command says so where it needs it)."""
    try:
        report = loaded_report(client, keys)
    except (redis.RedisError, ValueError):
        return None
    if not report or report.get("state") not in ("loaded", "refused"):
        return None
    at = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(report.get("at", 0))))
    path = report.get("path")
    which = f"the fleet file {path}" if path else "a fleet file"
    fix = f"HOMEFLEET_FLEET_FILE={path}" if path else "HOMEFLEET_FLEET_FILE to that file"
    return (
        f"HOMEFLEET_FLEET_FILE is not set, but the server on this Redis (pid {report.get('pid')}, at {at}) runs "
        f"{which}, not the embedded default fleet this command would act on; set {fix} (a server started "
        "without HOMEFLEET_FLEET_FILE records the embedded fleet instead)"
    )
