"""The supervisor files that restart a worker which exits (killed, out of memory, a crash):
a systemd unit (Linux) and a launchd property list (a Mac), printed by ``homefleet worker
--print-systemd-unit`` / ``--print-launchd-plist`` for that worker's own settings.

Pure text rendering (no I/O). The files name the token FILE, never the token; the worker runs as
``<python> -m app.cli worker ...`` with the interpreter that printed them, so a virtual
environment needs no activation. docs/operations.md, "A supervisor for every worker".
"""

from __future__ import annotations

import plistlib
from collections.abc import Mapping, Sequence
from pathlib import Path

#: seconds a supervisor waits before starting an exited worker again; a worker refused its
#: machine's lease (another one holds it until HOMEFLEET_HEARTBEAT_TTL_S) exits 78 and is
#: started again after this pause
RESTART_PAUSE_S = 2
#: seconds a stop (SIGTERM: Celery's warm shutdown) waits for the running job to finish and be
#: acknowledged before the supervisor kills what is left
STOP_TIMEOUT_S = 60


def worker_argv(executable: str, machine: str, models_dir: Path, token_file: Path) -> list[str]:
    """The command a supervisor runs: ``executable -m app.cli worker --machine ... --models-dir ...
    --token-file ...`` (absolute paths expected; the server's and Redis' URLs go in the
    environment)."""
    return [
        executable,
        "-m",
        "app.cli",
        "worker",
        "--machine",
        machine,
        "--models-dir",
        str(models_dir),
        "--token-file",
        str(token_file),
    ]


def unit_name(machine: str) -> str:
    """The systemd unit's file name of ``machine``, e.g. ``homefleet-worker-box:1.service``."""
    return f"homefleet-worker-{machine}.service"


def launchd_label(machine: str) -> str:
    """The launchd job label of ``machine`` (``:`` of a device's name becomes ``-``)."""
    return f"org.homefleet.worker.{machine.replace(':', '-')}"


def _systemd_word(word: str) -> str:
    """One word of an ``ExecStart=``/``Environment=`` line: ``%`` (specifiers) and ``$``
    (variables) escaped, double-quoted when it holds white space, quotes or backslashes."""
    word = word.replace("%", "%%")
    if any(c.isspace() or c in "\"'\\;" for c in word) or not word:
        word = '"' + word.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return word


def systemd_unit(argv: Sequence[str], environment: Mapping[str, str], machine: str, working_dir: Path) -> str:
    """The text of a systemd service running ``argv`` with ``environment``: restarted on failure
    (any non-zero exit or a signal, ``kill -9`` included) after ``RESTART_PAUSE_S`` seconds,
    never given up on (no start limit); a stop sends SIGTERM to the worker only (Celery's warm
    shutdown finishes and acknowledges the running job) and kills the rest after
    ``STOP_TIMEOUT_S`` seconds."""
    command = " ".join(_systemd_word(word).replace("$", "$$") for word in argv)
    env = " ".join(_systemd_word(f"{key}={value}") for key, value in environment.items())
    name = unit_name(machine)
    lines = [
        f"# {name}: printed by `homefleet worker --print-systemd-unit` (docs/operations.md,",
        '# "A supervisor for every worker"). Install it:',
        f"#   sudo tee /etc/systemd/system/{name} < this-file && sudo systemctl daemon-reload",
        f"#   sudo systemctl enable --now {name}",
        "[Unit]",
        f"Description=Homefleet worker for machine {machine}",
        "After=network-online.target",
        "Wants=network-online.target",
        "# never stop restarting: a worker refused its lease exits 78 until the old lease expires",
        "StartLimitIntervalSec=0",
        "",
        "[Service]",
        "# User=homefleet   (a user that can read the models folder and the token file)",
        f"WorkingDirectory={_systemd_word(str(working_dir))}",
    ]
    if env:
        lines.append(f"Environment={env}")
    lines += [
        f"ExecStart={command}",
        "Restart=on-failure",
        f"RestartSec={RESTART_PAUSE_S}",
        "# SIGTERM to the worker (Celery's warm shutdown: the running job finishes and is acknowledged),",
        f"# SIGKILL to what is left after {STOP_TIMEOUT_S} s",
        "KillMode=mixed",
        f"TimeoutStopSec={STOP_TIMEOUT_S}",
        "",
        "[Install]",
        "WantedBy=multi-user.target",
        "",
    ]
    return "\n".join(lines)


def launchd_plist(
    argv: Sequence[str], environment: Mapping[str, str], machine: str, working_dir: Path, log_file: Path
) -> str:
    """The text of a launchd property list (``~/Library/LaunchAgents/<label>.plist``) running
    ``argv`` with ``environment``: started at load, started again whenever it exits other than
    successfully (``KeepAlive``/``SuccessfulExit`` false), at most every ``RESTART_PAUSE_S``
    seconds; a stop waits ``STOP_TIMEOUT_S`` seconds (``ExitTimeOut``) after SIGTERM. Its
    output goes to ``log_file``."""
    document = {
        "Label": launchd_label(machine),
        "ProgramArguments": list(argv),
        "EnvironmentVariables": dict(environment),
        "WorkingDirectory": str(working_dir),
        "RunAtLoad": True,
        "KeepAlive": {"SuccessfulExit": False},
        "ThrottleInterval": RESTART_PAUSE_S,
        "ExitTimeOut": STOP_TIMEOUT_S,
        "StandardOutPath": str(log_file),
        "StandardErrorPath": str(log_file),
    }
    return plistlib.dumps(document, sort_keys=False).decode()
