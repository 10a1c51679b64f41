"""``homefleet doctor`` on a worker host: one screen saying what torch and the device are,
whether the server and the broker answer, the token file's mode, and what is missing."""

from __future__ import annotations

from pathlib import Path

from app.core.secret_files import write_private
from app.devtools.redis_server import free_port
from tests.helpers import run_cli


def test_doctor_names_the_device_the_unreachable_server_and_a_token_file_others_can_read(
    tmp_path: Path, redis_base_url: str
) -> None:
    token_file = tmp_path / "worker-token"
    token_file.write_text("a-machine-token-0123456789\n")
    token_file.chmod(0o644)
    env_file = tmp_path / "worker.env"  # as `homefleet worker join` writes it; the environment wins over it
    env_file.write_text(
        f"# written by join\nHOMEFLEET_REDIS_URL={redis_base_url}/0\n"
        f"HOMEFLEET_WORKER_TOKEN_FILE={token_file}\nHOMEFLEET_MODELS_DIR={tmp_path / 'models'}\n"
    )
    server = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    done = run_cli(
        "doctor",
        "--env-file",
        str(env_file),
        check=False,
        env={
            "HOMEFLEET_SERVER_URL": server,
            "HOMEFLEET_REDIS_URL": None,
            "HOMEFLEET_WORKER_TOKEN": None,
            "HOMEFLEET_WORKER_TOKEN_FILE": None,
            "HOMEFLEET_MODELS_DIR": None,
        },
    )
    out = done.stdout
    assert done.returncode == 1, out + done.stderr
    lines = {line.split()[0]: line for line in out.splitlines() if line.strip()}
    assert "+cpu" in lines["torch"] or lines["torch"].split()[1][0].isdigit()  # torch's version
    assert "device" in lines and " cpu " in lines["device"] and "GB" in lines["device"]
    assert f"{server}: unreachable" in out
    assert f"{redis_base_url.removeprefix('redis://')}/0: answers" in out  # the broker of the env file
    assert f"{token_file} (mode 0644)" in out and f"chmod 600 {token_file}" in out
    assert f"the models folder {tmp_path / 'models'}" in out
    assert "a-machine-token" not in out  # the token itself is never shown
    token_file.chmod(0o600)
    (tmp_path / "models").mkdir()
    again = run_cli(
        "doctor",
        "--env-file",
        str(env_file),
        check=False,
        env={
            "HOMEFLEET_SERVER_URL": server,
            "HOMEFLEET_REDIS_URL": None,
            "HOMEFLEET_WORKER_TOKEN": None,
            "HOMEFLEET_WORKER_TOKEN_FILE": None,
            "HOMEFLEET_MODELS_DIR": None,
        },
    )
    assert again.returncode == 1 and "(mode 0600)" in again.stdout and "chmod" not in again.stdout
    assert again.stdout.count("missing:") == 1 and "the server at" in again.stdout


def test_doctor_checks_the_token_file_as_the_worker_reads_it(tmp_path: Path, redis_base_url: str) -> None:
    """`homefleet worker --token-file F` takes its token from F and refuses a token in the
    environment too, a folder, an unreadable file or a token under 8 characters;
    `doctor --token-file F` names each as missing, never showing the token."""
    token_file = tmp_path / "token"
    write_private(token_file, "a-machine-token-0123456789\n")
    token_file.chmod(0o640)
    env = {"HOMEFLEET_REDIS_URL": f"{redis_base_url}/0", "HOMEFLEET_WORKER_TOKEN": None}
    done = run_cli("doctor", "--token-file", str(token_file), check=False, env=env)
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"{token_file} (mode 0640)" in done.stdout and f"chmod 600 {token_file}" in done.stdout, done.stdout
    token_file.chmod(0o600)
    both = run_cli(
        "doctor", "--token-file", str(token_file), check=False, env={**env, "HOMEFLEET_WORKER_TOKEN": "y" * 32}
    )
    said = " ".join(both.stdout.split())
    assert "set one of HOMEFLEET_WORKER_TOKEN and HOMEFLEET_WORKER_TOKEN_FILE (--token-file), not both" in said, said
    folder = tmp_path / "a-folder"
    folder.mkdir()
    shown = " ".join(run_cli("doctor", "--token-file", str(folder), check=False, env=env).stdout.split())
    assert f"{folder}: not a file" in shown and "cannot be read: Is a directory" in shown and "chmod" not in shown
    for text, count in (("", 0), ("short\n", 5)):
        write_private(token_file, text)
        short = " ".join(run_cli("doctor", "--token-file", str(token_file), check=False, env=env).stdout.split())
        assert f"HOMEFLEET_WORKER_TOKEN_FILE '{token_file}' holds {count} characters, a machine token at least 16" in (
            short
        ), short
    absent = run_cli("doctor", "--token-file", str(tmp_path / "nowhere"), check=False, env=env)
    assert absent.returncode == 1 and f"the token file {tmp_path / 'nowhere'}" in absent.stdout, absent.stdout
    assert "a-machine-token" not in done.stdout + both.stdout + absent.stdout


