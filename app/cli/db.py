"""``homefleet db …``: the journal's schema and its pairing with Redis. ``db upgrade`` (and
``serve``) are the only commands that migrate the schema; every other command checks that the
journal is at the newest revision and refuses otherwise, naming ``homefleet db upgrade``."""

from __future__ import annotations

import typer

from app.cli.common import console, server_settings

db_cli = typer.Typer(help="The journal's database schema (Alembic migrations).", no_args_is_help=True)


@db_cli.command("upgrade")
def db_upgrade() -> None:
    """Create or migrate the journal's schema to the newest revision (HOMEFLEET_DATABASE_URL)."""
    from app.db.engine import create_engine
    from app.db.migrations import current_revision, upgrade

    engine = create_engine(server_settings())
    try:
        before = current_revision(engine)
        upgrade(engine)
        after = current_revision(engine)
    finally:
        engine.dispose()
    change = "already at" if before == after else f"migrated from {before or 'no schema'} to"
    console.print(f"{engine.url.render_as_string(hide_password=True)}: {change} revision {after}", highlight=False)


@db_cli.command("pair")
def db_pair() -> None:
    """Make HOMEFLEET_REDIS_URL run with this journal (HOMEFLEET_DATA_DIR / HOMEFLEET_DATABASE_URL),
    replacing the journal it ran with: once, after replacing the journal on purpose. The next
    reconciliation releases the reservations of jobs this journal does not know."""
    from app.core.connections import create_redis, redacted_url
    from app.core.keys import Keys
    from app.db.engine import check_journal_file, check_revision, create_engine
    from app.fleet.pairing import pair

    settings = server_settings()
    check_journal_file(settings)
    engine, client = create_engine(settings), create_redis(settings)
    try:
        check_revision(engine)
        previous, mine = pair(client, Keys(settings.key_prefix), engine, settings.data_dir)
    finally:
        client.close()
        engine.dispose()
    console.print(
        f"{redacted_url(settings.redis_url)} runs with journal {mine} "
        f"({engine.url.render_as_string(hide_password=True)})"
        + (f"; it ran with {previous}" if previous and previous != mine else ""),
        highlight=False,
    )
