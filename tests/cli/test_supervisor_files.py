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
        "SSL_CERT_FILE": None,  # the CA variables a supervisor file carries when set (tests/cli/test_join_tls.py)
        "SSL_CERT_DIR": None,
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
    assert "need --token-file" in refused.stderr and TOKEN not in refused.stdout + refused.stderr


def test_a_joined_worker_starts_again_from_its_worker_env(tmp_path: Path) -> None:
    """After a reboot: `homefleet worker --env-file worker.env` takes the settings `worker join`
    wrote (here printing the supervisor file instead of starting); an option still wins."""
    from app.core.protocol import JoinGrant
    from tasks import join as joining

    grant = JoinGrant(
        machine="box7",
        token=TOKEN,
        backend="cpu",
        memory_bytes=8 * 2**30,
        families=["sd1"],
        broker={"redis_url": "redis://127.0.0.1:6390/4"},
    )
    models_dir = tmp_path / "worker" / "models"
    token_file, _ = joining.save_grant(grant, "http://srv:8787", models_dir)
    env_file = token_file.parent / joining.ENV_FILE
    settings = ("MACHINE", "MODELS_DIR", "WORKER_TOKEN", "WORKER_TOKEN_FILE", "SERVER_URL", "REDIS_URL")
    env: dict[str, str | None] = dict.fromkeys(f"HOMEFLEET_{name}" for name in settings)  # the file alone
    done = run_cli("worker", "--env-file", str(env_file), "--print-systemd-unit", env=env)
    assert TOKEN not in done.stdout + done.stderr
    service = configparser_service(done.stdout)
    expected = [
        "--machine",
        "box7",
        "--models-dir",
        str(models_dir.resolve()),
        "--token-file",
        str(token_file.resolve()),
    ]
    assert shlex.split(service["ExecStart"])[4:] == expected
    assert "HOMEFLEET_SERVER_URL=http://srv:8787" in shlex.split(service["Environment"])
    assert "HOMEFLEET_REDIS_URL=redis://127.0.0.1:6390/4" in shlex.split(service["Environment"])

    other = run_cli("worker", "--env-file", str(env_file), "--machine", "box8", "--print-systemd-unit", env=env)
    assert shlex.split(configparser_service(other.stdout)["ExecStart"])[5] == "box8"

    missing = run_cli("worker", "--env-file", str(tmp_path / "nowhere.env"), env=env, check=False)
    assert missing.returncode != 0 and "nowhere.env is not a file" in " ".join(
        (missing.stdout + missing.stderr).split()
    )


def configparser_service(text: str) -> configparser.SectionProxy:
    parser = configparser.ConfigParser(interpolation=None)
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    parser.read_string(text)
    return parser["Service"]
