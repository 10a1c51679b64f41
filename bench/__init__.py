"""Benchmarks: each prints figures, never asserts them (docs/benchmarks.md)."""

from __future__ import annotations

import argparse

FORKSERVER_HELP = (
    "fork the fleet's API and worker processes from one preloaded interpreter (app/devtools/forkserver.py): "
    "faster starts, for smoke runs; start-time figures then measure forked starts, not exec'd ones"
)


def add_forkserver_flag(parser: argparse.ArgumentParser, also: str = "") -> None:
    """Add ``--forkserver`` (default off: the fleet's processes are exec'd, as a real host starts
    them) to a bench that starts a :class:`app.devtools.localfleet.LocalFleet`; ``also`` ends the
    help with what else the flag changes in that bench's figures."""
    parser.add_argument("--forkserver", action="store_true", help=FORKSERVER_HELP + also)


def parse_submissions(argv: list[str] | None, doc: str, default: int) -> int:
    """The optional ``SUBMISSIONS`` argument (submissions counted per loop) of a bench whose
    module docstring is ``doc``, from ``argv`` (None: ``sys.argv``)."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument(
        "submissions", nargs="?", type=int, default=default, help=f"counted per loop (default {default})"
    )
    return int(parser.parse_args(argv).submissions)
