"""A worker's token never needs the command line, where ``ps`` shows it to every user
of the host: it comes from HOMEFLEET_WORKER_TOKEN or a file (``--token-file``,
HOMEFLEET_WORKER_TOKEN_FILE); ``--token`` still works but warns. (The workers of the drills and
of tests/e2e/test_broker.py run with token files, checked there with their real processes.)"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from app.core.secret_files import write_private


def worker(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("HOMEFLEET_")}
    base.update({"HOMEFLEET_MACHINE": "m1", "HOMEFLEET_MODELS_DIR": str(tmp_path / "models"), **(env or {})})
    return subprocess.run(
        [sys.executable, "-m", "app.cli", "worker", *args], env=base, capture_output=True, text=True, timeout=120
    )


def test_token_on_the_command_line_is_deprecated_with_a_warning(tmp_path: Path) -> None:
    done = worker(tmp_path, "--token", "short")  # too short: it stops at the settings, after the warning
    assert done.returncode == 2, done.stdout + done.stderr
    assert "warning: --token is deprecated" in done.stderr and "--token-file" in done.stderr, done.stderr
    assert "error (invalid_settings): HOMEFLEET_WORKER_TOKEN: String should have at least 16 characters" in done.stderr


def test_an_unreadable_token_file_is_named_in_one_line(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-token"
    done = worker(tmp_path, "--token-file", str(missing))
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stdout + done.stderr
    assert (
        f"error (invalid_settings): HOMEFLEET_WORKER_TOKEN_FILE '{missing}' cannot be read: No such file or directory"
    ) in " ".join(done.stderr.split()), done.stderr
    assert "warning: --token" not in done.stderr


def test_a_token_in_both_the_environment_and_a_file_is_refused(tmp_path: Path) -> None:
    token = tmp_path / "token"
    write_private(token, "x" * 32 + "\n")
    done = worker(tmp_path, env={"HOMEFLEET_WORKER_TOKEN": "y" * 32, "HOMEFLEET_WORKER_TOKEN_FILE": str(token)})
    assert done.returncode == 2, done.stdout + done.stderr
    assert "set one of HOMEFLEET_WORKER_TOKEN and HOMEFLEET_WORKER_TOKEN_FILE" in done.stderr, done.stderr


def test_a_short_token_in_a_file_is_named_by_the_file(tmp_path: Path) -> None:
    """A token file that holds too little names the file, not HOMEFLEET_WORKER_TOKEN, which the
    user never set."""
    token = tmp_path / "token"
    write_private(token, "short\n")
    done = worker(tmp_path, "--token-file", str(token))
    assert done.returncode == 2, done.stdout + done.stderr
    line = " ".join(done.stderr.split())
    assert f"HOMEFLEET_WORKER_TOKEN_FILE '{token}' holds 5 characters, a machine token at least 16" in line, line
    assert "HOMEFLEET_WORKER_TOKEN:" not in line, line