def test_doctor_reads_the_env_file_as_the_worker_does_and_refuses_one_that_is_no_file(
    tmp_path: Path, redis_base_url: str
) -> None:
    """Quoted values and ``export`` lines mean what they mean to the worker's settings
    (python-dotenv); a missing env file is one error line, exit 2, as for `homefleet worker`."""
    token_file = tmp_path / "worker-token"
    write_private(token_file, "a-machine-token-0123456789\n")
    env_file = tmp_path / "worker.env"
    env_file.write_text(f"export HOMEFLEET_WORKER_TOKEN_FILE=\"{token_file}\"\nHOMEFLEET_MODELS_DIR='{tmp_path}'\n")
    env = {"HOMEFLEET_REDIS_URL": f"{redis_base_url}/0", "HOMEFLEET_WORKER_TOKEN": None, "HOMEFLEET_MODELS_DIR": None}
    env["HOMEFLEET_WORKER_TOKEN_FILE"] = None
    done = run_cli("doctor", "--env-file", str(env_file), check=False, env=env)
    assert f"{token_file} (mode 0600)" in done.stdout and f"models folder  {tmp_path}" in done.stdout, done.stdout
    assert '"' not in done.stdout and "absent" not in done.stdout, done.stdout
    for where in (tmp_path / "no.env", tmp_path):
        refused = run_cli("doctor", "--env-file", str(where), check=False, env=env)
        assert refused.returncode == 2 and refused.stdout == "", refused.stdout + refused.stderr
        assert f"error (invalid_settings): {where} is not a file" in " ".join(refused.stderr.split()), refused.stderr


def test_doctor_on_the_servers_host_asks_the_port_it_serves_on_and_names_a_file_that_is_no_folder(
    tmp_path: Path, redis_base_url: str
) -> None:
    """Without HOMEFLEET_SERVER_URL the server is looked for at HOMEFLEET_API_PORT, as the
    worker looks for it on the server's host (not always 8787); a models folder that is a file
    is "not a folder", not "absent"."""
    import subprocess
    import sys

    port = free_port()
    server = subprocess.Popen(  # a stand-in that answers /health with 404: it answers
        [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1", "--directory", str(tmp_path)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        import time

        import httpx

        from app.core.tls import tls_context

        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                httpx.get(f"http://127.0.0.1:{port}/", timeout=1, verify=tls_context())
                break
            except httpx.HTTPError:
                time.sleep(0.1)
        (tmp_path / "models").write_text("not a folder")
        done = run_cli(
            "doctor",
            check=False,
            env={
                "HOMEFLEET_SERVER_URL": None,
                "HOMEFLEET_API_PORT": str(port),
                "HOMEFLEET_REDIS_URL": f"{redis_base_url}/0",
                "HOMEFLEET_WORKER_TOKEN": "a-machine-token-0123456789",
                "HOMEFLEET_WORKER_TOKEN_FILE": None,
                "HOMEFLEET_MODELS_DIR": str(tmp_path / "models"),
            },
        )
    finally:
        server.terminate()
        server.wait(timeout=10)
    out = " ".join(done.stdout.split())
    assert f"http://127.0.0.1:{port}: answers (404)" in out, out
    assert f"{tmp_path / 'models'}: not a folder" in out and "(a file is there)" in out
    assert done.returncode == 1 and "the server at" not in out


def test_doctor_without_any_token_says_how_to_name_a_worker_s_token_file(tmp_path: Path) -> None:
    """On the server's own host (README: its worker runs with ``--token-file server.token``) a
    bare ``homefleet doctor`` finds no token; the line says to pass that file, not only to join."""
    done = run_cli(
        "doctor",
        check=False,
        env={
            "HOMEFLEET_SERVER_URL": None,
            "HOMEFLEET_WORKER_TOKEN": None,
            "HOMEFLEET_WORKER_TOKEN_FILE": None,
            "HOMEFLEET_MODELS_DIR": str(tmp_path),
        },
    )
    said = " ".join(done.stdout.split())  # rich wraps nothing here (soft_wrap), but be safe
    assert done.returncode == 1, said
    assert "a machine token: `homefleet worker join SERVER_URL JOIN_TOKEN` writes its file" in said
    assert "run `homefleet doctor --token-file FILE`" in said


def test_doctor_in_the_folder_a_join_ran_in_reads_its_worker_env(tmp_path: Path, redis_base_url: str) -> None:
    """``worker join`` writes ``homefleet-worker/worker.env`` where it ran; ``doctor`` there needs
    no ``--env-file`` (it found no token and said so), and says which file it read."""
    import os
    import subprocess
    import sys

    folder = tmp_path / "homefleet-worker"
    folder.mkdir()
    token_file = write_private(folder / "worker-token", "a-machine-token-0123456789\n")
    (folder / "worker.env").write_text(
        f"HOMEFLEET_REDIS_URL={redis_base_url}/0\nHOMEFLEET_WORKER_TOKEN_FILE={token_file}\n"
        f"HOMEFLEET_MODELS_DIR={folder / 'models'}\nHOMEFLEET_SERVER_URL=http://127.0.0.1:{free_port()}\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOMEFLEET_")}
    done = subprocess.run(
        [sys.executable, "-m", "app.cli", "doctor"],
        cwd=tmp_path,
        env={**env, "COLUMNS": "200"},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert "settings: homefleet-worker/worker.env (written by `homefleet worker join`" in done.stderr, done.stderr
    assert f"{token_file} (mode 0600)" in done.stdout, done.stdout
