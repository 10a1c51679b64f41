"""`homefleet worker --print-systemd-unit` / `--print-launchd-plist` print the supervisor file of
this worker's settings (docs/operations.md, "A supervisor for every worker"): this interpreter,
absolute paths, the token's file and never the token; nothing is started."""

from __future__ import annotations

import configparser
import plistlib
import shlex
import sys
from pathlib import Path

from app.core.secret_files import write_private
from tests.helpers import run_cli

TOKEN = "secret-token-0123456789"


def test_print_systemd_unit_names_the_token_file_and_this_interpreter(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    write_private(token_file, TOKEN + "\n")
    env: dict[str, str | None] = {
        "HOMEFLEET_REDIS_URL": "redis://127.0.0.1:6390/3",
        "HOMEFLEET_WORKER_TOKEN": None,
        "HOMEFLEET_WORKER_TOKEN_FILE": None,
    }
    done = run_cli(
        "worker",
        "--machine",
        "box:0",
        "--models-dir",
        str(tmp_path / "models"),
        "--token-file",
        str(token_file),
        "--server-url",
        "http://srv:8787",
        "--print-systemd-unit",
        env=env,
    )
    assert TOKEN not in done.stdout + done.stderr
    parser = configparser.ConfigParser(interpolation=None)
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    parser.read_string(done.stdout)
    service = parser["Service"]
    assert shlex.split(service["ExecStart"]) == [
        sys.executable,
        "-m",
        "app.cli",
        "worker",
        "--machine",
        "box:0",
        "--models-dir",
        str((tmp_path / "models").resolve()),
        "--token-file",
        str(token_file.resolve()),
    ]
    assert shlex.split(service["Environment"]) == [
        "HOMEFLEET_SERVER_URL=http://srv:8787",
        "HOMEFLEET_REDIS_URL=redis://127.0.0.1:6390/3",
    ]
    assert service["Restart"] == "on-failure" and service["KillMode"] == "mixed"
    assert not (tmp_path / "models").exists()  # nothing started, nothing created


def test_print_launchd_plist_and_a_token_outside_a_file_is_refused(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    write_private(token_file, TOKEN)
    env: dict[str, str | None] = {"HOMEFLEET_WORKER_TOKEN": None, "HOMEFLEET_WORKER_TOKEN_FILE": None}
    done = run_cli(
        "worker",
        "--machine",
        "mac1",
        "--models-dir",
        str(tmp_path),
        "--token-file",
        str(token_file),
        "--print-launchd-plist",
        env=env,
    )
    plist = plistlib.loads(done.stdout.encode())
    assert plist["ProgramArguments"][0] == sys.executable
    assert plist["KeepAlive"] == {"SuccessfulExit": False} and plist["RunAtLoad"] is True
    assert TOKEN not in done.stdout
    refused = run_cli(
        "worker",
        "--machine",
        "mac1",
        "--models-dir",
        str(tmp_path),
        "--print-launchd-plist",
        env={**env, "HOMEFLEET_WORKER_TOKEN": TOKEN},
        check=False,
    )
    assert refused.returncode == 2
    assert "need --token-file" in refused.stdout and TOKEN not in refused.stdout + refused.stderr
