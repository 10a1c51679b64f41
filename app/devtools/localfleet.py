"""Several machines on this one host: the API and one worker process per machine, each
with its own model folder and token. Used by ``homefleet demo`` and the end-to-end tests.
A host entry with several devices is one machine per device (``box:0``,
``box:1``): one worker each, started with ``CUDA_VISIBLE_DEVICES`` set to its device's index
(:meth:`LocalFleet.start_host` starts them all).

Every process is started in its own session and stopped with its whole process group. With
``forkserver=True`` the API and the workers are forked from one preloaded interpreter
(:mod:`app.devtools.forkserver`: each start skips ~3 CPU-seconds of imports) instead of exec'd,
except a command wrapped in a ``prefix`` (``prlimit``, ``ip netns exec``), which is exec'd.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from app.core.config import BrokerSettings, Settings
from app.core.secret_files import write_private
from app.core.tls import tls_context
from app.devtools import forkserver as forkserver_module
from app.devtools.procs import ChildProcess, stop_process_group
from app.fleet.config import Fleet
from routing.placement import SERVER


class LocalFleet:
    """Start and stop the API and the workers of ``fleet`` on this host.

    Machine ``server`` uses the server's model folder; every other machine ``<name>`` uses
    ``<data_dir>/machines/<name>/models``. Logs go to ``<data_dir>/logs/<process>.log``.
    """

    def __init__(self, settings: Settings, fleet: Fleet, fleet_file: Path, forkserver: bool = False) -> None:
        self.settings = settings
        self.fleet = fleet
        self.fleet_file = fleet_file
        self.forkserver = forkserver
        self.processes: dict[str, ChildProcess] = {}
        self.logs_dir = settings.data_dir / "logs"

    @property
    def auth_headers(self) -> dict[str, str]:
        """The first configured API key as a bearer header (none when the API is open)."""
        keys = self.settings.api_keys
        return {"Authorization": f"Bearer {keys[0]}"} if keys else {}

    @property
    def api_url(self) -> str:
        return f"http://{self.settings.api_host}:{self.settings.api_port}"

    def models_dir(self, machine: str) -> Path:
        if machine == SERVER:
            return self.settings.models_dir
        return self.settings.data_dir / "machines" / machine / "models"

    def machine_dir(self, machine: str) -> Path:
        """Everything a non-server machine owns on this host (its model folder lives inside)."""
        return self.settings.data_dir / "machines" / machine

    def _env(self, settings: BrokerSettings, extra: dict[str, str]) -> dict[str, str]:
        """The environment that gives a child process exactly ``settings`` (every field)."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("HOMEFLEET_")}
        for name, value in settings.model_dump(mode="json").items():
            if value is not None and name in type(settings).model_fields:
                # pydantic-settings reads lists and dicts from the environment as JSON
                env[f"HOMEFLEET_{name.upper()}"] = json.dumps(value) if isinstance(value, list | dict) else str(value)
        env["PYTHONUNBUFFERED"] = "1"
        env.update(extra)
        return env

    def _spawn(
        self,
        name: str,
        args: list[str],
        env: dict[str, str],
        prefix: list[str] | None = None,
        netns: str | None = None,
    ) -> ChildProcess:
        if name in self.processes and self.processes[name].poll() is None:
            raise RuntimeError(f"{name} is already running (pid {self.processes[name].pid})")
        self.logs_dir.mkdir(parents=True, exist_ok=True)
        if self.forkserver and not prefix:
            forked = forkserver_module.start(args, env, self.logs_dir / f"{name}.log", netns=netns)
            self.processes[name] = forked
            return forked
        if netns is not None:
            prefix = ["ip", "netns", "exec", netns, *(prefix or [])]
        with open(self.logs_dir / f"{name}.log", "ab") as log:
            process = subprocess.Popen(
                [*(prefix or []), sys.executable, "-m", "app.cli", *args],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        self.processes[name] = process
        return process

    def start_api(
        self,
        timeout_s: float = 60.0,
        extra_env: dict[str, str] | None = None,
        prefix: list[str] | None = None,
        name: str = "api",
        port: int | None = None,
    ) -> None:
        """Start ``homefleet serve`` and wait until ``/health`` answers (503 until a worker is online, R24).
        ``prefix`` wraps the command (e.g. ``["prlimit", "--fsize=600000"]``: a full disk). ``name``
        and ``port``: a second server's process name (its log ``<name>.log``) and API port (a
        standby server, docs/operations.md "A standby server"; default: the settings' port)."""
        port = port or self.settings.api_port
        env = self._env(
            self.settings,
            {"HOMEFLEET_FLEET_FILE": str(self.fleet_file), "HOMEFLEET_API_PORT": str(port), **(extra_env or {})},
        )
        process = self._spawn(name, ["serve"], env, prefix)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"the API exited with {process.returncode}; see {self.logs_dir / f'{name}.log'}")
            try:
                if httpx.get(
                    f"http://{self.settings.api_host}:{port}/health", timeout=1, verify=tls_context()
                ).status_code in (200, 503):
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"the API did not answer within {timeout_s} s; see {self.logs_dir / f'{name}.log'}")

    def start_worker(
        self,
        machine: str,
        extra_env: dict[str, str] | None = None,
        prefix: list[str] | None = None,
        token_file: bool = False,
        netns: str | None = None,
    ) -> ChildProcess:
        """Start ``homefleet worker --machine <machine>`` with that machine's folder and token.

        ``extra_env`` overrides settings (e.g. the Redis and server URLs a remote host uses);
        ``prefix`` wraps the command (e.g. ``["prlimit", "--as=BYTES", "--"]``; it is exec'd, never
        forked); ``netns``: the named network namespace it runs in (forked into it, or exec'd by
        ``ip netns exec``); ``token_file``: the token is read from a file readable by its owner
        only (``--token-file``), not the environment."""
        broker = BrokerSettings.model_validate(self.settings.model_dump(include=set(BrokerSettings.model_fields)))
        token = self.fleet.machines[machine].token or ""
        self.models_dir(machine).mkdir(parents=True, exist_ok=True)  # a worker refuses a folder that is not there
        args = ["worker"]
        if token_file:
            path = write_private(self.machine_dir(machine) / "worker-token", token + "\n")
            args += ["--token-file", str(path)]
            token = ""
        device = self.fleet.machines[machine].device
        bound = {} if device is None else {"CUDA_VISIBLE_DEVICES": str(device)}  # as the worker binds itself
        env = self._env(
            broker,
            {
                **bound,
                "HOMEFLEET_TORCH_THREADS": str(self.torch_threads()),
                "HOMEFLEET_MACHINE": machine,
                "HOMEFLEET_MODELS_DIR": str(self.models_dir(machine)),
                "HOMEFLEET_WORKER_TOKEN": token,
                "HOMEFLEET_SERVER_URL": self.api_url,
                **(extra_env or {}),
            },
        )
        return self._spawn(f"worker-{machine}", args, env, prefix, netns)

    def start_host(
        self, host: str, extra_env: dict[str, str] | None = None, token_file: bool = False
    ) -> dict[str, ChildProcess]:
        """Start the worker of every machine of ``host`` (its devices, or the one machine):
        machine name -> process. ``extra_env``, ``token_file``: as :meth:`start_worker`'s.

        Raises:
            KeyError: no machine of the fleet runs on ``host``.
        """
        return {
            machine.name: self.start_worker(machine.name, extra_env, token_file=token_file)
            for machine in self.fleet.hosts()[host]
        }

    def torch_threads(self) -> int:
        """Each worker's torch threads: ``HOMEFLEET_TORCH_THREADS`` of this process when set (the
        workers' setting, ``WorkerSettings.torch_threads``), else its share of this host's cores
        (one worker per machine of the fleet runs here, so that together they do not
        oversubscribe the cores; at least 1 thread)."""
        if os.environ.get("HOMEFLEET_TORCH_THREADS", "").isdigit():
            return max(1, int(os.environ["HOMEFLEET_TORCH_THREADS"]))
        return max(1, (os.cpu_count() or 1) // max(1, len(self.fleet.machines)))

    def wait_online(self, machines: list[str], model_id: str | None = None, timeout_s: float = 90.0) -> None:
        """Wait until every machine in ``machines`` is online (and has verified ``model_id``)."""
        deadline = time.monotonic() + timeout_s
        while True:
            rows = {
                m["name"]: m
                for m in httpx.get(
                    f"{self.api_url}/v1/machines", headers=self.auth_headers, timeout=5, verify=tls_context()
                ).json()
            }
            missing = [
                name
                for name in machines
                if not rows[name]["online"] or (model_id is not None and model_id not in rows[name]["verified_models"])
            ]
            if not missing:
                return
            for name in missing:
                process = self.processes.get(f"worker-{name}")
                if process is not None and process.poll() is not None:
                    raise RuntimeError(
                        f"worker {name} exited with {process.returncode}; see {self.logs_dir}/worker-{name}.log"
                    )
            if time.monotonic() > deadline:
                raise TimeoutError(f"machines not online (or model not verified) after {timeout_s} s: {missing}")
            time.sleep(0.2)

    def stop_worker(self, machine: str, sig: int = signal.SIGTERM) -> None:
        process = self.processes.pop(f"worker-{machine}", None)
        if process is not None:
            stop_process_group(process, sig)

    def copy_model(self, model_id: str, machine: str) -> Path:
        """Copy a registered model's folder into a machine's model folder, as a sync would."""
        target = self.models_dir(machine) / model_id
        if machine != SERVER:
            shutil.copytree(self.settings.models_dir / model_id, target, dirs_exist_ok=True)
        return target

    def stop(self) -> None:
        """Stop every process this fleet started: workers first, then the API."""
        for name in sorted(self.processes, key=lambda n: n == "api"):
            stop_process_group(self.processes[name])
        self.processes.clear()
