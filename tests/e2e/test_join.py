"""A machine joins a running fleet with two commands (docs/operations.md, "Add a machine"):
``homefleet machines add`` on the server's host, ``homefleet worker join`` on the new one. Real
``homefleet serve``, real ``celery worker`` processes, the real tiny pipeline.

The fleet here: machine ``server`` (no worker: offline, so Auto goes elsewhere) and ``m1``, whose
worker is frozen (SIGSTOP) with one job queued on it: that job stays queued for as long as the
test needs, an event stream follows it across the reloads, and removing ``m1`` is refused.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import redis

from app.client import HomefleetClient
from app.core.config import Settings
from app.core.keys import Keys
from app.core.tls import tls_context
from app.devtools.localfleet import LocalFleet
from app.devtools.procs import stop_process_group
from app.devtools.redis_server import free_port
from app.fleet import live
from routing.placement import AUTO
from tests.helpers import TEST_API_KEY, freeze_worker, make_fleet, run_cli

pytestmark = pytest.mark.e2e

MODEL = "tiny-sd"
PARAMS = {"prompt": "a new machine", "steps": 2}
JOIN_COMMAND = re.compile(r"^homefleet worker join (\S+) (hfj_\S+)$", re.MULTILINE)


@dataclass
class JoinFleet:
    local: LocalFleet
    client: HomefleetClient
    operator: dict[str, str | None]
    fleet_file: Path


@pytest.fixture(scope="module")
def join_fleet(
    tmp_path_factory: pytest.TempPathFactory, redis_base_url: str, tiny_models_dir: Path
) -> Iterator[JoinFleet]:
    data_dir = tmp_path_factory.mktemp("join-fleet")
    redis_url = f"{redis_base_url}/5"
    redis.Redis.from_url(redis_url).flushdb()
    fleet_config = make_fleet("m1")
    fleet_file = data_dir / "fleet.toml"
    fleet_file.write_text("# the operator's own comment, kept by every rewrite\n" + fleet_config.to_toml())
    fleet_file.chmod(0o600)
    settings = Settings(
        data_dir=data_dir,
        redis_url=redis_url,
        fleet_file=fleet_file,
        api_port=free_port(),
        heartbeat_interval_s=0.5,
        heartbeat_ttl_s=8,
        api_keys=[TEST_API_KEY],
        fleet_watch_s=0.2,
    )
    operator: dict[str, str | None] = {
        "HOMEFLEET_DATA_DIR": str(data_dir),
        "HOMEFLEET_FLEET_FILE": str(fleet_file),
        "HOMEFLEET_REDIS_URL": redis_url,
        "HOMEFLEET_API_PORT": str(settings.api_port),
    }
    run_cli("db", "upgrade", env=operator)
    run_cli("models", "add", str(tiny_models_dir / MODEL), "--id", MODEL, env=operator)
    local = LocalFleet(settings, fleet_config, fleet_file, forkserver=True)
    client = HomefleetClient(local.api_url, api_key=TEST_API_KEY)
    try:
        local.copy_model(MODEL, "m1")
        local.start_api()
        local.start_worker("m1")
        local.wait_online(["m1"], model_id=MODEL, timeout_s=180)
        yield JoinFleet(local, client, operator, fleet_file)
    finally:
        worker = local.processes.get("worker-m1")
        if worker is not None and worker.poll() is None:
            os.killpg(worker.pid, signal.SIGCONT)
        client.close()
        local.stop()


def _follow(client: HomefleetClient, job_id: str, seen: list[tuple[str, dict]], errors: list[BaseException]) -> None:
    """Read the job's event stream to its end, keeping (event, data) pairs."""
    try:
        with httpx.stream(
            "GET",
            f"{client.http.base_url}/v1/jobs/{job_id}/events",
            headers={"Authorization": f"Bearer {TEST_API_KEY}"},
            timeout=httpx.Timeout(10, read=600),
            verify=tls_context(),
        ) as r:
            assert r.status_code == 200
            event = ""
            for line in r.iter_lines():
                if line.startswith("event:"):
                    event = line.split(":", 1)[1].strip()
                elif line.startswith("data:") and event:
                    seen.append((event, json.loads(line.split(":", 1)[1])))
    except BaseException as error:  # noqa: BLE001 - handed to the test, which fails on it
        errors.append(error)


