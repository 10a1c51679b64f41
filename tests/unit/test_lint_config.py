"""CI lints before it tests: ``.ci/run`` runs ``make lint`` (ruff's lint and format check, then mypy, configured in
pyproject.toml) before ``make test``, and mypy is strict where the rules live (routing/,
residency/, app/core/: docs/architecture.md, "Import rules"). The lint itself runs in CI, not here.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ["app", "tasks", "routing", "residency"]
STRICT_FLAGS = [
    "disallow_untyped_defs",
    "disallow_incomplete_defs",
    "disallow_untyped_calls",
    "disallow_any_generics",
    "warn_return_any",
    "no_implicit_reexport",
]


def make_target(name: str) -> list[str]:
    """The recipe lines of Makefile target ``name`` (tabs stripped); [] when it has none."""
    lines = (ROOT / "Makefile").read_text().splitlines()
    start = next((i for i, line in enumerate(lines) if re.match(rf"^{name}:", line)), None)
    if start is None:
        return []
    recipe = []
    for line in lines[start + 1 :]:
        if not line.startswith("\t"):
            break
        recipe.append(line.strip())
    return recipe


def test_ci_lints_with_ruff_and_mypy_before_the_tests() -> None:
    assert make_target("lint") == ["$(VENV)/bin/ruff check .", "$(VENV)/bin/ruff format --check .", "$(VENV)/bin/mypy"]
    # bytecode cached for the run, whatever the machine sets (the Makefile says why)
    assert make_target("test") == [
        "PYTHONDONTWRITEBYTECODE= $(VENV)/bin/python -m pytest -n $(TEST_WORKERS) --dist loadgroup"
    ]
    commands = [
        line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines() if line.strip().startswith("make ")
    ]
    assert commands == ["make lint", "make test"]
    assert re.search(r"^lint: \$\(STAMP\)$", (ROOT / "Makefile").read_text(), re.MULTILINE)  # creates the venv


def test_mypy_checks_every_package_and_is_strict_where_the_rules_live() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]
    assert config["ruff"]["line-length"] == 120
    assert "format" in config["ruff"]  # ready for `ruff format`
    mypy = config["mypy"]
    assert sorted(mypy["files"]) == sorted(PACKAGES)
    assert mypy["check_untyped_defs"] is True and mypy["warn_unused_ignores"] is True
    assert "ignore-without-code" in mypy["enable_error_code"]
    strict = [o for o in mypy["overrides"] if "routing.*" in o["module"]]
    assert len(strict) == 1 and sorted(strict[0]["module"]) == ["app.core.*", "residency.*", "routing.*"]
    assert all(strict[0].get(flag) is True for flag in STRICT_FLAGS), strict[0]
    # ignore_missing_imports only for named libraries, never for a package of this project
    for override in mypy["overrides"]:
        if override.get("ignore_missing_imports"):
            assert not any(m.split(".")[0] in PACKAGES for m in override["module"]), override
