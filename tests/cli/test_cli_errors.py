"""A configuration mistake stops a CLI command with one line naming the setting or file and
exit status 2, not a traceback (new-user pass): a non-JSON list in HOMEFLEET_API_KEYS, a
misspelt limit, a fleet file that is missing or not TOML, a Redis that does not answer, a
journal URL that cannot be used or a database that does not answer, a data folder that cannot be
made."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from app.core.secret_files import write_private
from app.devtools.redis_server import free_port


@pytest.mark.parametrize(
    ("variable", "value", "reason", "names"),
    [
        (
            "HOMEFLEET_API_KEYS",
            "key1,key2",
            "invalid_settings",
            'HOMEFLEET_API_KEYS could not be parsed: lists and tables are JSON (e.g. \'["key1", "key2"]\')',
        ),
        (
            "HOMEFLEET_LIMITS",
            '{{"sd1": {{"max_pixel": 5}}}}',
            "invalid_settings",
            "HOMEFLEET_LIMITS.sd1.max_pixel: Extra inputs",
        ),
        (
            "HOMEFLEET_API_KEY_QUOTAS",
            '{{"x":',
            "invalid_settings",
            "HOMEFLEET_API_KEY_QUOTAS could not be parsed: lists and tables are JSON (e.g. '{\"key1\": {...}}')",
        ),
        ("HOMEFLEET_FLEET_FILE", "{tmp}/missing.toml", "invalid_config", "missing.toml"),
        ("HOMEFLEET_FLEET_FILE", "{tmp}/bad.toml", "invalid_config", "is not valid TOML"),
        ("HOMEFLEET_REDIS_URL", "redis://127.0.0.1:{port}/0", "redis_down", "HOMEFLEET_REDIS_URL"),
    ],
    ids=[
        "api_keys_not_json",
        "limits_misspelt",
        "quotas_not_json",
        "fleet_file_missing",
        "fleet_file_not_toml",
        "redis_down",
    ],
)
def test_a_configuration_mistake_is_one_line_and_exit_2(
    tmp_path: Path, redis_url: str, variable: str, value: str, reason: str, names: str
) -> None:
    (tmp_path / "bad.toml").write_text("not [ toml")
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOMEFLEET_")}
    env.update(
        {
            "HOMEFLEET_DATA_DIR": str(tmp_path / "data"),
            "HOMEFLEET_REDIS_URL": redis_url,
            variable: value.format(tmp=tmp_path, port=free_port()),
        }
    )
    if reason == "redis_down":  # a journal that is up to date: the command gets as far as Redis
        subprocess.run([sys.executable, "-m", "app.cli", "db", "upgrade"], env=env, check=True, capture_output=True)
    done = subprocess.run(
        [sys.executable, "-m", "app.cli", "status"], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stdout + done.stderr
    assert f"error ({reason})" in done.stderr and names in done.stderr, done.stderr
    assert done.stderr.startswith(f"error ({reason})"), done.stderr  # nothing before it (a cache warning was)
    assert done.stdout == "", done.stdout  # stdout is for a command's output: `status > file` gets no error
    assert "https://" not in done.stdout + done.stderr  # no documentation links in a one-line error


def test_serve_refuses_a_fleet_whose_machines_have_no_usable_token(tmp_path: Path) -> None:
    """Workers authenticate with their machine's token (at least 16 characters): a server
    started without one would refuse every worker."""
    fleet = tmp_path / "fleet.toml"
    write_private(
        fleet,
        '[machines.server]\nname = "server"\nbackend = "cpu"\nmemory_kind = "unified"\n'
        'memory_bytes = 8000000000\nfamilies = ["sd1"]\ntoken = "short"\n',
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOMEFLEET_")}
    env.update(
        {
            "HOMEFLEET_DATA_DIR": str(tmp_path / "data"),
            "HOMEFLEET_FLEET_FILE": str(fleet),
            "HOMEFLEET_API_KEYS": '["k1"]',
        }
    )
    done = subprocess.run(
        [sys.executable, "-m", "app.cli", "serve"], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert "error (invalid_config)" in done.stderr and "'server' needs a token of at least 16 characters" in done.stderr


def test_r22_serve_refuses_limits_for_a_family_no_machine_runs(tmp_path: Path) -> None:
    """A misspelt family in HOMEFLEET_LIMITS (``sdxll``) would limit nothing: the jobs it was
    meant for would run under the default limits. serve refuses it, naming the family, the
    known families and the closest one."""
    fleet = tmp_path / "fleet.toml"
    write_private(
        fleet,
        '[machines.server]\nname = "server"\nbackend = "cpu"\nmemory_kind = "unified"\n'
        'memory_bytes = 8000000000\nfamilies = ["sd1", "sdxl"]\ntoken = "a-token-of-24-characters"\n',
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOMEFLEET_")}
    env.update(
        {
            "HOMEFLEET_DATA_DIR": str(tmp_path / "data"),
            "HOMEFLEET_FLEET_FILE": str(fleet),
            "HOMEFLEET_API_KEYS": '["k1"]',
            "HOMEFLEET_LIMITS": '{"default": {}, "sdxll": {"max_steps": 10}}',
        }
    )
    done = subprocess.run(
        [sys.executable, "-m", "app.cli", "serve"], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert "error (invalid_config): HOMEFLEET_LIMITS names family 'sdxll', which no machine runs" in done.stderr
    # the machines' families and the built-in limits' (app/core/limits.py)
    assert "(families: default, flux, flux-kontext, gpt2, llama, qwen-image, qwen2, sd1, sdxl, wan)" in done.stderr
    assert "did you mean 'sdxl'?" in done.stderr


def test_a_fleet_file_family_table_for_no_machine_is_refused_naming_the_file(tmp_path: Path) -> None:
    """Working-memory coefficients for a family no machine runs would configure nothing: the
    fleet file is refused with one line that names it (a fleet-wide check has no field path;
    pydantic's "Value error," prefix is left out)."""
    fleet = tmp_path / "fleet.toml"
    write_private(
        fleet,
        '[machines.server]\nname = "server"\nbackend = "cpu"\nmemory_kind = "unified"\n'
        'memory_bytes = 8000000000\nfamilies = ["sd1"]\n[families.sd-1.working_memory.txt2img]\n',
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOMEFLEET_")}
    env.update({"HOMEFLEET_DATA_DIR": str(tmp_path / "data"), "HOMEFLEET_FLEET_FILE": str(fleet)})
    done = subprocess.run(
        [sys.executable, "-m", "app.cli", "status"], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert (
        "error (invalid_settings): the fleet file: the families table names family 'sd-1', which no machine "
        "runs (families: sd1); did you mean 'sd1'?"
    ) in done.stderr, done.stderr
    assert "Value error" not in done.stdout + done.stderr


def test_a_misspelt_homefleet_variable_is_named_with_the_closest_setting(tmp_path: Path) -> None:
    """Settings ignore unknown HOMEFLEET_* variables (server and workers share one environment
    but not one set of settings): a misspelt one would change nothing, silently. The CLI warns
    on standard error, naming the setting it was probably meant for; known ones pass quietly."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOMEFLEET_")}
    env.update(
        {
            "HOMEFLEET_DATA_DIR": str(tmp_path / "data"),
            "HOMEFLEET_MAX_QUEUED_PER_MACHIN": "3",
            "HOMEFLEET_WORKER_TOKEN": "x" * 32,
            "HOMEFLEET_API_KEY": "k",
        }
    )
    done = subprocess.run(
        [sys.executable, "-m", "app.cli", "models", "--help"], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr.splitlines() == [
        "warning: HOMEFLEET_MAX_QUEUED_PER_MACHIN is not a Homefleet setting; it is "
        "ignored (did you mean HOMEFLEET_MAX_QUEUED_PER_MACHINE?)"
    ], done.stderr


@pytest.mark.parametrize(
    ("variable", "value", "command", "said"),
    [
        (
            "HOMEFLEET_DATABASE_URL",
            "foo://x",
            "models list",
            "error (invalid_settings): HOMEFLEET_DATABASE_URL 'foo://x' "
            "cannot be used: Can't load plugin: sqlalchemy.dialects:foo",
        ),
        (
            "HOMEFLEET_DATABASE_URL",
            "not a url",
            "status",
            "error (invalid_settings): HOMEFLEET_DATABASE_URL 'not a url' "
            "cannot be used: Could not parse SQLAlchemy URL",
        ),
        (
            "HOMEFLEET_DATABASE_URL",
            "postgresql://u:secret@127.0.0.1:{port}/db",
            "db upgrade",
            "error (journal_down): the journal's database postgresql://u:***@127.0.0.1:{port}/db does not answer",
        ),
        (
            "HOMEFLEET_DATABASE_URL",
            "sqlite:///{tmp}/no/such/folder/j.db",
            "models list",
            "error (journal_down): the journal's database sqlite:///{tmp}/no/such/folder/j.db does not answer or "
            "cannot be opened (unable to open database file)",
        ),
        (
            "HOMEFLEET_DATA_DIR",
            "{tmp}/a-file",
            "db upgrade",
            "error (path_unusable): {tmp}/a-file cannot be used: File exists (check HOMEFLEET_DATA_DIR)",
        ),
    ],
    ids=["no_driver", "not_a_url", "postgres_down", "sqlite_folder_missing", "data_dir_a_file"],
)
def test_a_journal_or_data_folder_that_cannot_be_used_is_one_line_and_exit_2(
    tmp_path: Path, variable: str, value: str, command: str, said: str
) -> None:
    """Errors of SQLAlchemy and of the file system that no command catches itself reach the
    CLI's entry point, which names the setting (a password redacted) instead of a traceback."""
    (tmp_path / "a-file").write_text("")
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOMEFLEET_")}
    env.update({"HOMEFLEET_DATA_DIR": str(tmp_path / "data"), variable: value.format(tmp=tmp_path, port=port)})
    done = subprocess.run(
        [sys.executable, "-m", "app.cli", *command.split()], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2 and done.stdout == "", done.stdout + done.stderr
    line = " ".join(done.stderr.split())
    assert said.format(tmp=tmp_path, port=port) in line, line
    assert "Traceback" not in done.stderr and "secret" not in done.stderr


def test_purge_says_redis_is_down_before_asking_and_never_reports_a_purge(tmp_path: Path) -> None:
    """`homefleet purge MACHINE -y` with Redis down purged nothing: it says `redis_down` (exit 2),
    not "purged 0 queued jobs"; without -y it says so before asking."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOMEFLEET_")}
    env.update(
        {"HOMEFLEET_DATA_DIR": str(tmp_path / "data"), "HOMEFLEET_REDIS_URL": f"redis://127.0.0.1:{free_port()}/0"}
    )
    subprocess.run([sys.executable, "-m", "app.cli", "db", "upgrade"], env=env, check=True, capture_output=True)
    for flags in (["-y"], []):
        done = subprocess.run(
            [sys.executable, "-m", "app.cli", "purge", "server", *flags],
            env=env,
            input="",
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 2 and "error (redis_down)" in done.stderr, done.stdout + done.stderr
        assert "purged" not in done.stdout and "cancel every queued job" not in done.stdout, done.stdout


def test_purge_in_a_script_without_yes_is_one_line_naming_the_flag(tmp_path: Path, redis_url: str) -> None:
    """`homefleet purge MACHINE` from a script (stdin no terminal) cannot be asked: one
    ``error (confirmation_needed)`` line naming ``--yes``, exit 2, nothing purged (it printed the
    question, then click's "Aborted!", exit 1)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOMEFLEET_")}
    env.update({"HOMEFLEET_DATA_DIR": str(tmp_path / "data"), "HOMEFLEET_REDIS_URL": redis_url})
    subprocess.run([sys.executable, "-m", "app.cli", "db", "upgrade"], env=env, check=True, capture_output=True)
    done = subprocess.run(
        [sys.executable, "-m", "app.cli", "purge", "box1"],
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    line = done.stderr.strip()
    assert line.startswith("error (confirmation_needed): purge asks before it cancels every queued job of box1"), line
    assert "homefleet purge box1 --yes" in line and len(line.splitlines()) == 1, line
    assert "Aborted" not in done.stdout + done.stderr and "purged" not in done.stdout


def test_flower_with_redis_down_says_so_and_exits_instead_of_retrying_forever(tmp_path: Path) -> None:
    """`homefleet flower` with nothing answering at HOMEFLEET_REDIS_URL: Flower would warn and
    retry the broker forever; the command says `redis_down` and exits 2 within seconds."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOMEFLEET_")}
    env.update(
        {"HOMEFLEET_DATA_DIR": str(tmp_path / "data"), "HOMEFLEET_REDIS_URL": f"redis://127.0.0.1:{free_port()}/0"}
    )
    done = subprocess.run(
        [sys.executable, "-m", "app.cli", "flower", "--port", str(free_port())],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "error (redis_down)" in done.stderr, done.stdout + done.stderr
    assert "HOMEFLEET_REDIS_URL" in " ".join(done.stderr.split()) and "Traceback" not in done.stderr


@pytest.mark.parametrize(
    "command", [["drain", "nobox"], ["purge", "nobox", "-y"], ["oom", "clear", "nobox"], ["timings", "forget", "nobox"]]
)
def test_a_machine_the_fleet_does_not_have_is_one_error_line_naming_the_machines(
    tmp_path: Path, redis_url: str, command: list[str]
) -> None:
    """A machine name is a domain value, not a usage mistake: `unknown_machine` in one line on
    stderr, exit 2, as `sync`, `jobs` and the API name it, listing the fleet's machines."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOMEFLEET_")}
    env.update({"HOMEFLEET_DATA_DIR": str(tmp_path / "data"), "HOMEFLEET_REDIS_URL": redis_url})
    subprocess.run([sys.executable, "-m", "app.cli", "db", "upgrade"], env=env, check=True, capture_output=True)
    done = subprocess.run(
        [sys.executable, "-m", "app.cli", *command], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2 and done.stdout == "", done.stdout + done.stderr
    assert done.stderr.startswith("error (unknown_machine): machine 'nobox' is not in this fleet; machines: "), (
        done.stderr
    )
    assert "server" in done.stderr and len(done.stderr.strip().splitlines()) == 1 and "Usage" not in done.stderr


@pytest.mark.parametrize("url", ["http://127.0.0.1:{port}", "notaurl", "ftp://server:8787"])
def test_worker_join_with_a_url_nothing_answers_at_is_one_error_line(tmp_path: Path, url: str) -> None:
    """A mistyped server URL: one `server_unreachable` line naming it and the URL's shape, exit
    2 (it was a 257-line traceback), and nothing written in the worker's folder."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOMEFLEET_")}
    given = url.format(port=free_port())
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "app.cli",
            "worker",
            "join",
            given,
            "hfj_0123456789abcdef",
            "--models-dir",
            str(tmp_path / "w" / "models"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    said = " ".join(done.stderr.split())
    assert done.returncode == 2 and said.startswith(f"error (server_unreachable): the server at '{given}'"), said
    assert "http://server:8787" in said and "Traceback" not in done.stderr
    assert not (tmp_path / "w" / "worker-token").exists()


def test_flower_on_a_taken_port_or_with_a_malformed_basic_auth_is_one_error_line(
    tmp_path: Path, redis_url: str
) -> None:
    """Flower's own answer to a taken port is a tornado traceback, and a basic auth without
    `user:password` lets nobody in: both are refused before Flower starts, exit 2, the
    password never shown."""
    import socket

    env = {k: v for k, v in os.environ.items() if not k.startswith(("HOMEFLEET_", "FLOWER_"))}
    env.update({"HOMEFLEET_DATA_DIR": str(tmp_path / "data"), "HOMEFLEET_REDIS_URL": redis_url})
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-m", "app.cli", "flower", "--port", str(port)],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
    said = " ".join(done.stderr.split())
    assert done.returncode == 2 and said.startswith(f"error (port_in_use): Flower's address 127.0.0.1:{port}"), said
    assert "--port" in said and "Traceback" not in done.stderr
    done = subprocess.run(
        [sys.executable, "-m", "app.cli", "flower", "--port", str(free_port())],
        env={**env, "FLOWER_BASIC_AUTH": "adminsecretpw"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    said = " ".join(done.stderr.split())
    assert done.returncode == 2 and "error (invalid_settings): --basic-auth (FLOWER_BASIC_AUTH) must be" in said
    assert "adminsecretpw" not in done.stderr + done.stdout


def test_flower_without_basic_auth_warns_that_its_api_and_buttons_answer_401(tmp_path: Path, redis_url: str) -> None:
    """Flower without ``--basic-auth`` serves its dashboard to anyone, while its API (the
    Revoke and Terminate buttons) answers 401: said at start, on stderr, before Flower runs."""
    import select

    env = {k: v for k, v in os.environ.items() if not k.startswith(("HOMEFLEET_", "FLOWER_"))}
    env.update({"HOMEFLEET_DATA_DIR": str(tmp_path / "data"), "HOMEFLEET_REDIS_URL": redis_url})
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "app.cli", "flower", "--port", str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert process.stderr is not None
        ready, _, _ = select.select([process.stderr], [], [], 60)
        first = process.stderr.readline() if ready else ""
    finally:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=30)
    assert first.startswith(f"warning: no --basic-auth (FLOWER_BASIC_AUTH): Flower's dashboard at 127.0.0.1:{port}")
    assert "answers 401" in first and "FLOWER_BASIC_AUTH=user:password" in first


def test_machines_add_and_oom_clear_refuse_values_that_would_do_nothing_in_one_line(
    tmp_path: Path, redis_url: str
) -> None:
    """A machine name the fleet file refuses (pydantic's internals were shown in a usage box), a
    family no model has (the machine was added and would be placed nothing), an OOM record of a
    kind or model that does not exist ("0 cleared", exit 0): each one line on stderr, exit 2,
    the fleet file untouched."""
    fleet_file = tmp_path / "fleet.toml"
    fleet_file.write_text(
        '[[machines]]\nname = "server"\nbackend = "cpu"\nmemory_kind = "unified"\nmemory_bytes = 8000000000\n'
        'families = ["sd1"]\ntoken = "server-token-0123456789abcdef"\n'
    )
    fleet_file.chmod(0o600)
    before = fleet_file.read_text()
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOMEFLEET_")}
    env.update(
        {
            "HOMEFLEET_DATA_DIR": str(tmp_path / "data"),
            "HOMEFLEET_REDIS_URL": redis_url,
            "HOMEFLEET_FLEET_FILE": str(fleet_file),
        }
    )
    subprocess.run([sys.executable, "-m", "app.cli", "db", "upgrade"], env=env, check=True, capture_output=True)
    for command, said in (
        (
            ["machines", "add", "bad name!", "--wait-s", "0"],
            "error (invalid_machine): a machine name is a host name (lowercase letters, digits and '-'",
        ),
        (
            ["machines", "add", "box1", "--families", "sd1,nofam", "--wait-s", "0"],
            "error (unknown_family): --families: 'nofam' is no model family; families: sd1, sdxl",
        ),
        (
            ["oom", "clear", "server", "--kind", "bogus"],
            "error (unknown_kind): kind 'bogus' is unknown; kinds: txt2img",
        ),
        (["oom", "clear", "server", "--model", "nomodel"], "error (unknown_model): model 'nomodel' is not registered"),
    ):
        done = subprocess.run(
            [sys.executable, "-m", "app.cli", *command], env=env, capture_output=True, text=True, timeout=120
        )
        line = done.stderr.strip()
        assert done.returncode == 2 and line.startswith(said) and len(line.splitlines()) == 1, done.stdout + line
        assert "errors.pydantic.dev" not in line and "cleared" not in done.stdout
    assert fleet_file.read_text() == before


@pytest.mark.parametrize(
    ("options", "said"),
    [
        (["--seed", "5", "--new-seed"], "error (conflicting_options): give --seed or --new-seed, not both"),
        (["--seed", "-1"], "error (invalid_option): --seed must be an integer from 0 to 9223372036854775807, got -1"),
        (["--seed", str(2**63)], "error (invalid_option): --seed must be an integer from 0 to 9223372036854775807"),
    ],
)
def test_bad_requeue_options_are_one_error_line_not_a_usage_box(
    tmp_path: Path, redis_url: str, options: list[str], said: str
) -> None:
    """``homefleet jobs requeue ID --seed 5 --new-seed``, or a seed out of the API's range: one
    ``error (reason)`` line on stderr, exit 2, as every refusal, before anything is read (it
    printed typer's usage box)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOMEFLEET_")}
    env.update({"HOMEFLEET_DATA_DIR": str(tmp_path / "data"), "HOMEFLEET_REDIS_URL": redis_url})
    done = subprocess.run(
        [sys.executable, "-m", "app.cli", "jobs", "requeue", "abcdef12", *options],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.startswith(said), done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "Usage" not in done.stderr and not (tmp_path / "data").exists()
