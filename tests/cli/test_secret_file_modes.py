"""Secret files readable by others are refused at start, as ssh refuses a private key others can
read (docs/operations.md, "API keys and machine tokens"): ``homefleet serve`` with a fleet file
(every machine's token) and ``homefleet worker`` with a token file whose mode has any
group/other bit (``mode & 0o077``) exit 2 with one line naming the file, its mode and
``chmod 600``; the same files at 0600 pass the check and the command starts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx

from app.core.secret_files import write_private
from app.core.tls import tls_context
from app.devtools.procs import stop_process_group
from app.devtools.redis_server import free_port
from tests.helpers import make_fleet, wait_for

TOKEN = "worker-token-0123456789abcdef"


def clean_env(**variables: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOMEFLEET_")}
    env.update(variables)
    return env


def test_write_private_makes_0600_even_over_an_existing_0644_file(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "secret"
    path.parent.mkdir()
    path.write_text("old")
    path.chmod(0o644)
    assert write_private(path, "new\n") == path
    assert path.stat().st_mode & 0o777 == 0o600
    assert path.read_text() == "new\n"


def test_serve_refuses_a_fleet_file_others_can_read_and_starts_with_0600(tmp_path: Path, redis_url: str) -> None:
    fleet_file = write_private(tmp_path / "fleet.toml", make_fleet("m1").to_toml())
    fleet_file.chmod(0o644)
    port = free_port()
    env = clean_env(
        HOMEFLEET_DATA_DIR=str(tmp_path / "data"),
        HOMEFLEET_FLEET_FILE=str(fleet_file),
        HOMEFLEET_REDIS_URL=redis_url,
        HOMEFLEET_API_KEYS='["k1-0123456789"]',
        HOMEFLEET_API_PORT=str(port),
    )
    refused = subprocess.run(
        [sys.executable, "-m", "app.cli", "serve"], check=False, env=env, capture_output=True, text=True, timeout=120
    )
    line = " ".join(refused.stderr.split())
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert "Traceback" not in refused.stdout + refused.stderr
    assert f"error (invalid_config): the fleet file {fleet_file} holds secrets but has mode 0644" in line, line
    assert f"chmod 600 {fleet_file}" in line, line
    assert not (tmp_path / "data").exists()  # refused before the journal is created

    fleet_file.chmod(0o600)
    process = subprocess.Popen(
        [sys.executable, "-m", "app.cli", "serve"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:

        def healthy() -> bool:
            assert process.poll() is None, process.stdout.read() if process.stdout else ""
            try:
                return (
                    httpx.get(f"http://127.0.0.1:{port}/openapi.json", timeout=5, verify=tls_context()).status_code
                    == 200
                )
            except httpx.TransportError:
                return False

        wait_for(healthy, timeout_s=120, what="serve to answer with its fleet file at 0600", poll_s=0.2)
    finally:
        stop_process_group(process)


def test_worker_refuses_a_token_file_others_can_read_and_gets_past_it_with_0600(tmp_path: Path) -> None:
    token_file = write_private(tmp_path / "token", TOKEN + "\n")
    token_file.chmod(0o640)
    (tmp_path / "models").mkdir()
    env = clean_env(
        HOMEFLEET_MACHINE="m1",
        HOMEFLEET_MODELS_DIR=str(tmp_path / "models"),
        HOMEFLEET_REDIS_URL=f"redis://127.0.0.1:{free_port()}/0",
        HOMEFLEET_SERVER_URL=f"http://127.0.0.1:{free_port()}",
        HOMEFLEET_SERVER_RETRY_S="0",
    )
    command = [sys.executable, "-m", "app.cli", "worker", "--token-file", str(token_file)]
    refused = subprocess.run(command, check=False, env=env, capture_output=True, text=True, timeout=120)
    line = " ".join(refused.stderr.split())
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert f"error (invalid_config): the token file {token_file} holds secrets but has mode 0640" in line, line
    assert f"chmod 600 {token_file}" in line, line
    assert TOKEN not in refused.stdout + refused.stderr

    token_file.chmod(0o600)  # past the check: it goes on to ask the (absent) server whether the token is m1's
    started = subprocess.run(command, check=False, env=env, capture_output=True, text=True, timeout=180)
    output = started.stdout + started.stderr
    assert "holds secrets" not in output, output
    assert "the server could not be asked at start" in output and "error (redis_down)" in output, output
