"""The layering rules (docs/architecture.md) hold, checked as a user of the tree would: the pure
cores import nothing of the server, the worker, the broker, the web stack, the database or torch,
and import-linter's contracts in pyproject.toml are kept."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FORBIDDEN_IN_CORES = (
    "app",
    "tasks",
    "celery",
    "redis",
    "kombu",
    "fastapi",
    "starlette",
    "sqlmodel",
    "sqlalchemy",
    "torch",
    "diffusers",
    "transformers",
    "httpx",
)


def test_importing_routing_and_residency_pulls_in_none_of_the_edges() -> None:
    script = (
        "import sys, routing, residency\n"
        "import routing.placement, routing.finish, routing.estimate, routing.demand, routing.scarcity\n"
        "import residency.policy, residency.cache, residency.device, residency.errors\n"
        f"print(sorted({{m.split('.')[0] for m in sys.modules}} & set({FORBIDDEN_IN_CORES!r})))"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=ROOT, check=True
    )
    assert done.stdout.strip() == "[]", done.stdout


def test_import_linter_contracts_are_kept() -> None:
    lint = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    assert lint is not None, "import-linter is part of the test extras (pyproject.toml)"
    done = subprocess.run([lint, "--no-cache"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 broken" in done.stdout and "no import cycles anywhere KEPT" in done.stdout


def test_the_repository_stands_on_its_own() -> None:
    """Nothing in the repository points to the specification's folder outside it: its design is
    written here, under docs/."""
    tracked = subprocess.run(
        ["git", "ls-files"], capture_output=True, text=True, timeout=30, cwd=ROOT, check=True
    ).stdout.split()
    pointers = ("../" + "shared", "shared/" + "notes", "shared/" + "cases", "DESIGN" + ".md", "DESIGN" + " §")
    offending = [
        path
        for path in tracked
        if (ROOT / path).is_file()
        and not path.endswith((".png", ".safetensors"))
        and any(p in (ROOT / path).read_text(errors="replace") for p in pointers)
    ]
    assert offending == [], offending
