"""One ``homefleet serve`` per data folder (app/cli/serve_lock.py): a second one on the same
folder exits 2 at once, naming the folder and the running server's pid, and leaves the running
one serving; a server on another folder starts; the lock is the kernel's, so it goes with a
SIGKILLed server and the next one starts. Standby servers (leader election) share a folder."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import httpx
import pytest

from app.cli.serve_lock import holding_data_dir
from app.core.config import Settings
from app.core.errors import ConfigError
from app.core.secret_files import write_private
from app.core.tls import tls_context
from app.devtools.localfleet import LocalFleet
from app.devtools.procs import stop_process_group
from app.devtools.redis_server import free_port
from tests.helpers import make_fleet, run_cli, settings_env


def test_a_second_serve_on_one_data_folder_is_refused_until_the_first_is_killed(
    settings: Settings, tmp_path: Path
) -> None:
    fleet = make_fleet()
    fleet_file = write_private(tmp_path / "fleet.toml", fleet.to_toml())
    first = settings.model_copy(update={"fleet_file": fleet_file, "api_port": free_port()})
    # another folder, journal and key prefix on the same Redis: not paired with the first's journal
    other = first.model_copy(update={"data_dir": tmp_path / "other", "api_port": free_port(), "key_prefix": "hf2"})
    serving, elsewhere = (
        LocalFleet(first, fleet, fleet_file, forkserver=True),
        LocalFleet(other, fleet, fleet_file, forkserver=True),
    )
    try:
        serving.start_api()
        holder = serving.processes["api"]

        refused = run_cli(
            "serve",
            env={
                **settings_env(first),
                "HOMEFLEET_API_KEYS": json.dumps(first.api_keys),
                "HOMEFLEET_API_PORT": str(free_port()),
            },
            check=False,
            timeout_s=120,
        )
        line = " ".join(refused.stderr.split())
        assert refused.returncode == 2, refused.stdout + refused.stderr
        assert "Traceback" not in refused.stdout + refused.stderr
        assert (
            f"error (data_dir_in_use): the data folder {first.data_dir} is in use: another `homefleet serve` "
            f"(pid {holder.pid}) is running on it"
        ) in line, line
        # the first still serves, and still holds its folder
        assert holder.poll() is None
        health = httpx.get(f"{serving.api_url}/health", timeout=10, verify=tls_context())
        assert health.status_code in (200, 503), health.text  # 503: no worker online (R24)
        with pytest.raises(ConfigError, match=f"pid {holder.pid}"), holding_data_dir(first.data_dir):
            pass

        elsewhere.start_api()  # another data folder: not refused (it answers /health)

        stop_process_group(serving.processes.pop("api"), signal.SIGKILL)
        assert holder.returncode == -signal.SIGKILL
        with holding_data_dir(first.data_dir):  # the kernel released the dead server's lock
            pass
        serving.start_api()  # and the next server on the folder starts
        assert serving.processes["api"].pid != holder.pid
    finally:
        serving.stop()
        elsewhere.stop()


def test_standby_servers_share_a_data_folder_but_not_with_a_server_without_leader_election(tmp_path: Path) -> None:
    """``HOMEFLEET_LEADER_ELECTION`` servers hold the lock shared (docs/operations.md, "A standby
    server"): two of them start on one folder; a server without it is refused beside them, told
    to set it to join them, and a standby beside a server without it, each naming the holders' pids."""
    with holding_data_dir(tmp_path, shared=True), holding_data_dir(tmp_path, shared=True) as path:
        assert path == tmp_path / ".serve.lock"
        with pytest.raises(ConfigError) as refused, holding_data_dir(tmp_path):
            pass
    assert refused.value.reason == "data_dir_in_use"
    said = str(refused.value)  # the likely slip: this server lacks the setting the standbys share
    assert f"the data folder {tmp_path} is in use by standby servers (pid {os.getpid()}, " in said, said
    assert "set HOMEFLEET_LEADER_ELECTION=true to join them as a standby" in said, said

    with holding_data_dir(tmp_path):
        assert path.read_text() == f"{os.getpid()}\n"  # the exclusive holder dropped the standbys' pids
        with (
            pytest.raises(ConfigError, match="without HOMEFLEET_LEADER_ELECTION") as refused,
            holding_data_dir(tmp_path, shared=True),
        ):
            pass
    assert f"(pid {os.getpid()})" in str(refused.value)
