"""A worker refuses to start on a models folder that does not exist (a mistyped ``--models-dir``
or HOMEFLEET_MODELS_DIR): one line naming the folder and the setting, exit 2, nothing created.
Created empty, it advertised no model and still took the machine's queued jobs, failing each
with ``integrity``. An existing empty folder is fine: the worker goes on (here, to a server that
does not answer)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from app.devtools.redis_server import free_port

TOKEN = "t" * 32


def worker(*args: str, models_dir: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOMEFLEET_")}
    if models_dir is not None:
        env["HOMEFLEET_MODELS_DIR"] = str(models_dir)
    env.update(
        {
            "HOMEFLEET_MACHINE": "m1",
            "HOMEFLEET_WORKER_TOKEN": TOKEN,
            "HOMEFLEET_REDIS_URL": f"redis://127.0.0.1:{free_port()}/0",
            "HOMEFLEET_SERVER_URL": f"http://127.0.0.1:{free_port()}",
            "HOMEFLEET_SERVER_RETRY_S": "0",
        }
    )
    return subprocess.run(
        [sys.executable, "-m", "app.cli", "worker", *args], env=env, capture_output=True, text=True, timeout=180
    )


@pytest.mark.parametrize("how", ["option", "variable"])
def test_a_models_folder_that_does_not_exist_is_one_line_and_exit_2(tmp_path: Path, how: str) -> None:
    missing = tmp_path / "nonexistent" / "models"
    done = worker("--models-dir", str(missing)) if how == "option" else worker(models_dir=missing)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stdout + done.stderr
    line = " ".join(done.stderr.split())
    assert (
        f"error (models_dir_missing): the models folder {missing} does not exist: create it, or name this "
        "machine's model folder with --models-dir or HOMEFLEET_MODELS_DIR"
    ) in line, done.stderr
    assert len(done.stderr.strip().splitlines()) <= 3, done.stderr  # one line (a wide one wraps)
    assert not (tmp_path / "nonexistent").exists()  # nothing created: no folder, no verify lock


def test_a_file_named_as_the_models_folder_is_refused(tmp_path: Path) -> None:
    a_file = tmp_path / "models"
    a_file.write_text("")
    done = worker("--models-dir", str(a_file))
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"the models folder {a_file} is not a folder" in " ".join(done.stderr.split()), done.stderr


def test_an_existing_empty_models_folder_is_taken(tmp_path: Path) -> None:
    empty = tmp_path / "models"
    empty.mkdir()
    done = worker("--models-dir", str(empty))
    output = done.stdout + done.stderr
    assert "models_dir_missing" not in output, output
    assert "the server could not be asked at start" in output, output  # past the folder's check
    assert list(empty.iterdir()) == []
