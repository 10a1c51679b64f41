"""Join commands that ``homefleet machines add`` and ``rotate-token`` printed, run as an operator
runs them (docs/operations.md, "Add a machine"): a join token hands over only the machine's token
it was issued for. One printed before ``rotate-token`` (the reason for a rotation is often that
the old one leaked), or before the machine was removed and a machine of that name added again,
is refused ``join_token_superseded``, and the newest one joins. The real ASGI app (its lifespan:
the fleet-file watch) on a real Redis and journal, ``homefleet machines`` as subprocesses."""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from app.api.server import create_app
from app.context import build_context
from app.core.config import Settings
from app.core.secret_files import write_private
from app.fleet import live
from tests.helpers import make_fleet, run_cli, settings_env

JOIN_COMMAND = re.compile(r"^homefleet worker join (\S+) (hfj_\S+)", re.MULTILINE)


@pytest.fixture
def served(settings: Settings) -> Iterator[tuple[TestClient, dict[str, str | None], Settings]]:
    """A running server of a fleet file (``server`` only), and the operator's environment."""
    fleet_file = settings.data_dir / "fleet.toml"
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    write_private(fleet_file, make_fleet().to_toml())
    running = settings.model_copy(update={"fleet_file": fleet_file, "fleet_watch_s": 0.2})
    ctx = build_context(running, make_fleet(), migrate=True)
    try:
        with TestClient(create_app(running, ctx)) as client:
            yield client, {**settings_env(running), "HOMEFLEET_API_PORT": "18799"}, running
    finally:
        ctx.close()


def join_token(printed: str) -> str:
    match = JOIN_COMMAND.search(printed)
    assert match is not None, printed
    return match.group(2)


def join(client: TestClient, token: str) -> tuple[int, dict]:
    answer = client.post(
        "/internal/v1/join",
        json={"backend": "cpu", "memory_bytes": 8_000_000_000},
        headers={"Authorization": f"Bearer {token}"},
    )
    return answer.status_code, answer.json()


def test_a_join_command_printed_before_rotate_token_or_before_remove_and_add_hands_nothing_over(
    served: tuple[TestClient, dict[str, str | None], Settings],
) -> None:
    client, env, settings = served
    add = ("machines", "add", "box2", "--memory", "2", "--families", "sd1")
    first = join_token(run_cli(*add, env=env).stdout)
    rotation = run_cli("machines", "rotate-token", "box2", env=env).stdout
    rotated = join_token(rotation)
    # pasted elsewhere than the folder the host joined in, the join would start on an empty models folder
    assert "run this in the folder it joined in, or add --models-dir" in " ".join(rotation.split()), rotation
    removed = run_cli("machines", "remove", "box2", "--no-wait", env=env)
    assert "machine box2 removed" in removed.stdout, removed.stdout
    status, body = join(client, first)  # a removed machine's: no "retry" that could never succeed alone
    assert status == 409 and body["error"]["reason"] == "machine_not_loaded", body
    assert "removed since this join token was issued (`homefleet machines add box2`" in body["error"]["message"], body
    newest = join_token(run_cli(*add, env=env).stdout)  # box2 again: another host, say
    assert settings.fleet_file is not None
    box2_token = live.parse(settings.fleet_file.read_text(), "fleet").machines["box2"].token

    for old in (first, rotated):
        status, body = join(client, old)
        assert status == 401, body
        assert body["error"]["reason"] == "join_token_superseded", body
        assert box2_token not in str(body)
        assert "`homefleet machines rotate-token box2` prints a new one" in body["error"]["message"], body
    status, body = join(client, newest)
    assert status == 200 and body["machine"] == "box2" and body["token"] == box2_token, body


def test_rotate_token_of_a_host_with_devices_prints_one_join_per_device_and_each_joins_its_device(
    served: tuple[TestClient, dict[str, str | None], Settings],
) -> None:
    client, env, settings = served
    assert settings.fleet_file is not None
    # the host's entry, as docs/operations.md "Several devices on one host" writes it
    text = settings.fleet_file.read_text() + (
        '\n[[machines]]\nname = "duo"\ndevices = 2\nbackend = "cpu"\nmemory_kind = "unified"\n'
        f'memory_bytes = 2_000_000_000\nfamilies = ["sd1"]\ntoken = "{"duo-token-".ljust(32, "x")}"\n'
    )
    live.write_atomically(settings.fleet_file, text)
    rotated = run_cli("machines", "rotate-token", "duo", env=env)
    commands = [line for line in rotated.stdout.splitlines() if line.startswith("homefleet worker join ")]
    assert len(commands) == 2, rotated.stdout
    host_token = live.parse(settings.fleet_file.read_text(), "fleet").machines["duo:0"].token
    folders = set()
    for index, command in enumerate(commands):
        words = command.split()
        assert words[-2] == "--models-dir", command  # each device its own worker folder (token file, worker.env)
        folders.add(words[-1])
        status, body = join(client, join_token(command))
        assert status == 200, body
        assert body["machine"] == f"duo:{index}" and body["token"] == host_token, body
    assert len(folders) == 2, commands
