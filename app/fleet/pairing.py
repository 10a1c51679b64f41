"""The journal and the Redis it runs with are one pair.

Reconciliation (R19) trusts the journal about Redis: a reservation whose job the journal does
not know is released, a queued job whose message is gone is ``lost``. A process that opens
another journal beside the fleet's Redis (``homefleet reconcile`` run from another directory:
``data_dir`` is relative to the working directory; a second server with its own journal) would
release every live reservation and judge jobs it never saw. So each journal has an identity (a
random id written by the migration that created its table, ``journalidentity``), the first
server process records it in Redis (``<prefix>:journal``), and every process that reconciles,
serves or changes the fleet from the CLI checks that the two agree before it changes anything.
Not told apart: a backup of the same journal restored over it (it keeps its identity).
"""

from __future__ import annotations

from pathlib import Path
from typing import cast

import redis
from sqlalchemy.engine import Engine
from sqlmodel import Session, select

from app.core.config import Settings
from app.core.connections import redacted_url
from app.core.errors import ConfigError
from app.core.keys import Keys
from app.db.tables import JournalIdentity

MARK = "journal-id"  # the file in a data folder naming the journal it serves


def journal_id(engine: Engine) -> str:
    """The identity of the journal behind ``engine``.

    Raises:
        ConfigError: the journal has no identity row (its schema was not migrated).
    """
    with Session(engine) as session:
        found = session.exec(select(JournalIdentity.id)).first()
    if found is None:
        raise ConfigError(
            f"the journal at {engine.url.render_as_string(hide_password=True)} has no identity; "
            "run `homefleet db upgrade`"
        )
    return found


class Pairing:
    """This process's journal (``engine``), its data folder and the fleet's Redis: see :meth:`check`."""

    def __init__(self, client: redis.Redis, keyspace: Keys, engine: Engine, settings: Settings) -> None:
        self.redis = client
        self.keys = keyspace
        self.engine = engine
        self.settings = settings

    def check(self, record: bool = True, require: bool = False) -> str:
        """:func:`check_pairing` of this process's journal, data folder and Redis."""
        return check_pairing(self.redis, self.keys, self.engine, self.settings, record, require)


def check_pairing(
    client: redis.Redis, keys: Keys, engine: Engine, settings: Settings, record: bool = True, require: bool = False
) -> str:
    """Check that the Redis runs with this process's journal and data folder; return the
    journal's identity.

    With ``record`` (the server: ``serve``, its reconciliation, the demo) the journal is
    recorded in Redis if none is, and the data folder is marked as this journal's (a file
    ``journal-id`` in ``data_dir``). Without it (CLI commands), once a server has recorded a
    journal, the data folder must carry that mark too: with a shared PostgreSQL journal, a
    command run with another ``HOMEFLEET_DATA_DIR`` would otherwise register models into a
    folder the server never reads. With ``require``, a Redis that records no journal yet is
    refused too (a command about to change the fleet that cannot tell whether its journal is
    the server's).

    Raises:
        ConfigError: Redis records another journal, or the data folder is not the server's
            (reason ``journal_mismatch``); or, with ``require``, Redis records none
            (``journal_unpaired``). Nothing was changed.
    """
    url = settings.redis_url
    journal = engine.url.render_as_string(hide_password=True)
    mine = journal_id(engine)
    where = f"journal {journal}, data folder {settings.data_dir.resolve()}"
    if record and client.set(keys.journal(), mine, nx=True):
        client.set(keys.journal_where(), where)
    recorded = cast("str | None", client.get(keys.journal()))  # decoded (create_redis)
    if recorded is not None and recorded != mine:
        theirs = cast("str | None", client.get(keys.journal_where()))
        raise ConfigError(
            f"the Redis at {redacted_url(url)} (key prefix {keys.prefix!r}) belongs to another journal "
            f"({recorded}{': ' + theirs if theirs else ''}); this process opened the journal at {journal} "
            f"({mine}). Give it that server's HOMEFLEET_DATA_DIR (or HOMEFLEET_DATABASE_URL); if this journal "
            "replaces the old one on purpose (a demo's journal, say), run `homefleet db pair` once",
            reason="journal_mismatch",
        )
    if recorded is None and require:
        raise ConfigError(
            f"the Redis at {redacted_url(url)} (key prefix {keys.prefix!r}) records no journal yet, so this "
            f"process cannot tell whether its journal ({journal}) is the server's: start `homefleet serve` (it "
            "records its journal), or run `homefleet db pair` to make this journal the fleet's",
            reason="journal_unpaired",
        )
    mark = settings.data_dir / MARK
    marked = mark.read_text().strip() if mark.is_file() else None
    if record and marked is None:
        settings.data_dir.mkdir(parents=True, exist_ok=True)
        mark.write_text(mine + "\n")
    elif marked != mine and (record or recorded is not None):
        raise ConfigError(
            f"the data folder {settings.data_dir} is not the one the server uses with the journal {mine} "
            f"({'it belongs to journal ' + marked if marked else 'it has no ' + MARK + ' file'}); give this "
            "process the server's HOMEFLEET_DATA_DIR: its models, inputs and results live there",
            reason="journal_mismatch",
        )
    return mine


def pair(client: redis.Redis, keys: Keys, engine: Engine, data_dir: Path) -> tuple[str | None, str]:
    """Record this journal as the one the Redis runs with, replacing any other, and mark
    ``data_dir`` as its data folder; return ``(previous, this)``. The next reconciliation
    releases the reservations of jobs this journal does not know."""
    mine = journal_id(engine)
    previous = cast("str | None", client.getset(keys.journal(), mine))  # decoded (create_redis)
    journal = engine.url.render_as_string(hide_password=True)
    client.set(keys.journal_where(), f"journal {journal}, data folder {data_dir.resolve()}")
    data_dir.mkdir(parents=True, exist_ok=True)
    (data_dir / MARK).write_text(mine + "\n")
    return previous, mine


_UNPAIR = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1], KEYS[2])
  return 1
end
return 0
"""


def unpair(client: redis.Redis, keys: Keys, mine: str) -> bool:
    """Forget that the Redis runs with journal ``mine``, if it still records that one (one Lua
    step: a pairing another journal has taken since is left alone); return whether it did. The
    next server to run with this Redis records its own journal, as on a Redis that never had
    one. For a process that paired a Redis it only borrowed (the demo on ``HOMEFLEET_REDIS_URL``):
    left paired, a fleet's server later started there was refused ``journal_mismatch``."""
    return bool(client.eval(_UNPAIR, 2, keys.journal(), keys.journal_where(), mine))
