"""One home for a job's end (R14, R19): only app/jobs/endings.py calls the journal's transitions
that claim or end a job, and ``.finished(`` (release the reservation, learn the timings, count
the metrics, announce the task event, publish the change). A caller that ended a job by hand and
forgot ``finished`` leaked its reservation until the next reconciliation pass."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from app.core.states import ENDED, LEGAL, JobState

ROOT = Path(__file__).resolve().parents[3]
HOME = Path("app/jobs/endings.py")
JOURNAL = Path("app/journal/jobs.py")
# The journal's methods that move a job into running or an ended state (app/journal/jobs.py).
ENDING_METHODS = frozenset({"transition", "claim", "interrupt", "cancel", "succeed", "fail", "recover"})


def _is_journal(node: ast.expr) -> bool:
    """``journal``, ``self.journal``, ``ctx.journal``, ``dispatcher.journal``..."""
    return (isinstance(node, ast.Name) and node.id == "journal") or (
        isinstance(node, ast.Attribute) and node.attr == "journal"
    )


def offences(source: str) -> list[tuple[int, str]]:
    """``(line, call)`` of each journal end transition and each ``.finished(`` call in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        name = node.func.attr
        if name == "finished" or (name in ENDING_METHODS and _is_journal(node.func.value)):
            found.append((node.lineno, ast.unparse(node.func)))
    return sorted(found)


def test_the_scan_finds_each_kind_of_end_written_by_hand() -> None:
    source = (
        "ctx.dispatcher.finished(ctx.journal.fail(job_id, 'm1', 'error', 'boom'))\n"
        "self.journal.transition(job_id, [JobState.queued], JobState.interrupted)\n"
        "journal.cancel(job_id)\n"
        "ctx.dispatcher.cancel(job_id)\n"  # the dispatcher's cancel goes through endings: allowed
        "ctx.journal.get(job_id)\n"
    )
    assert offences(source) == [
        (1, "ctx.dispatcher.finished"),
        (1, "ctx.journal.fail"),
        (2, "self.journal.transition"),
        (3, "journal.cancel"),
    ]


def test_the_scanned_methods_are_the_journals_ways_into_running_or_an_end() -> None:
    """Each method the scan forbids exists on the journal, and every ended state is reachable
    (app.core.states.LEGAL): a renamed method would make the scan pass without checking."""
    from app.journal.jobs import Journal

    assert all(callable(getattr(Journal, name, None)) for name in ENDING_METHODS)
    reachable = {target for targets in LEGAL.values() for target in targets}
    assert set(ENDED) - {JobState.rejected} <= reachable  # rejected: written by Journal.add, never a transition


@pytest.mark.parametrize("package", ["app", "tasks"])
def test_no_job_ends_outside_app_jobs_endings(package: str) -> None:
    files = sorted((ROOT / package).rglob("*.py"))
    assert len(files) > 10  # the tree is where it should be
    found = {}
    for path in files:
        relative = path.relative_to(ROOT)
        if relative in (HOME, JOURNAL):
            continue
        if hits := offences(path.read_text(encoding="utf-8")):
            found[str(relative)] = hits
    assert found == {}, f"end jobs through app/jobs/endings.py (Endings), not by hand: {found}"


def test_endings_itself_holds_the_ends() -> None:
    hits = {call for _line, call in offences((ROOT / HOME).read_text(encoding="utf-8"))}
    assert {
        "self.journal.claim",
        "self.journal.interrupt",
        "self.journal.cancel",
        "self.journal.fail",
        "self.journal.succeed",
        "self.journal.recover",
        "self.metrics.finished",
    } <= hits
