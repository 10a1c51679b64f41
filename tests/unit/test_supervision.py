"""The supervisor files (app/cli/supervision.py): a systemd unit that parses as INI and a launchd
plist that plistlib reads, each restarting the worker's command when it exits other than
successfully, naming the token's file and never the token."""

from __future__ import annotations

import configparser
import plistlib
import shlex
from pathlib import Path

from app.cli.supervision import (
    RESTART_PAUSE_S,
    STOP_TIMEOUT_S,
    launchd_label,
    launchd_plist,
    systemd_unit,
    worker_argv,
)

ARGV = worker_argv("/srv/home fleet/.venv/bin/python", "box:1", Path("/srv/models 1"), Path("/etc/homefleet/box1"))
ENV = {"HOMEFLEET_SERVER_URL": "http://srv:8787", "HOMEFLEET_REDIS_URL": "redis://:p%40ss@srv:6379/0"}


def parse_unit(text: str) -> configparser.ConfigParser:
    parser = configparser.ConfigParser(interpolation=None, strict=True, comment_prefixes=("#",))
    parser.optionxform = str  # type: ignore[assignment,method-assign]  # systemd's keys are case-sensitive
    parser.read_string(text)
    return parser


def test_the_unit_restarts_the_worker_on_failure_and_lets_a_stop_finish_the_running_job() -> None:
    unit = parse_unit(systemd_unit(ARGV, ENV, "box:1", Path("/srv/homefleet")))
    assert unit.sections() == ["Unit", "Service", "Install"]
    service = unit["Service"]
    assert service["Restart"] == "on-failure"
    assert service["RestartSec"] == str(RESTART_PAUSE_S) == "2"
    assert service["KillMode"] == "mixed" and service["TimeoutStopSec"] == str(STOP_TIMEOUT_S)
    assert "User" not in service  # commented: the operator picks the user
    assert unit["Unit"]["StartLimitIntervalSec"] == "0"  # a worker exiting 78 until its old lease expires
    assert unit["Install"]["WantedBy"] == "multi-user.target"
    # systemd's quoting: words with spaces quoted, % (specifiers) doubled; shlex reads it back as argv
    assert shlex.split(service["ExecStart"].replace("%%", "%")) == ARGV
    assert ARGV[:4] == ["/srv/home fleet/.venv/bin/python", "-m", "app.cli", "worker"]
    assert ARGV[ARGV.index("--token-file") + 1] == "/etc/homefleet/box1"
    environment = dict(word.split("=", 1) for word in shlex.split(service["Environment"].replace("%%", "%")))
    assert environment == ENV
    assert service["WorkingDirectory"] == "/srv/homefleet"


def test_the_plist_keeps_the_worker_alive_unless_it_exits_successfully() -> None:
    text = launchd_plist(ARGV, ENV, "box:1", Path("/Users/me/homefleet"), Path("/Users/me/Library/Logs/w.log"))
    plist = plistlib.loads(text.encode())
    assert plist["Label"] == launchd_label("box:1") == "org.homefleet.worker.box-1"
    assert plist["ProgramArguments"] == ARGV
    assert plist["EnvironmentVariables"] == ENV
    assert plist["RunAtLoad"] is True
    assert plist["KeepAlive"] == {"SuccessfulExit": False}
    assert plist["ThrottleInterval"] == RESTART_PAUSE_S
    assert plist["ExitTimeOut"] == STOP_TIMEOUT_S
    assert plist["StandardOutPath"] == plist["StandardErrorPath"] == "/Users/me/Library/Logs/w.log"
    assert plist["WorkingDirectory"] == "/Users/me/homefleet"
