"""compose.yaml only runs commands that exist: every `homefleet` subcommand and
option it names is one the CLI has, and Redis runs with AOF on and noeviction."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer
import yaml

from app.cli.main import cli

COMPOSE = Path(__file__).resolve().parents[2] / "compose.yaml"


def homefleet_command(path: list[str]) -> Any:
    command: Any = typer.main.get_command(cli)
    for name in path:
        assert hasattr(command, "commands"), f"{' '.join(path)}: {command.name} has no subcommands"
        assert name in command.commands, f"homefleet has no command {' '.join(path)!r}"
        command = command.commands[name]
    return command


def test_every_compose_service_runs_an_existing_command() -> None:
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    assert {"redis", "api", "server-worker", "flower", "cuda-worker"} <= set(services)
    for name, service in services.items():
        argv = service["command"]
        if argv[0] == "redis-server":
            assert argv[argv.index("--appendonly") + 1] == "yes"
            assert argv[argv.index("--maxmemory-policy") + 1] == "noeviction"
            assert "REDIS_PASSWORD" in argv[argv.index("--requirepass") + 1]  # never open
            continue
        assert argv[0] == "homefleet", f"service {name} runs {argv[0]!r}, not a homefleet command"
        words = [a for a in argv[1:] if not a.startswith("-")]
        command = homefleet_command(words[:1] if words[0] != "models" else words[:2])
        options = {opt for param in command.params for opt in getattr(param, "opts", [])}
        for arg in argv[1:]:
            if arg.startswith("--"):
                assert arg.split("=")[0] in options, f"service {name}: `{command.name}` has no option {arg}"
    assert services["cuda-worker"]["profiles"] == ["cuda"]


def test_every_service_is_restarted_and_uses_redis_with_its_password() -> None:
    """A worker (or the API, or Redis) that dies is restarted by Docker; every
    server-side service's Redis URL carries the password Redis requires."""
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    for name, service in services.items():
        assert service.get("restart") == "unless-stopped", name
        url = service.get("environment", {}).get("HOMEFLEET_REDIS_URL")
        if url is not None:
            assert url.startswith("redis://:${REDIS_PASSWORD"), (name, url)


def test_compose_builds_an_image_that_exists_and_runs_remote_workers_against_the_servers_address() -> None:
    """Every service's image is built from the repository's Dockerfile, which pins torch and
    installs it first; the CUDA worker gets the GPU and takes the server's Redis and API from
    its env file (it runs on another host: no redis://redis, no depends_on); Flower asks for a
    login; no service pretends a Linux container has MPS."""
    compose = yaml.safe_load(COMPOSE.read_text())
    services = compose["services"]
    dockerfile = (COMPOSE.parent / "Dockerfile").read_text()
    assert "torch==2.13.0" in dockerfile
    assert dockerfile.index("torch==2.13.0") < dockerfile.index("pip install .")
    for name, service in services.items():
        if name != "redis":
            assert service["build"] == "." and service["image"].startswith("homefleet:"), name
    cuda = services["cuda-worker"]
    assert cuda["gpus"] == "all"
    assert "environment" not in cuda and "depends_on" not in cuda
    assert not any(arg.startswith("--server-url") for arg in cuda["command"])
    flower = services["flower"]  # its password in its environment, not its command line
    assert "FLOWER_BASIC_AUTH" in flower["environment"] and not any("basic" in arg for arg in flower["command"])
    assert not any("mac" in name for name in services)
