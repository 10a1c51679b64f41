"""What a user sees of torch's import noise at the command line (app/core/quiet.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def test_a_command_that_needs_no_torch_does_not_import_it() -> None:
    script = ("import sys\nsys.argv = ['homefleet', 'status', '--help']\nfrom app.cli import main as cli\n"
              "try:\n    cli.main()\nexcept SystemExit:\n    pass\n"
              "print(sorted(m for m in ('torch', 'diffusers', 'transformers', 'torchao') if m in sys.modules))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout.splitlines()[-1] == "[]" and done.stderr == ""


def test_make_tiny_prints_no_import_time_warnings(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "app.cli", "models", "make-tiny", str(tmp_path)],
                          capture_output=True, text=True, timeout=300, check=True)
    assert done.stdout.strip() == f"txt2img: {tmp_path / 'tiny-sd'}"
    assert done.stderr == ""
