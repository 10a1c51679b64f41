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

import redis
from sqlalchemy.engine import Engine
from sqlmodel import Field, Session, SQLModel, select

from app.connections import redacted_url
from app.errors import ConfigError
from app.keys import Keys


class JournalIdentity(SQLModel, table=True):
    """The one row naming this journal (written by migration ``b7c4e2f19a30``)."""

    id: str = Field(primary_key=True)  # 32 hex characters


def journal_id(engine: Engine) -> str:
    """The identity of the journal behind ``engine``.

    Raises:
        ConfigError: the journal has no identity row (its schema was not migrated).
    """
    with Session(engine) as session:
        found = session.exec(select(JournalIdentity.id)).first()
    if found is None:
        raise ConfigError(f"the journal at {engine.url.render_as_string(hide_password=True)} has no identity; "
                          "run `homefleet db upgrade`")
    return found


def check_pairing(client: redis.Redis, keys: Keys, engine: Engine, redis_url: str, record: bool = True,
                  require: bool = False) -> str:
    """Record this journal's identity in Redis if none is recorded (only with ``record``: the
    server does; CLI commands do not); return it. With ``require``, a Redis that records no
    journal yet is refused too (a command about to change the fleet that cannot tell whether
    its journal is the server's).

    Raises:
        ConfigError: Redis already records another journal (reason ``journal_mismatch``): this
            process was started with another ``HOMEFLEET_DATA_DIR``/``HOMEFLEET_DATABASE_URL``
            than the server's; or, with ``require``, records none (``journal_unpaired``).
            Nothing was changed.
    """
    mine = journal_id(engine)
    if record:
        client.set(keys.journal(), mine, nx=True)
    recorded = client.get(keys.journal())
    if recorded is not None and recorded != mine:
        raise ConfigError(
            f"the Redis at {redacted_url(redis_url)} (key prefix {keys.prefix!r}) belongs to another journal "
            f"({recorded}); this process opened the journal at "
            f"{engine.url.render_as_string(hide_password=True)} ({mine}). Give it the server's "
            "HOMEFLEET_DATA_DIR (or HOMEFLEET_DATABASE_URL); if this journal replaces the old one on purpose, "
            "run `homefleet db pair` once", reason="journal_mismatch",
        )
    if recorded is None and require:
        raise ConfigError(
            f"the Redis at {redacted_url(redis_url)} (key prefix {keys.prefix!r}) records no journal yet, so this "
            f"process cannot tell whether its journal ({engine.url.render_as_string(hide_password=True)}) is the "
            "server's: start `homefleet serve` (it records its journal), or run `homefleet db pair` to make this "
            "journal the fleet's", reason="journal_unpaired",
        )
    return mine


def pair(client: redis.Redis, keys: Keys, engine: Engine) -> tuple[str | None, str]:
    """Record this journal as the one the Redis runs with, replacing any other; return
    ``(previous, this)``. The next reconciliation releases the reservations of jobs this
    journal does not know."""
    mine = journal_id(engine)
    previous = client.getset(keys.journal(), mine)
    return previous, mine
