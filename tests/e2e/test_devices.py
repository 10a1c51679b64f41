"""Several devices on one host end to end (docs/operations.md, "Several devices on one host"): a
fleet-file host entry with two devices, on this (CPU) host.

One module-scoped fleet: the API and two real ``celery worker`` processes, machines ``box:0``
and ``box:1`` of host ``box`` (``devices = 2``, one token), each started by
``LocalFleet.start_host`` with its own model folder. Machine ``server`` is listed (R9) but runs
no worker. No CUDA device exists here: the binding is checked in the environment each
worker process (and its pool process) got, and in the worker's own log line.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil
import pytest
import redis

from app.client import ApiError, HomefleetClient
from app.context import ServerContext, build_context
from app.core import keys
from app.core.config import Settings
from app.core.secret_files import write_private
from app.core.tls import tls_context
from app.devtools.localfleet import LocalFleet
from app.devtools.redis_server import free_port
from app.fleet.config import load_fleet
from tests.e2e.test_docs_browser import browser
from tests.e2e.test_fleet_page import open_page
from tests.helpers import TEST_API_KEY, pool_process, run_cli, settings_env, wait_for

__all__ = ["browser"]  # the fixture (tests/e2e/test_docs_browser.py)

pytestmark = pytest.mark.e2e

MODEL = "tiny-sd"
DEVICES = ("box:0", "box:1")
PARAMS = {"prompt": "a lighthouse on two cards", "steps": 2}
FLEET_TOML = """
[[machines]]
name = "server"
backend = "cpu"
memory_kind = "unified"
memory_bytes = 4_000_000_000
families = ["sd1"]
token = "token-server-xxxxxxxxxxxxxxxxxxxx"

