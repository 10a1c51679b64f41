"""What a user sees of torch's import noise at the command line (app/core/quiet.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def test_a_command_that_needs_no_torch_does_not_import_it() -> None:
    script = (
        "import sys\nsys.argv = ['homefleet', 'status', '--help']\nfrom app.cli import main as cli\n"
        "try:\n    cli.main()\nexcept SystemExit:\n    pass\n"
        "print(sorted(m for m in ('torch', 'diffusers', 'transformers', 'torchao') if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout.splitlines()[-1] == "[]" and done.stderr == ""


def test_make_tiny_builds_sd1_by_default_and_refuses_an_unknown_family(tmp_path: Path) -> None:
    """In this process (typer's runner: no second torch import); the fresh interpreter's silence
    is checked by the test below."""
    from typer.testing import CliRunner

    from app.cli.main import cli

    runner = CliRunner()
    done = runner.invoke(cli, ["models", "make-tiny", str(tmp_path)])
    assert done.exit_code == 0, done.output
    assert done.stdout.strip() == f"sd1: {tmp_path / 'tiny-sd'}"  # the family it built
    refused = runner.invoke(cli, ["models", "make-tiny", str(tmp_path), "--family", "sdx1"])
    assert refused.exit_code == 2 and "unknown tiny model family(ies) ['sdx1']" in refused.output


def test_make_tiny_builds_every_family_and_prints_no_import_time_warnings(tmp_path: Path) -> None:
    """``make-tiny --family F`` for each family the registry accepts, offline, in a
    fresh interpreter that prints nothing on stderr (no import-time warnings)."""
    from app.core.families import FAMILIES

    args = [sys.executable, "-m", "app.cli", "models", "make-tiny", str(tmp_path)]
    done = subprocess.run([*args, "--family", "all"], capture_output=True, text=True, timeout=300, check=True)
    built = dict(line.split(": ", 1) for line in done.stdout.strip().splitlines())
    diffusers = {name for name, family in FAMILIES.items() if family.kind != "text"}  # text: --kind text
    assert set(built) == diffusers and done.stderr == ""
    for family, folder in built.items():
        index = json.loads((Path(folder) / "model_index.json").read_text())
        assert index["_class_name"] == FAMILIES[family].pipeline_class
    text = subprocess.run([*args, "--kind", "text"], capture_output=True, text=True, timeout=300, check=True)
    assert text.stderr == "", text.stderr  # transformers' "Writing model shards" bars included
    assert {line.split(": ", 1)[0] for line in text.stdout.strip().splitlines()} == {"llama", "qwen2", "gpt2"}


def test_models_add_prints_no_import_time_warnings(tmp_path: Path, tiny_models_dir: Path) -> None:
    """Registering a pipeline prices it with diffusers and transformers (its feature extractor's
    class, torchao's quantizer): a fresh interpreter, as a user runs it, prints nothing on
    stderr and registers it (app/core/quiet.py)."""
    import os

    env = {**os.environ, "HOMEFLEET_DATA_DIR": str(tmp_path / "data")}
    env.pop("HOMEFLEET_DATABASE_URL", None)
    base = [sys.executable, "-m", "app.cli"]
    subprocess.run([*base, "db", "upgrade"], env=env, capture_output=True, text=True, timeout=120, check=True)
    done = subprocess.run(
        [*base, "models", "add", str(tiny_models_dir / "tiny-sd"), "--id", "quiet"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0 and "registered quiet family=sd1" in done.stdout, done.stdout + done.stderr
    assert done.stderr == ""
