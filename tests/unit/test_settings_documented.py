"""An operator finds every setting in one table: docs/operations.md, "Settings" lists each
``HOMEFLEET_*`` variable of ``app/core/config.py`` (the broker's, the server's and a worker's
settings) and no variable that names no setting. Every citation of a docs section in the code,
the tests and the docs (the document's path, then its heading in double quotes) names a heading
(or a bold run-in heading) of that document.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from app.core.config import BrokerSettings, Settings, WorkerSettings

ROOT = Path(__file__).resolve().parents[2]
OPERATIONS = ROOT / "docs" / "operations.md"
#: a citation: docs/<file>.md, then (after a comma or not) the section's name in double quotes
CITATION = re.compile(r'docs/([\w-]+\.md),?\s+(?:sections?\s+)?"([^"\n]+)"')


def settings_table(text: str) -> str:
    """The "## Settings" section of operations.md, up to the next section of its level."""
    match = re.search(r"^## Settings\n(.*?)(?=^## )", text, re.MULTILINE | re.DOTALL)
    assert match, "docs/operations.md has no '## Settings' section"
    return match.group(1)


def documented_variables(section: str) -> set[str]:
    """The variables named in the first column of the section's table rows."""
    found: set[str] = set()
    for line in section.splitlines():
        if line.startswith("| `HOMEFLEET_"):
            first_cell = line.split("|")[1]
            found.update(re.findall(r"`(HOMEFLEET_[A-Z0-9_]+)`", first_cell))
    return found


def setting_variables() -> set[str]:
    """``HOMEFLEET_<FIELD>`` of every field of the three settings classes."""
    fields = {*BrokerSettings.model_fields, *Settings.model_fields, *WorkerSettings.model_fields}
    prefix = BrokerSettings.model_config["env_prefix"]
    assert prefix == "HOMEFLEET_"
    return {prefix + name.upper() for name in fields}


def test_every_setting_is_in_the_one_settings_table_and_nothing_else_is() -> None:
    documented = documented_variables(settings_table(OPERATIONS.read_text()))
    expected = setting_variables()
    assert "HOMEFLEET_REDIS_URL" in expected and "HOMEFLEET_MACHINE" in expected  # all three classes
    assert sorted(expected - documented) == [], "settings missing from docs/operations.md, 'Settings'"
    assert sorted(documented - expected) == [], "rows of docs/operations.md, 'Settings' that name no setting"


def test_the_table_reader_finds_rows_and_only_first_cells() -> None:
    section = (
        "| variable | for |\n|---|---|\n| `HOMEFLEET_A`, `HOMEFLEET_B` | server | see `HOMEFLEET_C` |\n"
        "prose naming `HOMEFLEET_D`\n"
    )
    assert documented_variables(section) == {"HOMEFLEET_A", "HOMEFLEET_B"}


def headings(document: Path) -> list[str]:
    """Each Markdown heading's text and each bold run-in heading (``**Name.**``) of ``document``."""
    text = document.read_text()
    found = [line.lstrip("#").strip() for line in text.splitlines() if re.match(r"#{1,6} ", line)]
    found += re.findall(r"\*\*([^*\n]+?)\.\*\*", text)
    return found


def citations() -> list[tuple[str, str, str]]:
    """(file, document, heading) of every citation in the tracked text files; a citation may
    wrap onto the next line of a comment or docstring."""
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True)
    found = []
    for name in listed.stdout.decode().split("\0"):
        if not name.endswith((".py", ".md", ".toml", ".yaml", ".html", ".js")) and name not in ("Makefile", ".ci/run"):
            continue
        try:
            text = (ROOT / name).read_text()
        except (FileNotFoundError, UnicodeDecodeError):
            continue
        flat = re.sub(r"\n\s*(?:#+|//|\*)?\s*", " ", text)  # join wrapped comment lines
        found += [(name, match.group(1), match.group(2).strip()) for match in CITATION.finditer(flat)]
    return found


def test_every_docs_citation_names_an_existing_heading() -> None:
    found = citations()
    assert len(found) >= 50  # the reader finds the repository's citations
    broken = []
    for name, document, heading in found:
        path = ROOT / "docs" / document
        if not path.exists() or not any(h == heading or h.startswith(heading) for h in headings(path)):
            broken.append(f"{name}: docs/{document}, {heading!r}")
    assert broken == []


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('see docs/operations.md, "Settings".', [("operations.md", "Settings")]),
        ('(docs/benchmarks.md,\n    # "The test suite")', [("benchmarks.md", "The test suite")]),
        ('docs/api.md "Webhooks"', [("api.md", "Webhooks")]),
        ("docs/api.md without a heading", []),
    ],
)
def test_the_citation_pattern(text: str, expected: list[tuple[str, str]]) -> None:
    flat = re.sub(r"\n\s*(?:#+|//|\*)?\s*", " ", text)
    assert [(m.group(1), m.group(2)) for m in CITATION.finditer(flat)] == expected
