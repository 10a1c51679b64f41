"""Several hosts on one machine: each remote worker runs in its own network
namespace, joined to the root namespace by a veth pair, and reaches the server's Redis and
API only over the veth addresses this test assigns (docs/operations.md).

Names and addresses are this run's own, so that two runs on one machine (two checkouts, CI
beside a developer) never share a namespace or a route: namespaces are ``hf-<pid>-<machine>``,
veth pairs ``hv<pid><i>o``/``hv<pid><i>i``, and host ``i`` gets 10.<net>.<i>.2/30 with its
gateway (the server side) at 10.<net>.<i>.1, where ``<net>`` is a second octet no address on
this machine uses yet. Redis and the API bind to those server-side addresses explicitly, never
0.0.0.0. Everything is torn down at the end, also on failure; leftovers of runs whose process
is gone are removed first. Without permission to create namespaces (not root, no iproute2) the
tests skip and say why.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis

from app.client import HomefleetClient
from app.context import ServerContext, build_context
from app.core.config import Settings
from app.core.secret_files import write_private
from app.devtools.localfleet import LocalFleet
from app.devtools.redis_server import RedisProcess, free_port, redis_server_binary
from tests.helpers import TEST_API_KEY, make_fleet

MODEL = "tiny-sd"
HOSTS = {"hosta": 1, "hostb": 2}  # machine name -> subnet index
JOINER = ("hostc", 3)  # a host a test creates and joins to the running fleet (test_multihost.py)


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=10)


@dataclass
class Host:
    machine: str
    namespace: str
    address: str  # the host's own address, inside its namespace
    gateway: str  # the server-side address of its link
    veth_inside: str

    @property
    def netns(self) -> list[str]:
        return ["ip", "netns", "exec", self.namespace]

    def link(self, up: bool) -> None:
        ip("netns", "exec", self.namespace, "ip", "link", "set", self.veth_inside, "up" if up else "down")


RUN = os.getpid()  # names of this run's namespaces and links (veth names: 15 characters at most)


def free_second_octet() -> int:
    """A second octet ``n`` (20..219, starting from one this run's pid picks) such that no
    address on this machine is in 10.n.0.0/16 yet."""
    shown = subprocess.run(["ip", "-4", "addr"], check=False, capture_output=True, text=True, timeout=10).stdout
    used = {int(n) for n in re.findall(r"inet 10\.(\d+)\.", shown)}
    return next(n for n in ((RUN + k) % 200 + 20 for k in range(200)) if n not in used)


def make_host(machine: str, index: int, net: int) -> Host:
    namespace, outside, inside = f"hf-{RUN}-{machine}", f"hv{RUN}{index}o", f"hv{RUN}{index}i"
    gateway, address = f"10.{net}.{index}.1", f"10.{net}.{index}.2"
    ip("netns", "add", namespace)
    ip("link", "add", outside, "type", "veth", "peer", "name", inside)
    ip("link", "set", inside, "netns", namespace)
    ip("addr", "add", f"{gateway}/30", "dev", outside)
    ip("link", "set", outside, "up")
    ip("netns", "exec", namespace, "ip", "addr", "add", f"{address}/30", "dev", inside)
    ip("netns", "exec", namespace, "ip", "link", "set", inside, "up")
    ip("netns", "exec", namespace, "ip", "link", "set", "lo", "up")
    return Host(machine, namespace, address, gateway, inside)


@contextmanager
def routed_host(machine: str, index: int, net: int) -> Iterator[Host]:
    """A host created while the fleet runs (as :func:`make_host`), whose default route goes
    through its own link, so that it reaches every server-side address (the API's, Redis's) the
    way the fleet's hosts do; removed on exit, also on failure."""
    try:
        host = make_host(machine, index, net)
        ip("netns", "exec", host.namespace, "ip", "route", "add", "default", "via", host.gateway)
        yield host
    finally:
        remove_host(RUN, machine, index)


def remove_host(run: int, machine: str, index: int) -> None:
    for args in (("netns", "del", f"hf-{run}-{machine}"), ("link", "del", f"hv{run}{index}o")):
        subprocess.run(["ip", *args], check=False, capture_output=True, timeout=10)


def remove_leftovers() -> None:
    """Remove the namespaces of earlier runs whose pytest process no longer exists."""
    listed = subprocess.run(["ip", "netns", "list"], check=False, capture_output=True, text=True, timeout=10).stdout
    for run, machine in set(re.findall(r"^hf-(\d+)-(\w+)", listed, flags=re.MULTILINE)):
        known = {**HOSTS, JOINER[0]: JOINER[1]}
        if not Path(f"/proc/{run}").exists() and machine in known:
            remove_host(int(run), machine, known[machine])


@dataclass
class MultiHostFleet:
    local: LocalFleet
    ctx: ServerContext
    client: HomefleetClient
    hosts: dict[str, Host]
    redis_port: int
    net: int  # the second octet of this run's link addresses (make_host)


@pytest.fixture(scope="module")
def multihost(tmp_path_factory: pytest.TempPathFactory, tiny_models_dir: Path) -> Iterator[MultiHostFleet]:
    if shutil.which("ip") is None:
        pytest.skip("iproute2 (`ip`) is not installed: no network namespaces here")
    remove_leftovers()
    try:
        net = free_second_octet()
        hosts = {machine: make_host(machine, index, net) for machine, index in HOSTS.items()}
    except subprocess.CalledProcessError as error:
        for machine, index in HOSTS.items():
            remove_host(RUN, machine, index)
        pytest.skip(f"network namespaces are not permitted here: {error.stderr.strip()}")
    data_dir = tmp_path_factory.mktemp("multihost")
    redis_port, api_port = free_port(), free_port()
    server_address = hosts["hosta"].gateway  # the API binds here; other hosts route to it
    binds = ["127.0.0.1", *(h.gateway for h in hosts.values())]
    redis_process = subprocess.Popen(
        [
            redis_server_binary(),
            "--bind",
            *binds,
            "--port",
            str(redis_port),
            "--save",
            "",
            "--appendonly",
            "no",
            "--protected-mode",
            "no",
            "--dir",
            str(data_dir),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    redis_server = RedisProcess(f"redis://127.0.0.1:{redis_port}/0", redis_process)
    local: LocalFleet | None = None
    ctx: ServerContext | None = None
    try:
        for host in hosts.values():  # every other server-side address is reached through the gateway
            ip("netns", "exec", host.namespace, "ip", "route", "add", "default", "via", host.gateway)
        _wait_redis(redis_server.url)
        fleet = make_fleet(*HOSTS)
        fleet_file = data_dir / "fleet.toml"
        write_private(fleet_file, fleet.to_toml())
        settings = Settings(
            data_dir=data_dir,
            redis_url=redis_server.url,
            fleet_file=fleet_file,
            api_host=server_address,
            api_port=api_port,
            heartbeat_interval_s=0.5,
            heartbeat_ttl_s=8,
            reconcile_interval_s=1,
            lost_grace_s=3,
            api_keys=[TEST_API_KEY],
            # a joining host is handed the broker over a link, not 127.0.0.1 (docs/operations.md)
            worker_redis_url=f"redis://{server_address}:{redis_port}/0",
            fleet_watch_s=0.5,
        )
        local = LocalFleet(settings, fleet, fleet_file, forkserver=True)  # workers forked into their namespaces
        ctx = build_context(settings, fleet, migrate=True)
        ctx.registry.add(tiny_models_dir / MODEL, model_id=MODEL)
        local.start_api()
        local.copy_model(MODEL, "hosta")  # hostb gets it by `homefleet sync` over its link (first test)
        for machine, host in hosts.items():
            local.start_worker(
                machine,
                netns=host.namespace,
                extra_env={
                    "HOMEFLEET_REDIS_URL": f"redis://{host.gateway}:{redis_port}/0",
                    "HOMEFLEET_SERVER_URL": f"http://{server_address}:{api_port}",
                },
            )
        local.wait_online(["hosta"], model_id=MODEL, timeout_s=180)
        local.wait_online(["hostb"], timeout_s=180)
        with HomefleetClient(local.api_url, api_key=TEST_API_KEY) as client:
            yield MultiHostFleet(local, ctx, client, hosts, redis_port, net)
    finally:
        if local is not None:
            local.stop()
        if ctx is not None:
            ctx.close()
        redis_server.stop()
        for machine, index in HOSTS.items():
            remove_host(RUN, machine, index)


def _wait_redis(url: str) -> None:
    import time

    client = redis.Redis.from_url(url, socket_timeout=1)
    deadline = time.monotonic() + 10
    while True:
        try:
            client.ping()
            return
        except redis.ConnectionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
