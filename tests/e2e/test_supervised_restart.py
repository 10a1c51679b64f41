"""A worker killed with ``kill -9`` comes back by itself under a real supervisor (docs/operations.md,
"A supervisor for every worker"): ``supervisord`` runs the command of the unit that ``homefleet
worker --print-systemd-unit`` prints, restarts it when it dies, and the new worker (a new boot id)
takes the machine's lease again once the dead one's expires (R7), is online with its next
heartbeat and runs a job. The time back online is printed (no timed assert)."""

from __future__ import annotations

import configparser
import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis

from app.client import HomefleetClient
from app.core.config import Settings
from app.core.keys import Keys
from app.core.secret_files import write_private
from app.core.tls import tls_context
from app.devtools.localfleet import LocalFleet
from app.devtools.redis_server import free_port
from tests.helpers import TEST_API_KEY, make_fleet, run_cli, wait_for

pytestmark = pytest.mark.e2e

MODEL = "tiny-sd"
MACHINE = "m1"
PROGRAM = f"homefleet-worker-{MACHINE}"
TTL_S = 4.0


def supervisorctl(conf: Path, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "supervisor.supervisorctl", "-c", str(conf), *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    return done.stdout + done.stderr


@pytest.fixture
def supervised(
    tmp_path: Path, redis_base_url: str, tiny_models_dir: Path
) -> Iterator[tuple[LocalFleet, Path, Path, redis.Redis]]:
    """The API (``homefleet serve``) and machine m1's worker under ``supervisord``, run with the
    ExecStart and Environment of the unit ``homefleet worker --print-systemd-unit`` printed."""
    pytest.importorskip("supervisor", reason="supervisord (pip install -e '.[test]') runs the worker")
    redis_url = f"{redis_base_url}/14"
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    client.flushdb()
    fleet = make_fleet(MACHINE)
    fleet_file = tmp_path / "fleet.toml"
    write_private(fleet_file, fleet.to_toml())
    settings = Settings(
        data_dir=tmp_path / "server",
        redis_url=redis_url,
        fleet_file=fleet_file,
        api_port=free_port(),
        heartbeat_interval_s=0.5,
        heartbeat_ttl_s=TTL_S,
        api_keys=[TEST_API_KEY],
    )
    operator = {
        "HOMEFLEET_DATA_DIR": str(settings.data_dir),
        "HOMEFLEET_FLEET_FILE": str(fleet_file),
        "HOMEFLEET_REDIS_URL": redis_url,
    }
    run_cli("db", "upgrade", env=operator)
    run_cli("models", "add", str(tiny_models_dir / MODEL), "--id", MODEL, env=operator)
    local = LocalFleet(settings, fleet, fleet_file, forkserver=True)
    local.copy_model(MODEL, MACHINE)
    token_file = local.machine_dir(MACHINE) / "worker-token"
    write_private(token_file, f"{fleet.machines[MACHINE].token}\n")
    unit = run_cli(
        "worker",
        "--machine",
        MACHINE,
        "--models-dir",
        str(local.models_dir(MACHINE)),
        "--token-file",
        str(token_file),
        "--server-url",
        local.api_url,
        "--print-systemd-unit",
        env={"HOMEFLEET_REDIS_URL": redis_url, "HOMEFLEET_WORKER_TOKEN": None, "HOMEFLEET_WORKER_TOKEN_FILE": None},
    ).stdout
    parser = configparser.ConfigParser(interpolation=None)
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    parser.read_string(unit)
    service = parser["Service"]
    assert service["Restart"] == "on-failure"
    command = shlex.split(service["ExecStart"].replace("%%", "%"))
    environment = dict(word.split("=", 1) for word in shlex.split(service["Environment"].replace("%%", "%")))
    environment.update(
        {
            "HOMEFLEET_HEARTBEAT_INTERVAL_S": "0.5",
            "HOMEFLEET_HEARTBEAT_TTL_S": str(TTL_S),
            "HOMEFLEET_TORCH_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
        }
    )
    run_dir = tmp_path / "supervisor"
    run_dir.mkdir()
    conf = run_dir / "supervisord.conf"
    # autorestart=unexpected with exitcodes=0: restarted on any other exit or signal, as Restart=on-failure;
    # startsecs=0: a worker refused the lease (exit 78) until the dead one's expires is restarted, never FATAL
    conf.write_text(f"""[supervisord]
nodaemon=true
logfile={run_dir}/supervisord.log
pidfile={run_dir}/supervisord.pid
childlogdir={run_dir}

[unix_http_server]
file={run_dir}/supervisor.sock

[rpcinterface:supervisor]
supervisor.rpcinterface_factory = supervisor.rpcinterface:make_main_rpcinterface

[supervisorctl]
serverurl=unix://{run_dir}/supervisor.sock

[program:{PROGRAM}]
command={shlex.join(command)}
directory={service["WorkingDirectory"]}
environment={",".join(f'{key}="{value}"' for key, value in environment.items())}
autorestart=unexpected
exitcodes=0
startsecs=0
startretries=100
stopsignal=TERM
stopwaitsecs=60
stopasgroup=true
killasgroup=true
redirect_stderr=true
stdout_logfile={run_dir}/{PROGRAM}.log
""")
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOMEFLEET_")}
    supervisor = None
    try:
        local.start_api()
        supervisor = subprocess.Popen(
            [sys.executable, "-m", "supervisor.supervisord", "-c", str(conf)],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        local.wait_online([MACHINE], model_id=MODEL, timeout_s=180)
        yield local, conf, run_dir, client
    finally:
        if supervisor is not None:
            supervisorctl(conf, "shutdown")
            try:
                supervisor.wait(timeout=90)
            except subprocess.TimeoutExpired:
                os.killpg(supervisor.pid, signal.SIGKILL)
        local.stop()
        client.close()


def test_a_worker_killed_with_kill_9_is_restarted_by_its_supervisor_and_runs_jobs_again(
    supervised: tuple[LocalFleet, Path, Path, redis.Redis],
) -> None:
    local, conf, run_dir, client = supervised
    heartbeat = Keys("hf").heartbeat(MACHINE)
    first_boot = json.loads(client.get(heartbeat))["boot_id"]
    first_pid = int(supervisorctl(conf, "pid", PROGRAM).strip())
    os.kill(first_pid, signal.SIGKILL)
    killed_at = time.monotonic()
    try:
        beat = wait_for(
            lambda: (
                (raw := client.get(heartbeat))
                and (b := json.loads(raw))["boot_id"] != first_boot
                and MODEL in b["verified_models"]
                and b
            ),
            timeout_s=180,
            what="a heartbeat of a new boot of m1 with its model verified",
        )
        local.wait_online([MACHINE], model_id=MODEL, timeout_s=60)
        back_online_s = time.monotonic() - killed_at
        print(f"\nm1 back online {back_online_s:.1f} s after kill -9 (heartbeat TTL {TTL_S} s)")
        (run_dir / "back-online-s").write_text(f"{back_online_s:.2f}\n")
        second_pid = int(supervisorctl(conf, "pid", PROGRAM).strip())
        assert second_pid != first_pid and len(beat["boot_id"]) == 32
        log = (run_dir / "supervisord.log").read_text()
        assert f"exited: {PROGRAM} (terminated by SIGKILL" in log, log
        assert log.count(f"spawned: '{PROGRAM}'") >= 2, log
        with HomefleetClient(local.api_url, api_key=TEST_API_KEY) as api:
            job = api.submit(
                MODEL, "txt2img", {"prompt": "back", "steps": 2, "width": 64, "height": 64}, target=MACHINE
            )
            done = api.wait(job["id"], timeout_s=180)
        assert done["state"] == "succeeded", done
        rows = httpx.get(
            f"{local.api_url}/v1/machines", headers=local.auth_headers, timeout=5, verify=tls_context()
        ).json()
        assert {row["name"]: row["online"] for row in rows}[MACHINE] is True
    finally:
        with contextlib.suppress(ProcessLookupError):  # the killed worker's pool processes, left in its group
            os.killpg(first_pid, signal.SIGKILL)
