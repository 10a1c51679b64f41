"""``python -m app.cli``: the ``homefleet`` command."""

from app.cli.main import main

main()
