"""The repository stands on its own: what a reader follows is in it, and nothing built is tracked.

- No tracked text file of the code, the docs or the tests cites a tracker number (the word
  "issue" followed by a number): a reader of the repository has no tracker. Text cites the rule it
  implements (R1-R24, docs/design.md) or the docs section that explains it instead. The CLI's help
  (``homefleet --help`` and every subcommand's) is rendered and checked the same way.
- No build artefact is tracked (wheels, ``*.egg-info/``, ``__pycache__/``, ``*.pyc``, ``dist/``,
  ``build/``), and ``.gitignore`` ignores each of them, so ``git add -A`` after a build adds none.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from app.cli.main import cli

ROOT = Path(__file__).resolve().parents[2]
THIS = PurePosixPath(Path(__file__).resolve().relative_to(ROOT).as_posix())
#: what is scanned: the code, the docs, the tests and the build and CI files
SCANNED = [
    "app",
    "tasks",
    "routing",
    "residency",
    "bench",
    "docs",
    "tests",
    "README.md",
    "Makefile",
    ".ci",
    "pyproject.toml",
    "compose.yaml",
    "Dockerfile",
]
TRACKER_REFERENCE = re.compile(
    r"\bissues?(?:[ \t]*\n[ \t]*(?:#[ \t]*|\*[ \t]*|//[ \t]*)?|[ \t]+)\d+\b", re.IGNORECASE
)  # also wrapped onto the next line of a docstring or comment

pytestmark = pytest.mark.skipif(
    shutil.which("git") is None or not (ROOT / ".git").exists(), reason="needs git and the repository's checkout"
)


def tracked(*paths: str) -> list[PurePosixPath]:
    """The files git tracks under ``paths`` (relative to the repository root)."""
    done = subprocess.run(["git", "ls-files", "-z", "--", *paths], cwd=ROOT, capture_output=True, check=True)
    return [PurePosixPath(name) for name in done.stdout.decode().split("\0") if name]


def text_of(path: PurePosixPath) -> str | None:
    """The file's text, None for a binary file (a NUL byte or not UTF-8) or one absent from the checkout."""
    try:
        data = (ROOT / path).read_bytes()
    except FileNotFoundError:
        return None
    if b"\0" in data:
        return None
    try:
        return data.decode()
    except UnicodeDecodeError:
        return None


def tracker_references(text: str) -> list[tuple[int, str]]:
    """(line number from 1, the matched words) of each tracker reference in ``text``."""
    return [
        (text.count("\n", 0, match.start()) + 1, " ".join(match.group(0).replace("#", " ").split()))
        for match in TRACKER_REFERENCE.finditer(text)
    ]


def test_the_pattern_finds_what_it_must_and_nothing_else() -> None:
    """The check can fail: each spelling of a tracker reference is found, with its line."""
    sample = (
        "a (issue 22)\nfine: R22, issues, test_issue22_x, tissue 3\nIssue 5 point 2; Issues 19 and 21\n"
        "a docstring's digests; issue\n    22), and\n# a comment's issue\n# 7\n"
    )
    assert tracker_references(sample) == [
        (1, "issue 22"),
        (3, "Issue 5"),
        (3, "Issues 19"),
        (4, "issue 22"),
        (6, "issue 7"),
    ]


def test_no_tracked_text_file_cites_a_tracker_number() -> None:
    files = [path for path in tracked(*SCANNED) if path != THIS]
    assert len(files) > 100 and PurePosixPath("docs/design.md") in files  # the scan reads the repository
    found = [
        f"{path}:{number}: {words!r}"
        for path in files
        if (text := text_of(path)) is not None
        for number, words in tracker_references(text)
    ]
    assert not found, "cite the rule (R1-R24) or the docs section instead of a tracker number:\n" + "\n".join(found)


def command_paths(command: Any, path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Every command and subcommand of ``command``, as the argument lists that name them."""
    paths = [path]
    for name, sub in sorted(getattr(command, "commands", {}).items()):  # a group's subcommands
        paths += command_paths(sub, (*path, name))
    return paths


def test_no_help_text_of_the_cli_cites_a_tracker_number() -> None:
    """``homefleet --help`` and each subcommand's, as a user sees them."""
    paths = command_paths(typer.main.get_command(cli))
    assert ("models", "add") in paths and ("results", "recover") in paths
    runner = CliRunner()
    found = []
    for path in paths:
        command = " ".join(("homefleet", *path))
        result = runner.invoke(cli, [*path, "--help"], env={"COLUMNS": "200", "NO_COLOR": "1"})
        assert result.exit_code == 0, f"{command} --help: {result.output}"
        assert "Usage" in result.output
        found += [f"{command} --help: {words!r}" for _, words in tracker_references(result.output)]
    assert not found, "\n".join(found)


def test_every_help_text_reads_as_written_no_markup_lost_or_shown() -> None:
    """Help comes from docstrings written with ``code`` spans and [brackets]: rendered as
    Markdown, a code span shows as its text, and brackets and angle brackets stay (Rich's own
    markup took ``[row, ...]`` for a style tag and dropped it; Markdown drops ``<host>`` as HTML)."""
    runner = CliRunner()
    shown = {}
    for path in command_paths(typer.main.get_command(cli)):
        result = runner.invoke(cli, [*path, "--help"], env={"COLUMNS": "200", "NO_COLOR": "1"})
        assert result.exit_code == 0, result.output
        shown[" ".join(path)] = " ".join(result.output.split())
    assert not [name for name, text in shown.items() if "``" in text], "raw double backticks in help"
    assert '--json: {"hosts": [{"host", "machines": [row, ...]}, ...], "dead_letters": n}' in shown["status"]
    assert "a device of a multi-device host is HOST:INDEX, e.g. box:1" in shown["worker"]


#: build artefacts: (a path one would produce, how a tracked one is recognised)
ARTEFACTS = [
    ("homefleet-0.1.0-py3-none-any.whl", re.compile(r"\.whl$")),
    ("homefleet.egg-info/PKG-INFO", re.compile(r"(^|/)[^/]+\.egg-info/")),
    ("app/__pycache__/cli.cpython-311.pyc", re.compile(r"(^|/)__pycache__/")),
    ("tasks/worker.pyc", re.compile(r"\.pyc$")),
    ("dist/homefleet-0.1.0.tar.gz", re.compile(r"^dist/")),
    ("build/lib/app/__init__.py", re.compile(r"^build/")),
]


@pytest.mark.parametrize(("example", "pattern"), ARTEFACTS, ids=[example for example, _ in ARTEFACTS])
def test_no_build_artefact_is_tracked_and_gitignore_ignores_it(example: str, pattern: re.Pattern[str]) -> None:
    assert pattern.search(example)
    tracked_artefacts = [str(path) for path in tracked() if pattern.search(str(path))]
    assert not tracked_artefacts, f"build artefacts are tracked: {tracked_artefacts}"
    # --no-index: the rules alone decide, as for a file a build has just written
    ignored = subprocess.run(["git", "check-ignore", "--no-index", "-q", example], cwd=ROOT, check=False)
    assert ignored.returncode == 0, f".gitignore does not ignore {example}"
