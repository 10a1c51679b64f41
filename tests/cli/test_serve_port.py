"""A ``homefleet serve`` whose API port is taken is refused before it touches its journal or
Redis (app/cli/listening.py): exit 2, ``port_in_use`` naming the address, and no data folder
made (no lock, no journal); so is one without API keys."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

from app.core.config import Settings
from app.core.secret_files import write_private
from tests.helpers import make_fleet, run_cli, settings_env


def test_a_serve_whose_port_is_taken_is_refused_before_its_journal(settings: Settings, tmp_path: Path) -> None:
    fleet_file = write_private(tmp_path / "fleet.toml", make_fleet().to_toml())
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        mine = settings.model_copy(update={"fleet_file": fleet_file, "data_dir": tmp_path / "fresh", "api_port": port})
        refused = run_cli(
            "serve",
            env={
                **settings_env(mine),
                "HOMEFLEET_API_KEYS": json.dumps(mine.api_keys),
                "HOMEFLEET_API_HOST": "127.0.0.1",
                "HOMEFLEET_API_PORT": str(port),
            },
            check=False,
            timeout_s=60,
        )
    line = " ".join(refused.stderr.split())
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert f"error (port_in_use): the API address 127.0.0.1:{port} is in use" in line, line
    assert not (tmp_path / "fresh").exists()  # refused before the data folder (its lock, the journal) was made


def test_a_demo_whose_api_port_is_taken_is_refused_before_anything_starts(tmp_path: Path) -> None:
    """``homefleet demo`` listens on HOMEFLEET_API_PORT when that is set (a free port when not);
    a taken one stops it first: exit 2 naming the port, no Redis started, nothing built."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env: dict[str, str | None] = {k: None for k in os.environ if k.startswith("HOMEFLEET_")}  # unset
        env["HOMEFLEET_API_PORT"] = str(port)
        refused = run_cli("demo", "--data-dir", str(tmp_path / "demo"), env=env, check=False, timeout_s=60)
    line = " ".join(refused.stderr.split())
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert f"error (port_in_use): the API address 127.0.0.1:{port} is in use" in line, line
    assert not (tmp_path / "demo").exists()  # no embedded Redis, no tiny models


def test_a_serve_without_api_keys_is_refused_before_it_makes_anything(settings: Settings, tmp_path: Path) -> None:
    """No API key and no HOMEFLEET_ALLOW_OPEN_API: exit 2 ``no_api_keys`` before the data folder,
    its lock, the journal or Redis's pairing are made. It used to pair the Redis with a stray
    journal first, so the right ``serve`` afterwards was refused ``journal_mismatch``."""
    import redis

    from app.core.keys import Keys

    fleet_file = write_private(tmp_path / "fleet.toml", make_fleet().to_toml())
    fresh = tmp_path / "fresh"
    mine = settings.model_copy(update={"fleet_file": fleet_file, "data_dir": fresh})
    refused = run_cli(
        "serve",
        env={**settings_env(mine), "HOMEFLEET_API_KEYS": "[]", "HOMEFLEET_ALLOW_OPEN_API": "false"},
        check=False,
        timeout_s=60,
    )
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert "error (no_api_keys)" in " ".join(refused.stderr.split()), refused.stderr
    assert not fresh.exists()  # no folder, no lock, no journal
    client = redis.Redis.from_url(settings.redis_url)
    assert not client.exists(Keys(settings.key_prefix).journal())  # Redis left unpaired
    client.close()