[[machines]]
name = "box"
backend = "cpu"
devices = 2
memory_kind = "unified"
memory_bytes = 4_000_000_000
families = ["sd1"]
token = "token-box-shared-by-its-devices-xx"
"""


@dataclass
class DeviceFleet:
    local: LocalFleet
    ctx: ServerContext
    client: HomefleetClient
    settings: Settings

    def log(self, machine: str) -> str:
        return (self.local.logs_dir / f"worker-{machine}.log").read_text(errors="replace")


@pytest.fixture(scope="module")
def devices(
    tmp_path_factory: pytest.TempPathFactory, redis_base_url: str, tiny_models_dir: Path
) -> Iterator[DeviceFleet]:
    data_dir = tmp_path_factory.mktemp("devices")
    redis_url = f"{redis_base_url}/9"
    redis.Redis.from_url(redis_url).flushdb()
    fleet_file = data_dir / "fleet.toml"
    write_private(fleet_file, FLEET_TOML)
    fleet = load_fleet(fleet_file)
    settings = Settings(
        data_dir=data_dir,
        redis_url=redis_url,
        fleet_file=fleet_file,
        api_port=free_port(),
        heartbeat_interval_s=0.5,
        heartbeat_ttl_s=8,
        api_keys=[TEST_API_KEY],
    )
    local = LocalFleet(settings, fleet, fleet_file)
    ctx = build_context(settings, fleet, migrate=True)
    client = HomefleetClient(local.api_url, api_key=TEST_API_KEY)
    try:
        ctx.registry.add(tiny_models_dir / MODEL, model_id=MODEL)
        for machine in DEVICES:
            local.copy_model(MODEL, machine)
        local.start_api()
        # tokens from files, as an operator should start workers (exec'd: what `ps` shows is theirs)
        assert sorted(local.start_host("box", token_file=True)) == list(DEVICES)
        local.wait_online(list(DEVICES), model_id=MODEL, timeout_s=180)
        yield DeviceFleet(local, ctx, client, settings)
    finally:
        client.close()
        local.stop()
        ctx.close()


def test_a_two_device_host_is_two_machines_each_with_its_own_worker_bound_to_its_device(devices: DeviceFleet) -> None:
    assert list(devices.ctx.fleet.machines) == ["server", *DEVICES]
    for index, machine in enumerate(DEVICES):
        process = psutil.Process(devices.local.processes[f"worker-{machine}"].pid)
        assert process.environ()["CUDA_VISIBLE_DEVICES"] == str(index)
        assert process.environ()["HOMEFLEET_MACHINE"] == machine
        # the prefork pool process, where jobs run (forked once the first heartbeat is written)
        pool = pool_process(process.pid)
        assert pool.environ()["CUDA_VISIBLE_DEVICES"] == str(index)
        # the worker bound itself (tasks/devices.py bind_device), and consumes its own queue only
        assert f"{machine}: bound to device {index} (CUDA_VISIBLE_DEVICES={index})" in devices.log(machine)
        # its Celery node name, with the ':' (Flower shows the worker by it)
        assert "torch was imported before the device was bound" not in devices.log(machine)
        node = wait_for(
            lambda m=machine: devices.ctx.redis.get(devices.ctx.keys.node(m)),
            timeout_s=60,
            what=f"{machine}'s worker to be ready",
        )
        node = node.decode() if isinstance(node, bytes) else str(node)
        assert node.startswith(f"{machine}@")
        # Celery's control channel (Flower's worker pages, `celery control revoke`) reaches it by that name
        # (asked again until it answers: a worker still starting under load may miss one broadcast)
        replies = wait_for(
            lambda n=node: devices.ctx.celery.control.inspect(destination=[n], timeout=5).active_queues(),
            timeout_s=90,
            what=f"{machine}'s worker to answer inspect",
            poll_s=0.5,
        )
        assert [queue["name"] for queue in replies[node]] == [keys.queue(machine)]
    worker_pids = {devices.local.processes[f"worker-{m}"].pid for m in DEVICES}
    assert len(worker_pids) == 2


def test_the_workers_read_their_tokens_from_files_not_the_command_line_or_environment(devices: DeviceFleet) -> None:
    """R7: a worker started with ``--token-file`` shows its token nowhere ``ps`` or ``/proc``
    can read it, nor does its pool process."""
    for machine in DEVICES:
        token = devices.ctx.fleet.machines[machine].token
        assert token
        process = psutil.Process(devices.local.processes[f"worker-{machine}"].pid)
        assert "--token-file" in process.cmdline()
        for each in (process, pool_process(process.pid)):
            assert token not in " ".join(each.cmdline())
            assert token not in "".join(each.environ().values())


def test_a_job_pinned_to_each_device_runs_on_that_devices_worker(devices: DeviceFleet) -> None:
    jobs = {machine: devices.client.submit(MODEL, "txt2img", PARAMS, target=machine) for machine in DEVICES}
    assert {machine: job["machine"] for machine, job in jobs.items()} == {m: m for m in DEVICES}
    for machine, job in jobs.items():
        done = devices.client.wait(job["id"], timeout_s=180)
        assert (done["state"], done["machine"]) == ("succeeded", machine), done
        journaled = devices.ctx.journal.get(job["id"])
        assert (journaled.machine, journaled.target) == (machine, machine)
        other = next(m for m in DEVICES if m != machine)
        wait_for(
            lambda job_id=job["id"], m=machine: f"[{job_id}] succeeded" in devices.log(m),
            timeout_s=30,
            what=f"{machine}'s log to show its job",
        )
        assert job["id"] not in devices.log(other)


def test_auto_places_on_either_device_of_the_host(devices: DeviceFleet) -> None:
    url, auth = devices.local.api_url, devices.local.auth_headers
    body = {"model": MODEL, "kind": "txt2img", "target": "auto", "params": PARAMS}
    answer = httpx.post(f"{url}/v1/jobs?dry_run=true", headers=auth, json=body, timeout=30, verify=tls_context())
    assert answer.status_code == 200, answer.text
    ranked = answer.json()["machines"]
    assert ranked["box:0"]["eligible"] and ranked["box:1"]["eligible"]
    assert (ranked["server"]["eligible"], ranked["server"]["reason"]) == (False, "machine_unavailable")  # no worker
    placed = []
    for drained, free in (("box:0", "box:1"), ("box:1", "box:0")):  # each device in turn the only one Auto may use
        devices.ctx.redis.set(devices.ctx.keys.draining(drained), "1")
        try:
            job = devices.client.submit(MODEL, "txt2img", PARAMS, target="auto")
        finally:
            devices.ctx.redis.delete(devices.ctx.keys.draining(drained))
        assert job["machine"] == free
        placed.append(job)
    for job in placed:
        done = devices.client.wait(job["id"], timeout_s=180)
        assert done["state"] == "succeeded", done
    assert [devices.ctx.journal.get(job["id"]).machine for job in placed] == ["box:1", "box:0"]
    for unknown in ("box", "box:2"):  # the host alone is no machine, nor a device it does not declare
        with pytest.raises(ApiError) as refused:
            devices.client.submit(MODEL, "txt2img", PARAMS, target=unknown)
        assert (refused.value.status_code, refused.value.reason) == (422, "unknown_machine")
        assert repr(unknown) in refused.value.message


def test_status_groups_the_devices_under_their_host_and_urls_take_the_colon(devices: DeviceFleet) -> None:
    done = run_cli("status", "--json", env=settings_env(devices.settings))
    status = json.loads(done.stdout)
    assert [(host["host"], [row["name"] for row in host["machines"]]) for host in status["hosts"]] == [
        ("server", ["server"]),
        ("box", list(DEVICES)),
    ]
    box = status["hosts"][1]["machines"]
    assert [(row["host"], row["device"], row["online"]) for row in box] == [("box", 0, True), ("box", 1, True)]
    assert all(MODEL in row["verified_models"] for row in box)
    assert status["dead_letters"] == 0
    table = run_cli("status", env={**settings_env(devices.settings), "COLUMNS": "200"}).stdout
    lines = [line for line in table.splitlines() if "box" in line]
    assert len(lines) == 3 and "2/2" in lines[0] and "2 devices" in lines[0]  # the host line, its devices under it
    assert "box:0" in lines[1] and "box:1" in lines[2]
    rows = {row["name"]: row for row in devices.client.machines()}
    assert (rows["box:1"]["host"], rows["box:1"]["device"], rows["server"]["host"], rows["server"]["device"]) == (
        "box",
        1,
        "server",
        None,
    )
    for path in ("/v1/machines/box:1/residency", "/v1/machines/box%3A1/residency"):
        answer = httpx.get(
            f"{devices.local.api_url}{path}", headers=devices.local.auth_headers, timeout=30, verify=tls_context()
        )
        assert answer.status_code == 200, answer.text
        assert answer.json()["machine"] == "box:1"
    missing = httpx.get(
        f"{devices.local.api_url}/v1/machines/box:7/residency",
        headers=devices.local.auth_headers,
        timeout=30,
        verify=tls_context(),
    )
    assert missing.status_code == 404, missing.text


def test_the_hosts_token_serves_each_device_only_under_its_own_name(devices: DeviceFleet) -> None:
    token = devices.ctx.fleet.machines["box:0"].token
    url = f"{devices.local.api_url}/internal/v1/manifest"
    for machine in DEVICES:
        answer = httpx.get(
            url,
            headers={"Authorization": f"Bearer {token}", "X-Homefleet-Machine": machine},
            timeout=30,
            verify=tls_context(),
        )
        assert answer.status_code == 200, answer.text
    unnamed = httpx.get(url, headers={"Authorization": f"Bearer {token}"}, timeout=30, verify=tls_context())
    assert unnamed.status_code == 401 and "shared by its devices box:0, box:1" in unnamed.text
    server = httpx.get(
        url,
        headers={"Authorization": f"Bearer {token}", "X-Homefleet-Machine": "server"},
        timeout=30,
        verify=tls_context(),
    )
    assert server.status_code == 401 and "its token belongs to machine" in server.text


def test_a_hosts_devices_are_grouped_under_it(devices: DeviceFleet, browser: object) -> None:
    """On this module's fleet (host ``box`` of two devices), the fleet page's Fleet view
    (tests/e2e/test_fleet_page.py) shows one host row, then ``box:0`` and ``box:1`` under it with
    their device index; ``server`` (a single-device machine) is its own row. Here, not with the
    page's other tests, so that this fleet starts once."""
    driver = browser
    wait = open_page(driver, devices.local.api_url)
    rows = (
        "return [...document.querySelectorAll('#machines tbody tr')]"
        ".map(r => r.dataset.host ? `host ${r.dataset.host}` : r.dataset.machine)"
    )
    wait.until(lambda d: d.execute_script(rows) == ["server", "host box", "box:0", "box:1"])
    texts = driver.execute_script(  # type: ignore[attr-defined]
        "return [...document.querySelectorAll('#machines tbody tr')].map(r => r.innerText)"
    )
    assert "2 devices" in texts[1] and "#0" in texts[2] and "#1" in texts[3], texts