def join_from_stdin(
    server_url: str, token: str, models_dir: Path, env: dict[str, str], *options: str
) -> subprocess.CompletedProcess[str]:
    """``homefleet worker join SERVER_URL -`` with the join token on stdin, as a new host runs it
    (its own process: the worker it would start is not started when ``options`` print a file)."""
    return subprocess.run(
        [sys.executable, "-m", "app.cli", "worker", "join", server_url, "-", "--models-dir", str(models_dir), *options],
        input=token + "\n",
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def _join_post(url: str, token: str, backend: str = "cpu") -> httpx.Response:
    return httpx.post(
        f"{url}/internal/v1/join",
        json={"backend": backend, "memory_bytes": 8_000_000_000},
        headers={"Authorization": f"Bearer {token}"},
        timeout=30,
        verify=tls_context(),
    )


@pytest.mark.timeout(900)  # three process starts, two torch probes and eight CLI runs: 130 s here on 2 shared cores
def test_a_running_fleet_gains_a_machine_by_add_and_join_without_a_restart(
    join_fleet: JoinFleet, tmp_path: Path
) -> None:
    local, client, operator = join_fleet.local, join_fleet.client, join_fleet.operator
    api_pid = local.processes["api"].pid
    # m1 frozen with a job queued on it (submitted while its heartbeat is still live), holding no BRPOP
    freeze_worker(local.processes["worker-m1"].pid, redis.Redis.from_url(local.settings.redis_url))
    stuck = client.submit(MODEL, "txt2img", PARAMS, target="m1")
    assert stuck["state"] == "queued" and stuck["machine"] == "m1"
    seen: list[tuple[str, dict]] = []
    errors: list[BaseException] = []
    stream = threading.Thread(target=_follow, args=(client, stuck["id"], seen, errors), daemon=True)
    stream.start()

    # 1. on the server's host: one command, the running server reloads its fleet file
    added = run_cli("machines", "add", "m9", "--memory", "2", "--families", "sd1", env=operator)
    assert "the running server (pid" in added.stdout and "reloaded" in added.stdout, added.stdout
    match = JOIN_COMMAND.search(added.stdout)
    assert match is not None, added.stdout
    server_url, join_token = match.groups()
    assert server_url == local.api_url
    warning = " ".join(added.stderr.split())  # the URL and Redis are 127.0.0.1: said, on stderr only
    assert "the server's URL and its Redis name this host's loopback address" in warning, added.stderr
    assert "HOMEFLEET_API_HOST=0.0.0.0" in warning and "HOMEFLEET_WORKER_REDIS_URL" in warning
    text = join_fleet.fleet_file.read_text()
    assert text.startswith("# the operator's own comment") and 'name = "m9"' in text
    assert join_token not in text  # only the machine's token is in the fleet file, never the join token
    assert join_fleet.fleet_file.stat().st_mode & 0o777 == 0o600
    assert "m9" in {row["name"] for row in client.machines()}

    # 2. on the new host: one command (the join token from a file here; argv or stdin also do)
    host = tmp_path / "m9-host"
    models_dir = host / "models"
    models_dir.mkdir(parents=True)
    shutil.copytree(local.settings.models_dir / MODEL, models_dir / MODEL)  # as a sync would bring it
    token_file = tmp_path / "join-token"
    token_file.write_text(join_token + "\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOMEFLEET_")}  # a bare host
    env.update({"HOMEFLEET_TORCH_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    log_file = open(tmp_path / "worker-m9.log", "wb")  # noqa: SIM115 - closed below
    joined = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "app.cli",
            "worker",
            "join",
            server_url,
            "--join-token-file",
            str(token_file),
            "--models-dir",
            str(models_dir),
        ],
        env=env,
        stdout=log_file,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        local.wait_online(["m9"], model_id=MODEL, timeout_s=240)
        assert (host / "worker-token").stat().st_mode & 0o777 == 0o600
        worker_env = live_env(host / "worker.env")
        assert worker_env["HOMEFLEET_MACHINE"] == "m9"
        assert (host / "worker-token").read_text().strip() not in (host / "worker.env").read_text()
        assert joined.poll() is None

        # a reused, an expired, an unknown join token: 401 with the reason
        reused = _join_post(server_url, join_token)
        assert reused.status_code == 401 and reused.json()["error"]["reason"] == "join_token_used"
        expiring = JOIN_COMMAND.search(run_cli("machines", "add", "m8", "--expires-s", "1", env=operator).stdout)
        assert expiring is not None
        time.sleep(2.5)
        expired = _join_post(server_url, expiring.group(2))
        assert expired.status_code == 401 and expired.json()["error"]["reason"] == "join_token_expired"
        # rotate-token: the old machine token is refused once the server reloaded, a new join hands the new one
        old_m8 = live.parse(join_fleet.fleet_file.read_text(), "fleet").machines["m8"].token
        rotated = JOIN_COMMAND.search(run_cli("machines", "rotate-token", "m8", env=operator).stdout)
        assert rotated is not None
        new_m8 = live.parse(join_fleet.fleet_file.read_text(), "fleet").machines["m8"].token
        assert new_m8 != old_m8
        assert (
            httpx.get(
                f"{server_url}/internal/v1/manifest",
                headers={"Authorization": f"Bearer {old_m8}"},
                timeout=30,
                verify=tls_context(),
            ).status_code
            == 401
        )
        grant = _join_post(server_url, rotated.group(2))
        assert grant.status_code == 200 and grant.json()["machine"] == "m8" and grant.json()["token"] == new_m8
        # doctor asks the server whether it takes the token, as the worker would (it said "nothing missing")
        doctor_env = {
            "HOMEFLEET_SERVER_URL": server_url,
            "HOMEFLEET_MACHINE": "m8",
            "HOMEFLEET_WORKER_TOKEN": None,
            "HOMEFLEET_REDIS_URL": local.settings.redis_url,
            "COLUMNS": "200",
        }
        for token, taken in ((old_m8, False), (new_m8, True)):
            held = tmp_path / f"m8-token-{taken}"
            held.write_text(f"{token}\n")
            held.chmod(0o600)
            doctored = run_cli("doctor", "--token-file", str(held), env=doctor_env, check=False)
            said = " ".join(doctored.stdout.split())
            if taken:
                assert doctored.returncode == 0 and f"taken by {server_url} for machine m8" in said, said
            else:
                assert doctored.returncode == 1 and f"refused by {server_url}" in said, said
                assert "the join command `homefleet machines rotate-token m8` prints" in said, said
        assert grant.json()["broker"]["redis_url"] == local.settings.redis_url
        # joined with --print-systemd-unit, its stdout is the unit alone (`... > m8.service`)
        again = JOIN_COMMAND.search(run_cli("machines", "rotate-token", "m8", env=operator).stdout)
        assert again is not None
        unit = join_from_stdin(server_url, again.group(2), tmp_path / "m8-unit" / "models", env, "--print-systemd-unit")
        assert unit.returncode == 0, unit.stdout + unit.stderr
        assert unit.stdout.startswith("# homefleet-worker-m8.service: printed by"), unit.stdout[:500]
        assert "this host:" not in unit.stdout and "\n[Unit]\n" in unit.stdout, unit.stdout[:500]
        assert "joined as machine m8" in " ".join(unit.stderr.split()), unit.stderr
        unknown = _join_post(server_url, "hfj_" + "x" * 43)
        assert unknown.status_code == 401 and unknown.json()["error"]["reason"] == "join_token_unknown"
        # a host whose device is not the registered one: 409, the join token left unspent
        cuda = JOIN_COMMAND.search(run_cli("machines", "add", "m7", "--backend", "cuda", env=operator).stdout)
        assert cuda is not None
        wrong_host = tmp_path / "m7-host"
        refused_join = join_from_stdin(server_url, cuda.group(2), wrong_host / "models", env)
        assert refused_join.returncode == 2, refused_join.stdout + refused_join.stderr
        assert "device_mismatch" in refused_join.stderr and "registered as cuda" in refused_join.stderr
        assert not (wrong_host / "worker-token").exists()
        mismatch = _join_post(server_url, cuda.group(2), backend="cpu")  # still 409: the token was not spent
        assert mismatch.status_code == 409 and mismatch.json()["error"]["reason"] == "device_mismatch"
        assert "registered as cuda" in mismatch.json()["error"]["message"]

        # removing m1, which has a job queued, is refused: by the CLI, and by the server for a hand edit
        refused = run_cli("machines", "remove", "m1", "--no-wait", env=operator, check=False)
        assert refused.returncode == 1 and "1 jobs queued or running" in refused.stdout, refused.stdout
        assert 'name = "m1"' in join_fleet.fleet_file.read_text()
        before = join_fleet.fleet_file.read_text()
        by_hand = live.edit(
            before, lambda entries: entries.__delitem__(next(i for i, e in enumerate(entries) if e.get("name") == "m1"))
        )
        join_fleet.fleet_file.write_text(by_hand)
        report = wait_report(local, live.text_digest(by_hand))
        assert report["state"] == "refused" and "machine 'm1' is removed but has 1 jobs queued" in report["reason"]
        assert "m1" in {row["name"] for row in client.machines()}  # the old configuration kept
        join_fleet.fleet_file.write_text(before)
        assert wait_report(local, live.text_digest(before))["state"] == "loaded"

        # the new machine takes pinned and Auto jobs (m1 is drained by the refused remove, server offline)
        pinned = client.wait(client.submit(MODEL, "txt2img", PARAMS, target="m9")["id"], timeout_s=240)
        auto = client.wait(
            client.submit(MODEL, "txt2img", {**PARAMS, "prompt": "auto"}, target=AUTO)["id"], timeout_s=240
        )
        assert (pinned["state"], pinned["machine"]) == ("succeeded", "m9")
        assert (auto["state"], auto["machine"]) == ("succeeded", "m9")

        # the stream opened before the machine was added is still open, and ends when its job does
        assert stream.is_alive() and not errors
        forced = run_cli("machines", "remove", "m1", "--force", env=operator)  # ends its job, then removes it
        assert "machine m1 removed" in forced.stdout, forced.stdout
        assert client.get(stuck["id"])["reason"] == "machine_removed"
        stream.join(timeout=30)
        assert not stream.is_alive() and not errors, errors
        assert seen[0][0] == "state" and seen[0][1]["state"] == "queued"
        assert seen[-1][0] == "end" and seen[-1][1]["state"] == "cancelled"

        # removing m9 drains it first: its job runs to its end, then it is gone from the running server
        last = client.submit(MODEL, "txt2img", {**PARAMS, "prompt": "the last one"}, target="m9")
        removed = run_cli("machines", "remove", "m9", env=operator)
        assert "machine m9 removed" in removed.stdout, removed.stdout
        assert client.get(last["id"])["state"] == "succeeded"
        assert {row["name"] for row in client.machines()} == {"server", "m7", "m8"}
        m9_token = (host / "worker-token").read_text().strip()
        gone = httpx.get(
            f"{server_url}/internal/v1/manifest", headers={"Authorization": f"Bearer {m9_token}"}, verify=tls_context()
        )
        assert gone.status_code == 401
        assert local.processes["api"].pid == api_pid and local.processes["api"].poll() is None  # never restarted
    finally:
        stop_process_group(joined)
        log_file.close()


def live_env(path: Path) -> dict[str, str]:
    return dict(line.split("=", 1) for line in path.read_text().splitlines() if line and not line.startswith("#"))


def wait_report(local: LocalFleet, digest: str, timeout_s: float = 30.0) -> dict:
    """The running server's report on the fleet file of ``digest``."""
    client = redis.Redis.from_url(local.settings.redis_url)
    keys = Keys(local.settings.key_prefix)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        report = live.loaded_report(client, keys)
        if report and report["digest"] == digest:
            return report
        time.sleep(0.1)
    raise TimeoutError(f"the server did not report on the fleet file {digest} within {timeout_s} s")
