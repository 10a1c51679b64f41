"""A real network: workers on their own hosts (network namespaces + veth) reach
the server's Redis and API only over their links."""

from __future__ import annotations

import signal
import subprocess
import time

import pytest

from app.client import ApiError
from app.core.digest import file_digest
from tests.helpers import run_cli, settings_env, wait_for
from tests.netns.conftest import MODEL, MultiHostFleet

pytestmark = pytest.mark.e2e


def peers(fleet: MultiHostFleet, machine: str) -> set[str]:
    """Remote ends of the established TCP connections inside that host's namespace."""
    out = subprocess.run([*fleet.hosts[machine].netns, "ss", "-tnH", "state", "established"], capture_output=True,
                         text=True, check=True, timeout=10).stdout
    return {line.split()[-1] for line in out.splitlines() if line.strip()}


def test_r6_sync_copies_a_model_to_a_remote_host_over_its_link(multihost: MultiHostFleet) -> None:
    folder = multihost.local.models_dir("hostb") / MODEL
    assert not folder.exists()
    with pytest.raises(ApiError) as refused:
        multihost.client.submit(MODEL, "txt2img", {"prompt": "x", "steps": 2}, target="hostb")
    assert refused.value.reason == "model_not_verified"
    run_cli("sync", "hostb", MODEL, env=settings_env(multihost.local.settings), timeout_s=300)
    wait_for(lambda: MODEL in multihost.ctx.machines.view("hostb").verified_models, timeout_s=60,
             what="hostb to advertise the synced model")
    manifest = {f.path: f.digest for f in multihost.ctx.registry.manifest(MODEL).files}
    assert {p.relative_to(folder).as_posix(): file_digest(p) for p in folder.rglob("*") if p.is_file()
            and not p.name.startswith(".")} == manifest
    accepted = multihost.client.submit(MODEL, "txt2img", {"prompt": "synced", "steps": 2}, target="hostb")
    assert multihost.client.wait(accepted["id"], timeout_s=180)["state"] == "succeeded"


def test_workers_reach_the_server_only_over_their_link(multihost: MultiHostFleet) -> None:
    api_port = multihost.local.settings.api_port
    for machine, host in multihost.hosts.items():
        accepted = multihost.client.submit(MODEL, "txt2img", {"prompt": machine, "steps": 2}, target=machine)
        assert multihost.client.wait(accepted["id"], timeout_s=180)["state"] == "succeeded"
        allowed = {f"{host.gateway}:{multihost.redis_port}", f"{multihost.local.settings.api_host}:{api_port}"}
        seen = peers(multihost, machine)
        who = subprocess.run([*multihost.hosts[machine].netns, "ss", "-tnpH", "state", "established"],
                             check=False, capture_output=True, text=True, timeout=10).stdout
        assert seen and seen <= allowed, f"{machine} talks to {seen - allowed}: {who}"


def test_r11_auto_places_across_hosts(multihost: MultiHostFleet) -> None:
    jobs = [multihost.client.submit(MODEL, "txt2img", {"prompt": f"a{i}", "steps": 2}, target="auto") for i in range(4)]
    done = [multihost.client.wait(j["id"], timeout_s=180) for j in jobs]
    assert all(j["state"] == "succeeded" for j in done)
    assert {j["machine"] for j in done} == {"hosta", "hostb"}  # the server machine has no worker here


def test_r10_a_job_pinned_to_a_host_whose_link_is_down_is_refused_not_rerouted(multihost: MultiHostFleet) -> None:
    host = multihost.hosts["hostb"]
    host.link(up=False)
    try:
        wait_for(lambda: not multihost.ctx.machines.view("hostb").online, timeout_s=30, what="hostb to go offline")
        with pytest.raises(ApiError) as refused:
            multihost.client.submit(MODEL, "txt2img", {"prompt": "x", "steps": 2}, target="hostb")
        assert (refused.value.status_code, refused.value.reason) == (503, "machine_unavailable")
        assert multihost.ctx.redis.llen(multihost.ctx.keys.queue_list("hostb")) == 0
        assert multihost.ctx.redis.llen(multihost.ctx.keys.queue_list("hosta")) == 0  # not rerouted either
        auto = multihost.client.submit(MODEL, "txt2img", {"prompt": "auto", "steps": 2}, target="auto")
        assert auto["machine"] == "hosta"
        assert multihost.client.wait(auto["id"], timeout_s=180)["state"] == "succeeded"
    finally:
        host.link(up=True)
    wait_for(lambda: multihost.ctx.machines.view("hostb").online, timeout_s=60, what="hostb to come back")


def test_r19_a_worker_host_killed_mid_job_is_interrupted_and_not_rerun(multihost: MultiHostFleet) -> None:
    accepted = multihost.client.submit(MODEL, "txt2img", {"prompt": "long", "steps": 60}, target="hosta")
    wait_for(lambda: multihost.client.get(accepted["id"])["state"] == "running", timeout_s=120, what="the job to start")
    multihost.local.stop_worker("hosta", signal.SIGKILL)
    wait_for(lambda: multihost.client.get(accepted["id"])["state"] == "interrupted", timeout_s=60,
             what="reconciliation to interrupt the job")
    time.sleep(2)
    job = multihost.client.get(accepted["id"])
    assert (job["state"], job["reason"]) == ("interrupted", "worker_lost")
    events = [e.event for e in multihost.ctx.journal.events(accepted["id"])]
    assert events.count("running") == 1
